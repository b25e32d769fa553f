// The arithmetic of the onnxcampo ops, free of ONNX Runtime types so that the CUDA file
// (compiled by nvcc) and the CPU file share one description of every call.
//
// Pointers refer to ORT's buffers: host memory for the CPU kernels, device memory for the
// CUDA kernels (scalars included: lr, step, inv_scale and found_inf stay on the device).
#pragma once

#include <cstdint>
#include <vector>

#include "parallel.h"

namespace onnxcampo {

// A boolean held by a bool or a float scalar tensor; any nonzero value (NaN included) is true.
struct Flag {
  const void* data = nullptr;
  bool is_float = false;
};

// Gradients may be float16 or float32, tensor by tensor.
struct Grads {
  std::vector<const void*> data;
  std::vector<uint8_t> half;  // 1: float16, 0: float32
  std::vector<int64_t> size;  // elements
  size_t count() const { return data.size(); }
};

// out_i = float32(g_i) * inv_scale; found_inf = any g_i holds inf or NaN. `out` empty: the check
// alone (CheckFinite; inv_scale unused), the update reading g_i and inv_scale itself.
struct UnscaleArgs {
  const float* inv_scale = nullptr;
  Grads grads;
  std::vector<float*> out;
  bool* found_inf = nullptr;
};

// Momentum (v non-empty): v' = momentum*v + g; w' = w - lr*v'.  Plain: w' = w - lr*g.
// found_inf true: w' = w, v' = v. inv_scale set: g_i is a scaled gradient and the update uses
// float32(g_i) * inv_scale (UnscaleCheckFinite's u_i, the same float32 product, never written).
struct SgdArgs {
  const float* lr = nullptr;
  const float* inv_scale = nullptr;
  Flag found_inf;
  float momentum = 0.0f;
  Grads grads;
  std::vector<const float*> w, v;
  std::vector<float*> w_out, v_out;
};

// step' = step + 1; m' = b1*m + (1-b1)*g; v' = b2*v + (1-b2)*g*g;
// w' = w - lr*((m'/(1-b1^step')) / (sqrt(v'/(1-b2^step')) + eps) + wd*w).
// found_inf true: every output equals its input, step included. inv_scale: as SgdArgs'.
struct AdamWArgs {
  const float* lr = nullptr;
  const float* inv_scale = nullptr;
  const float* step = nullptr;
  Flag found_inf;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.01f;
  Grads grads;
  std::vector<const float*> w, m, v;
  std::vector<float*> w_out, m_out, v_out;
  float* step_out = nullptr;
};

// out_i = float16(in_i), rounded to nearest even (ONNX's Cast): a step's fp32 master weights
// cast for its fp16 compute in one call instead of a Cast node (a launch) each.
struct CastArgs {
  std::vector<const float*> in;
  std::vector<uint16_t*> out;  // float16 bits
  std::vector<int64_t> size;   // elements
};

// The CPU kernels cut all elements of a call into chunks (multi_tensor_cpu.cc) that `run` spreads
// over threads; every element is computed as in a serial loop, so results do not depend on
// the thread count.
void UnscaleCheckFiniteCpu(const UnscaleArgs& args, const ParallelRunner& run);
void MultiTensorSgdCpu(const SgdArgs& args, const ParallelRunner& run);
void MultiTensorAdamWCpu(const AdamWArgs& args, const ParallelRunner& run);
void MultiTensorCastCpu(const CastArgs& args, const ParallelRunner& run);

#ifdef ONNXCAMPO_WITH_CUDA
// One kernel launch per call (per ~460+ tensors; see multi_tensor.cu), on `stream` (a cudaStream_t).
void UnscaleCheckFiniteCuda(const UnscaleArgs& args, void* stream);
void MultiTensorSgdCuda(const SgdArgs& args, void* stream);
void MultiTensorAdamWCuda(const AdamWArgs& args, void* stream);
void MultiTensorCastCuda(const CastArgs& args, void* stream);
#endif

}  // namespace onnxcampo
