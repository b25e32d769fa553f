// The NHWC convolution ops of a channels-last graph (onnxcampo/layout.py), ONNX Conv attributes
// (kernel_shape, strides, dilations, pads [top, left, bottom, right]; group on ConvNhwc only):
//
//   ConvNhwc[group = G](x [N, H, W, Cin], w [Cout, kh, kw, Cin / G]) -> y [N, Ho, Wo, Cout]
//     y[n, oh, ow, co] = sum over i, j, ci < Cin / G of
//                        x[n, oh*sh + i*dh - pt, ow*sw + j*dw - pl, g * Cin / G + ci] * w[co, i, j, ci]
//     with g = co / (Cout / G), the group of co (G = Cin = Cout: a depthwise convolution)
//   ConvNhwcDataGrad[input_spatial = (H, W)](dy [N, Ho, Wo, Cout], w) -> dx [N, H, W, Cin]
//     the adjoint of ConvNhwc in x (what ConvTranspose computes for a Conv's input gradient)
//   ConvNhwcWeightGrad(x [N, H, W, Cin], dy [N, Ho, Wo, Cout]) -> dw
//     the adjoint in w (ConvWeightGrad's sums over an NHWC x and dy)
//   The two gradient ops are of group-1 convolutions (a training step's grouped convolutions
//   stay NCHW: the layout pass converts only their forward, and only in inference graphs).
//
// The filter w / dw is [Cout, kh, kw, Cin] with filter_layout "KRSC" (the default: cuDNN's NHWC
// filter), or ONNX's [Cout, Cin, kh, kw] with "KCRS". All tensors float32, or all float16 (the
// sums in float32, one rounding). On CUDA cuDNN (conv_grad.cu's CudnnConvolution), on the CPU a
// direct loop per output row, every sum in one fixed order (the same bits for any thread count).
#pragma once

#include <cstdint>

#include "conv_grad/conv_grad.h"
#include "parallel.h"

namespace onnxcampo {

// `call` with nhwc set (krsc as the op's filter_layout) on the CPU.
void ConvNhwcCpu(const ConvCall& call, const ParallelRunner& run);

}  // namespace onnxcampo
