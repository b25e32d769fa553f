// Helpers the CUDA kernel files share (multi_tensor.cu, elementwise.cu, im2col.cu, reduce.cu,
// scatter.cu). Included by .cu files only.
#pragma once

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <stdexcept>
#include <string>

namespace onnxcampo {

// Throws std::runtime_error for a failed CUDA call; `what` names the call in the message.
inline void CudaCheck(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("onnxcampo_ops CUDA error in ") + what + ": " + cudaGetErrorString(status));
  }
}

// The multiprocessor count of the current device, asked once per thread and device.
inline int MultiprocessorCount() {
  static thread_local int device = -1, sms = 0;
  int current = 0;
  CudaCheck(cudaGetDevice(&current), "cudaGetDevice");
  if (current != device) {
    CudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, current), "cudaDeviceGetAttribute");
    device = current;
  }
  return sms;
}

// `*fn` = the symbol `name` of a dlopen'ed `library` (NVRTC, cuDNN: loaded at run time, the
// library links neither); false when it is missing.
template <typename F>
bool Bind(void* library, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(library, name));
  return *fn != nullptr;
}

}  // namespace onnxcampo
