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

#include "im2col/im2col.h"
#include "parallel.h"

namespace onnxcampo {

struct ConvGradArgs {
  const void* x = nullptr;
  const void* dy = nullptr;
  void* dw = nullptr;
  bool half = false;  // float16 tensors, else float32
  bool graph = false;  // on CUDA, cuDNN's graph API (CudnnGraphApiAsked, when the node's kernel was made)
  int64_t n = 0, cin = 0, h = 0, w = 0, cout = 0, ho = 0, wo = 0;
  Im2ColAttrs a;  // kernel_shape, strides, dilations, pads
};

// Tasks of one (co, ci) pair each, run by `run`; every sum is taken in one fixed order, so the
// results do not depend on the thread count.
void ConvWeightGradCpu(const ConvGradArgs& args, const ParallelRunner& run);

// One cuDNN convolution call of any direction and layout: what ConvWeightGrad (NCHW backward
// filter) and the NHWC ops of conv_nhwc.h run on CUDA. Shapes are logical: x [N, Cin, H, W],
// y / dy [N, Cout, Ho, Wo], the filter [Cout, Cin / group, kh, kw]; `nhwc` stores x and y / dy
// as [N, H, W, C], `krsc` the filter as [Cout, kh, kw, Cin / group] (else [Cout, Cin / group,
// kh, kw]). `group` > 1 (a grouped or depthwise convolution: output channel co reads the input
// channels of its group, co / (Cout / group)) is for the forward kind only.
enum class ConvKind { kForward, kData, kFilter };  // y = conv(x, w); dx from (dy, w); dw from (x, dy)
struct ConvCall {
  ConvKind kind = ConvKind::kFilter;
  const void* x = nullptr;   // forward, filter
  const void* w = nullptr;   // forward, data
  const void* dy = nullptr;  // data, filter
  void* out = nullptr;       // y, dx or dw
  bool half = false, nhwc = false, krsc = false;
  bool graph = false;  // plan a new shape with cuDNN's graph API (else, or where it has none, the legacy calls)
  int64_t n = 0, cin = 0, h = 0, w_ = 0, cout = 0, ho = 0, wo = 0;
  int64_t group = 1;  // divides cin and cout
  Im2ColAttrs a;
};

#ifdef ONNXCAMPO_WITH_CUDA
// Whether a kernel made now plans its shapes with cuDNN's graph API: ONNXCAMPO_CUDNN_API=graph or
// =legacy, unset the library's default (conv_grad.cu). Read when a session makes the node's
// kernel, so that two sessions of one process can run the two ways side by side.
bool CudnnGraphApiAsked();

// `call` on `stream` with cuDNN (loaded at run time); cuDNN pads symmetrically (top/left; the op
// checks that this gives the call's Ho, Wo). The first call of a shape picks the fastest
// algorithm (synchronises, allocates); later calls are capturable into a CUDA graph.
void CudnnConvolution(const ConvCall& call, void* stream);

// cuDNN's cudnnConvolutionBackwardFilter on `stream` (a cudaStream_t). Needs symmetric pads
// (pt == pb or the extra bottom rows unused, likewise left/right: checked by the op). The first
// call of a shape picks the fastest algorithm (cudnnFind..., which synchronises and allocates)
// and grows a workspace shared by the calls on the same stream; later calls allocate nothing
// and do not synchronise (capturable into a CUDA graph). Throws with cuDNN's message.
void ConvWeightGradCuda(const ConvGradArgs& args, void* stream);
#endif

}  // namespace onnxcampo
