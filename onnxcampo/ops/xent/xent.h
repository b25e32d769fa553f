// Softmax cross-entropy over the last axis, forward and backward, each one pass over the logits:
//
//   SoftmaxCrossEntropy(x, labels) -> (picked, lse)
//     lse[r]    = log(sum_{j < C} exp(x[r, j]))                      (float32)
//     picked[r] = x[r, l_r] - lse[r] when the label is valid, else 0  (log softmax at the label)
//   SoftmaxCrossEntropyGrad(x, lse, labels, scale) -> dx
//     dx[r, j]  = s_r [j == l_r] - exp(x[r, j] - lse[r]) (valid_r ? s_r : 0),  j < C
//     dx[r, j]  = 0,  C <= j < dx_width (rows padded for a GEMM that reads them: no Pad after)
//
// x: float32 or float16, `rows` rows of `width` >= C elements (row-major; a padded GEMM output read
// in place: columns C .. width-1 are skipped); labels: int64, one per row, l < 0 counted from the
// end as ONNX OneHot does (l + C), valid when 0 <= l < C after that; scale: float32 or float16,
// one value for all rows or one per row. Arithmetic in float32 (float16 inputs are exact in it;
// the CPU kernel adds a row's exponentials in float64), results rounded once to the output's type. dx is what the unfused step graph computes as
// g - exp(log_softmax(x)) * ReduceSum(g) with g = scale * OneHot(labels).
//
// Free of ONNX Runtime types: xent_op.cc reads the call, xent_cpu.cc and xent.cu compute it.
#pragma once

#include <array>
#include <cstdint>

#include "parallel.h"

namespace onnxcampo {

struct XentArgs {
  const void* x = nullptr;  // [rows, width]
  bool x_half = false;
  const int64_t* labels = nullptr;  // [rows]
  int64_t rows = 0, width = 0, classes = 0;
  // forward
  void* picked = nullptr;  // [rows], float16 when picked_half
  bool picked_half = false;
  float* lse_out = nullptr;  // [rows]
  // backward
  const float* lse = nullptr;  // [rows]
  const void* scale = nullptr;  // 1 or rows values
  bool scale_half = false;
  bool scale_per_row = false;
  void* dx = nullptr;  // [rows, dx_width]
  bool dx_half = false;
  int64_t dx_width = 0;  // >= classes; 0: classes
};

void SoftmaxCrossEntropyCpu(const XentArgs& args, const ParallelRunner& run);
void SoftmaxCrossEntropyGradCpu(const XentArgs& args, const ParallelRunner& run);

#ifdef ONNXCAMPO_WITH_CUDA
// One block per row, on `stream` (a cudaStream_t); nothing allocated or synchronised (CUDA graph
// capture records the launch). Forward: each thread keeps a running (max, sum of exp) over its
// columns, read once; the block combines them. Backward: one pass reading x, writing dx.
void SoftmaxCrossEntropyCuda(const XentArgs& args, void* stream);
void SoftmaxCrossEntropyGradCuda(const XentArgs& args, void* stream);
#endif

}  // namespace onnxcampo
