// ConvWeightGrad: the weight gradient of a 2-D convolution (ONNX Conv attributes, group 1),
// free of ONNX Runtime types so that the CUDA file, the CPU kernel and the op glue
// (conv_grad_op.cc) share one description of a call.
//
//   dw[co, ci, i, j] = sum over n, oh, ow of dy[n, co, oh, ow] * x[n, ci, oh*sh + i*dh - pt, ow*sw + j*dw - pl]
//                      (x is 0 in the padding)
//
// x is [N, Cin, H, W], dy [N, Cout, Ho, Wo] (Ho, Wo as im2col.h computes them from the pads
// [top, left, bottom, right]), dw [Cout, Cin, kh, kw]; all three float32, or all float16 (the
// sums in float32, one rounding to float16). What the Gemm over Im2Col(x) of the step graph's
// rule 1 computes (onnxcampo/training/simplify.py), in one op: on CUDA cuDNN's backward-filter
// convolution (NCHW), on the CPU a direct loop.
#pragma once

#include <cstdint>
#include <string>

#include "im2col.h"
#include "parallel.h"

struct OrtCustomOp;  // onnxruntime_c_api.h

namespace onnxcampo {

const OrtCustomOp* ConvWeightGradOp(bool cuda);

struct ConvGradArgs {
  const void* x = nullptr;
  const void* dy = nullptr;
  void* dw = nullptr;
  bool half = false;  // float16 tensors, else float32
  int64_t n = 0, cin = 0, h = 0, w = 0, cout = 0, ho = 0, wo = 0;
  Im2ColAttrs a;  // kernel_shape, strides, dilations, pads
};

// Tasks of one (co, ci) pair each, run by `run`; every sum is taken in one fixed order, so the
// results do not depend on the thread count.
void ConvWeightGradCpu(const ConvGradArgs& args, const ParallelRunner& run);

#ifdef ONNXCAMPO_WITH_CUDA
// cuDNN's cudnnConvolutionBackwardFilter on `stream` (a cudaStream_t). Needs symmetric pads
// (pt == pb or the extra bottom rows unused, likewise left/right: checked by the op). The first
// call of a shape picks the fastest algorithm (cudnnFind..., which synchronises and allocates)
// and grows a workspace shared by the calls on the same stream; later calls allocate nothing
// and do not synchronise (capturable into a CUDA graph). Throws with cuDNN's message.
void ConvWeightGradCuda(const ConvGradArgs& args, void* stream);
#endif

}  // namespace onnxcampo
