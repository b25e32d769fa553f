// ScatterNDAdd on CUDA: the copy of data into output (cudaMemcpyAsync, device to device), then one
// grid-stride launch over the update elements, each added to its destination with an atomic add.
//
// ONNX Runtime's own kernel (_ScatterNDKernelReduction) runs one thread per index tuple with a
// serial loop over the slice: for an embedding gradient (4096 tuples of 768 elements) that is 4096
// threads, each doing 768 dependent atomics. Here thread i takes element i (grid-stride), so
// neighbouring threads read neighbouring updates and write neighbouring outputs. Where the slice
// length allows it and the buffers are aligned (ORT's allocations are), a thread takes W = 4
// float32 elements (one 16-byte load; on sm_90 one vector atomic, atom.global.add.v4.f32) or
// W = 2 float16 elements (one atom.add.noftz.f16x2); otherwise one element.
//
// Arithmetic: every addition is one hardware atomic, float32 (PTX atom.add.f32: round to nearest
// even; subnormal inputs and results may be flushed to zero, as in ONNX Runtime's kernel) or float16
// (atom.add.noftz.f16: round to nearest even, subnormals kept, a float16 running sum: each
// addition rounds to float16). The order of the additions into one element is not fixed, so sums
// of several updates may differ from the CPU kernel's in the last bits.
//
// Indices out of range are clamped as ONNX Runtime's CUDA kernel clamps them (index >= d: d - 1;
// index < -d: 0), since a kernel cannot report an error without synchronising.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda_util.h"
#include "scatter.h"

namespace onnxcampo {
namespace {

constexpr int kThreads = 256;

struct IndexDims {
  int k;
  int64_t dims[kScatterMaxIndexDims];
  int64_t strides[kScatterMaxIndexDims];
};

int Blocks(int64_t work) {
  const int most = MultiprocessorCount() * (2048 / kThreads);
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, most)));
}

// The element offset of index tuple `t`'s slice in data, indices clamped like ORT's kernel.
__device__ __forceinline__ int64_t SliceOffset(const int64_t* indices, int64_t t, const IndexDims& d) {
  int64_t offset = 0;
  for (int j = 0; j < d.k; ++j) {
    int64_t index = indices[t * d.k + j];
    const int64_t dim = d.dims[j];
    if (index >= 0) {
      if (index >= dim) index = dim - 1;
    } else {
      index = index < -dim ? 0 : index + dim;
    }
    offset += index * d.strides[j];
  }
  return offset;
}

template <int W>
__device__ __forceinline__ void AddFloat(float* out, const float* update) {
  if constexpr (W == 4) {
    const float4 u = *reinterpret_cast<const float4*>(update);
#if __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(out), u);
#else
    atomicAdd(out, u.x);
    atomicAdd(out + 1, u.y);
    atomicAdd(out + 2, u.z);
    atomicAdd(out + 3, u.w);
#endif
  } else {
    atomicAdd(out, *update);
  }
}

template <int W>
__device__ __forceinline__ void AddHalf(__half* out, const __half* update) {
  if constexpr (W == 2) {
    atomicAdd(reinterpret_cast<__half2*>(out), *reinterpret_cast<const __half2*>(update));
  } else {
    atomicAdd(out, *update);
  }
}

// Thread i (grid-stride) adds update elements W*i .. W*i + W - 1; `I` is the type of the
// element counters (32-bit where the call allows it: a cheaper division).
template <typename T, int W, typename I>
__global__ void __launch_bounds__(kThreads) ScatterAddKernel(T* out, const int64_t* indices, const T* updates,
                                                             I groups, I slice_groups, const __grid_constant__ IndexDims d) {
  for (I g = static_cast<I>(blockIdx.x) * kThreads + threadIdx.x; g < groups; g += static_cast<I>(gridDim.x) * kThreads) {
    const I t = g / slice_groups;
    const I column = (g - t * slice_groups) * W;
    const int64_t destination = SliceOffset(indices, static_cast<int64_t>(t), d) + column;
    const T* update = updates + static_cast<int64_t>(g) * W;
    if constexpr (sizeof(T) == 4) {
      AddFloat<W>(reinterpret_cast<float*>(out) + destination, reinterpret_cast<const float*>(update));
    } else {
      AddHalf<W>(reinterpret_cast<__half*>(out) + destination, reinterpret_cast<const __half*>(update));
    }
  }
}

template <typename T, int W>
void Launch(const ScatterArgs& a, const IndexDims& d, cudaStream_t stream) {
  const int64_t groups = a.tuples * (a.slice / W);
  const int blocks = Blocks(groups);
  T* out = static_cast<T*>(a.output);
  const T* updates = static_cast<const T*>(a.updates);
  if (groups <= INT32_MAX) {
    ScatterAddKernel<T, W, uint32_t><<<blocks, kThreads, 0, stream>>>(
        out, a.indices, updates, static_cast<uint32_t>(groups), static_cast<uint32_t>(a.slice / W), d);
  } else {
    ScatterAddKernel<T, W, int64_t><<<blocks, kThreads, 0, stream>>>(out, a.indices, updates, groups, a.slice / W, d);
  }
  CudaCheck(cudaGetLastError(), "ScatterNDAdd launch");
}

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

void ScatterNDAddCuda(const ScatterArgs& a, void* stream_handle) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const size_t element_bytes = a.half ? sizeof(__half) : sizeof(float);
  if (a.data_elements > 0 && a.output != a.data) {
    CudaCheck(cudaMemcpyAsync(a.output, a.data, static_cast<size_t>(a.data_elements) * element_bytes,
                          cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpyAsync(output <- data)");
  }
  if (a.data_elements == 0 || a.tuples == 0 || a.slice == 0) return;  // nothing to add: no launch
  IndexDims d{};
  d.k = a.k;
  for (int j = 0; j < a.k; ++j) {
    d.dims[j] = a.dims[j];
    d.strides[j] = a.strides[j];
  }
  if (a.half) {
    if (a.slice % 2 == 0 && Aligned(a.output, 4) && Aligned(a.updates, 4)) return Launch<__half, 2>(a, d, stream);
    return Launch<__half, 1>(a, d, stream);
  }
  if (a.slice % 4 == 0 && Aligned(a.output, 16) && Aligned(a.updates, 16)) return Launch<float, 4>(a, d, stream);
  Launch<float, 1>(a, d, stream);
}

}  // namespace onnxcampo
