// Im2Col: the column matrix of a 2-D convolution, free of ONNX Runtime types so that the CUDA
// file (nvcc), the CPU file and the op glue (im2col_op.cc) share one description of a call.
//
//   columns[(c*kh + i)*kw + j, (n*Ho + oh)*Wo + ow] = x[n, c, oh*sh + i*dh - pt, ow*sw + j*dw - pl]
//                                                     (0 where that lies in the padding)
//
// x is [N, C, H, W] (float32 or float16, moved as raw 4- or 2-byte values: no arithmetic),
// columns is [C*kh*kw, N*Ho*Wo]; attributes follow ONNX Conv (kernel_shape [kh, kw], strides
// [sh, sw], dilations [dh, dw], pads [top, left, bottom, right]):
//   Ho = (H + pt + pb - ((kh - 1)*dh + 1)) / sh + 1, Wo likewise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ints_text.h"
#include "parallel.h"

struct OrtKernelInfo;  // onnxruntime_c_api.h

namespace onnxcampo {

struct Im2ColAttrs {
  int64_t kh = 0, kw = 0;    // kernel_shape
  int64_t sh = 1, sw = 1;    // strides
  int64_t dh = 1, dw = 1;    // dilations
  int64_t pt = 0, pl = 0, pb = 0, pr = 0;  // pads: top, left, bottom, right
};

// The attributes checked; "" when they are valid, else why not (without the op's name). An
// absent attribute is an empty vector (kernel_shape is required; the others have defaults).
inline std::string Im2ColCheck(const std::vector<int64_t>& kernel_shape, const std::vector<int64_t>& strides,
                               const std::vector<int64_t>& dilations, const std::vector<int64_t>& pads,
                               bool have_kernel_shape, Im2ColAttrs* out) {
  if (!have_kernel_shape) return "attribute kernel_shape [kh, kw] is required";
  if (kernel_shape.size() != 2 || kernel_shape[0] < 1 || kernel_shape[1] < 1) {
    return "kernel_shape must be 2 positive ints [kh, kw], got " + IntsText(kernel_shape);
  }
  if (strides.size() != 2 || strides[0] < 1 || strides[1] < 1) {
    return "strides must be 2 positive ints [sh, sw], got " + IntsText(strides);
  }
  if (dilations.size() != 2 || dilations[0] < 1 || dilations[1] < 1) {
    return "dilations must be 2 positive ints [dh, dw], got " + IntsText(dilations);
  }
  if (pads.size() != 4 || pads[0] < 0 || pads[1] < 0 || pads[2] < 0 || pads[3] < 0) {
    return "pads must be 4 non-negative ints [top, left, bottom, right], got " + IntsText(pads);
  }
  const int64_t limit = int64_t{1} << 30;  // keeps every product below in int64
  for (const auto* v : {&kernel_shape, &strides, &dilations, &pads}) {
    for (int64_t value : *v) {
      if (value > limit) return "attribute value " + std::to_string(value) + " is too large";
    }
  }
  out->kh = kernel_shape[0], out->kw = kernel_shape[1];
  out->sh = strides[0], out->sw = strides[1];
  out->dh = dilations[0], out->dw = dilations[1];
  out->pt = pads[0], out->pl = pads[1], out->pb = pads[2], out->pr = pads[3];
  return "";
}

// The node's kernel_shape, strides, dilations and pads (ONNX Conv's defaults where absent),
// checked by Im2ColCheck: "" or why not (im2col_op.cc; ConvWeightGrad reads the same attributes).
std::string ReadIm2ColAttrs(const OrtKernelInfo* info, Im2ColAttrs* out);

// Ho and Wo for an H x W image; "" when the kernel fits the padded image, else why not.
inline std::string Im2ColOutputSize(const Im2ColAttrs& a, int64_t h, int64_t w, int64_t* ho, int64_t* wo) {
  const int64_t extent_h = (a.kh - 1) * a.dh + 1, extent_w = (a.kw - 1) * a.dw + 1;
  const int64_t padded_h = h + a.pt + a.pb, padded_w = w + a.pl + a.pr;
  if (extent_h > padded_h || extent_w > padded_w) {
    return "the kernel's extent " + std::to_string(extent_h) + " x " + std::to_string(extent_w) +
           " ((kernel_shape - 1) * dilations + 1) exceeds the padded input " + std::to_string(padded_h) + " x " +
           std::to_string(padded_w) + " (H, W plus pads)";
  }
  *ho = (padded_h - extent_h) / a.sh + 1;
  *wo = (padded_w - extent_w) / a.sw + 1;
  return "";
}

// One call: x and columns are host pointers for the CPU kernel, device pointers for CUDA.
struct Im2ColArgs {
  const void* x = nullptr;
  void* columns = nullptr;
  int element_size = 4;  // 4: float32, 2: float16
  int64_t n = 0, c = 0, h = 0, w = 0, ho = 0, wo = 0;
  Im2ColAttrs a;
};

// Rows (c, i, j) and images n cut into tasks of about 64K output elements, run by `run`; each
// output element is written once, so results do not depend on the thread count.
void Im2ColCpu(const Im2ColArgs& args, const ParallelRunner& run);

#ifdef ONNXCAMPO_WITH_CUDA
// One launch on `stream` (a cudaStream_t), none for an empty output: no allocation, no copy, no
// synchronisation (can be captured in a CUDA graph).
void Im2ColCuda(const Im2ColArgs& args, void* stream);
#endif

}  // namespace onnxcampo
