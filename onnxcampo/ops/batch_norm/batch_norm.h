// BatchNormStats and BatchNormGradSums: the per-channel sums of a training BatchNorm, each one
// pass over its inputs read as contiguous [P, Q, R] arrays (Q channels; NCHW: [N, C, H*W],
// channels-last: [N*H*W, C, 1]).
//
// BatchNormStats(x) -> (sum, centered): sum[q] = sum over p, r of x, and centered[q] = sum of
// (x - sum[q] / n)^2 with n = P * R: the two sums a training BatchNorm's mean and (biased)
// variance divide by n. One read of x: Welford's running mean and squared deviation per thread,
// merged pairwise (Chan et al.) in a fixed order, so the deviation is the two-pass one's.
//
// BatchNormGradSums(dy, c, invstd) -> (sum_dy, sum_dy_xhat): sum_dy[q] = sum of dy and
// sum_dy_xhat[q] = invstd[q] * sum of dy * c (c the centered input, invstd one value per
// channel): a training BatchNorm's bias and scale gradients, one read of dy and c.
//
// x, dy and c float32 or float16 each; invstd and the outputs float32; arithmetic in float32 on
// CUDA, float64 on the CPU (the reference kernel for tests without a GPU).
// Deterministic: the order of every addition is fixed by the shape (on CUDA also by the split,
// from the device's SM count), never by timing; no atomics. Free of ONNX Runtime types:
// batch_norm_op.cc reads the calls, batch_norm_cpu.cc and batch_norm.cu compute them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "parallel.h"

namespace onnxcampo {

struct ChannelSumsArgs {
  // BatchNormStats: a = x, b = null. BatchNormGradSums: a = dy, b = c, scale = invstd.
  const void* a = nullptr;
  bool a_half = false;
  const void* b = nullptr;
  bool b_half = false;
  const float* scale = nullptr;  // Q values (BatchNormGradSums)
  float* out0 = nullptr;         // Q values
  float* out1 = nullptr;         // Q values
  int64_t P = 0, Q = 0, R = 0;
};

void BatchNormStatsCpu(const ChannelSumsArgs& args, const ParallelRunner& run);
void BatchNormGradSumsCpu(const ChannelSumsArgs& args, const ParallelRunner& run);

#ifdef ONNXCAMPO_WITH_CUDA
// The float32 workspace a call takes on this device (0: none needed); a call given no workspace
// runs unsplit.
size_t ChannelSumsWorkspaceBytes(const ChannelSumsArgs& args);
// One kernel, or two with a workspace of ChannelSumsWorkspaceBytes (null: unsplit), on `stream`;
// nothing allocated or synchronised (CUDA graphs capture it).
void BatchNormStatsCuda(const ChannelSumsArgs& args, void* workspace, void* stream);
void BatchNormGradSumsCuda(const ChannelSumsArgs& args, void* workspace, void* stream);
#endif

}  // namespace onnxcampo
