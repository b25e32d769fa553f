// LayerNormGrad and SoftmaxGrad: the input gradients of a layer normalization and of a softmax
// over the last axis.
//
// LayerNormGrad: the input gradient of a layer normalization over the last axis, one pass over
// the rows (two reads of a row: the second from cache), given the standardized input:
//
//   g_j = dy_j * gamma_j,  a = mean_j(g_j),  b = mean_j(g_j * xhat_j)
//   dx_j = invstd * ((g_j - a) - xhat_j * b)  [+ acc_j]
//
// dy, xhat, acc and dx: `rows` rows of `cols` elements (row-major); invstd: one value per row;
// gamma: `cols` values. Each tensor float32 or float16 on its own; arithmetic in float32 (the
// sums a, b over a row in float32: per thread, then a tree on CUDA; in column order on the CPU),
// dx rounded once to its type. It is what the step graph's backward of LayerNormalization
// computes from xhat = (x - mean) * invstd (onnx-ad, simplify): Mul, two ReduceMeans, two Subs,
// two Muls, and the Sum that adds the residual branch's gradient (acc).
//
// SoftmaxGrad: dx_j = scale * y_j * (dy_j - sum_k(dy_k * y_k)) over each row of `cols` elements,
// y the softmax's output: what onnx-ad's backward of Softmax computes (Mul, ReduceSum, Sub, Mul;
// `scale` a constant factor after it, the attention's 1/sqrt(head size)).
//
// Free of ONNX Runtime types: norm_op.cc reads the calls, norm_cpu.cc and norm.cu compute them.
#pragma once

#include <cstdint>

#include "parallel.h"

namespace onnxcampo {

struct NormGradArgs {
  const void* dy = nullptr;
  bool dy_half = false;
  const void* xhat = nullptr;
  bool xhat_half = false;
  const void* invstd = nullptr;
  bool invstd_half = false;
  const void* gamma = nullptr;
  bool gamma_half = false;
  const void* acc = nullptr;  // null: none
  bool acc_half = false;
  void* dx = nullptr;
  bool dx_half = false;
  int64_t rows = 0, cols = 0;
};

struct SoftmaxGradArgs {
  const void* dy = nullptr;
  bool dy_half = false;
  const void* y = nullptr;
  bool y_half = false;
  void* dx = nullptr;
  bool dx_half = false;
  float scale = 1.0f;
  int64_t rows = 0, cols = 0;
};

void LayerNormGradCpu(const NormGradArgs& args, const ParallelRunner& run);
void SoftmaxGradCpu(const SoftmaxGradArgs& args, const ParallelRunner& run);

#ifdef ONNXCAMPO_WITH_CUDA
// One block per row on `stream` (a cudaStream_t); nothing allocated or synchronised.
void LayerNormGradCuda(const NormGradArgs& args, void* stream);
void SoftmaxGradCuda(const SoftmaxGradArgs& args, void* stream);
#endif

}  // namespace onnxcampo
