// The channels-last max pooling of a channels-last step graph (ResNet's stem pool) and its
// gradient, attributes kernel_shape [kh, kw] (kh*kw <= 255), strides [sh, sw], pads [top, left,
// bottom, right] with each pad below the kernel size along its axis (no dilations, floor mode):
//
//   MaxPoolNhwc(x [N, H, W, C]) -> (y [N, Ho, Wo, C], argmax [N, Ho, Wo, C] uint8, optional)
//     Ho = (H + pt + pb - kh) / sh + 1, Wo = (W + pl + pr - kw) / sw + 1;
//     y[n, oh, ow, c] = max over the taps (i, j) whose h = oh*sh - pt + i, w = ow*sw - pl + j lie
//     in the input (taps in the padding are skipped) of x[n, h, w, c]; argmax = i*kw + j of the
//     first maximum in row-major tap order: a later tap replaces the best only when it is
//     strictly greater or NaN, and a NaN best stays (the first NaN wins).
//   MaxPoolNhwcGrad[input_spatial = (H, W)](dy [N, Ho, Wo, C], argmax) -> dx [N, H, W, C]
//     dx[n, h, w, c] = sum of dy[n, oh, ow, c] over the windows (oh, ow) that hold (h, w) as tap
//     t = (h + pt - oh*sh)*kw + (w + pl - ow*sw) with argmax[n, oh, ow, c] == t, in float32, in
//     the order oh ascending, then ow ascending; one rounding to dy's type; 0 where no window
//     selects the element.
//
// x, y, dy, dx float32 or float16 (compared and summed in float32, which holds every float16
// exactly). Every window holds at least one input element (the pads are below the kernel size),
// so every y is an input element, copied bit for bit (NaN payloads too). Each output element is written by one thread or task, in one
// fixed order: no memset, no atomics, the same bits for any thread count, on the CPU and CUDA.
//
// Free of ONNX Runtime types: max_pool_op.cc reads and checks the call, max_pool_cpu.cc and
// max_pool.cu compute it. Pointers are host memory for the CPU kernels, device memory for CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ints_text.h"
#include "parallel.h"

namespace onnxcampo {

// argmax is one byte: a tap index below kh*kw.
constexpr int64_t kMaxPoolMaxTaps = 255;

struct MaxPoolAttrs {
  int64_t kh = 0, kw = 0;                  // kernel_shape
  int64_t sh = 1, sw = 1;                  // strides
  int64_t pt = 0, pl = 0, pb = 0, pr = 0;  // pads: top, left, bottom, right
};

// The attributes checked; "" when they are valid, else why not (without the op's name). An
// absent attribute is an empty vector with its `have_` flag false (kernel_shape is required;
// strides default to [1, 1], pads to zeros).
inline std::string MaxPoolCheck(const std::vector<int64_t>& kernel_shape, bool have_kernel_shape,
                                const std::vector<int64_t>& strides, bool have_strides, const std::vector<int64_t>& pads,
                                bool have_pads, MaxPoolAttrs* out) {
  if (!have_kernel_shape) return "attribute kernel_shape [kh, kw] is required";
  if (kernel_shape.size() != 2 || kernel_shape[0] < 1 || kernel_shape[1] < 1) {
    return "kernel_shape must be 2 positive ints [kh, kw], got " + IntsText(kernel_shape);
  }
  if (kernel_shape[0] > kMaxPoolMaxTaps || kernel_shape[1] > kMaxPoolMaxTaps ||
      kernel_shape[0] * kernel_shape[1] > kMaxPoolMaxTaps) {
    return "kernel_shape " + IntsText(kernel_shape) + " has more than " + std::to_string(kMaxPoolMaxTaps) +
           " taps (kh * kw): argmax is one byte";
  }
  const std::vector<int64_t> s = have_strides ? strides : std::vector<int64_t>{1, 1};
  const std::vector<int64_t> p = have_pads ? pads : std::vector<int64_t>{0, 0, 0, 0};
  if (s.size() != 2 || s[0] < 1 || s[1] < 1 || s[0] > (int64_t{1} << 30) || s[1] > (int64_t{1} << 30)) {
    return "strides must be 2 positive ints [sh, sw], got " + IntsText(s);
  }
  if (p.size() != 4 || p[0] < 0 || p[1] < 0 || p[2] < 0 || p[3] < 0) {
    return "pads must be 4 non-negative ints [top, left, bottom, right], got " + IntsText(p);
  }
  if (p[0] >= kernel_shape[0] || p[2] >= kernel_shape[0] || p[1] >= kernel_shape[1] || p[3] >= kernel_shape[1]) {
    return "pads " + IntsText(p) + " must each be below the kernel size along their axis (kernel_shape " +
           IntsText(kernel_shape) + "): a window must hold an input element";
  }
  out->kh = kernel_shape[0], out->kw = kernel_shape[1];
  out->sh = s[0], out->sw = s[1];
  out->pt = p[0], out->pl = p[1], out->pb = p[2], out->pr = p[3];
  return "";
}

// Ho and Wo for an H x W input; "" when the kernel fits the padded input, else why not.
inline std::string MaxPoolOutputSize(const MaxPoolAttrs& a, int64_t h, int64_t w, int64_t* ho, int64_t* wo) {
  if (h < 1 || w < 1) {
    return "the input's H and W must be positive, got " + std::to_string(h) + " x " + std::to_string(w);
  }
  const int64_t padded_h = h + a.pt + a.pb, padded_w = w + a.pl + a.pr;
  if (a.kh > padded_h || a.kw > padded_w) {
    return "kernel_shape " + std::to_string(a.kh) + " x " + std::to_string(a.kw) + " exceeds the padded input " +
           std::to_string(padded_h) + " x " + std::to_string(padded_w) + " (H, W plus pads)";
  }
  *ho = (padded_h - a.kh) / a.sh + 1;
  *wo = (padded_w - a.kw) / a.sw + 1;
  return "";
}

// The sizes of one call: x / dx [n, h, w, c], y / dy / argmax [n, ho, wo, c].
struct MaxPoolShape {
  bool half = false;  // float16 tensors, else float32
  int64_t n = 0, h = 0, w = 0, c = 0, ho = 0, wo = 0;
  MaxPoolAttrs a;
};

struct MaxPoolArgs : MaxPoolShape {
  const void* x = nullptr;
  void* y = nullptr;
  uint8_t* argmax = nullptr;  // null: the node has no argmax output
};

struct MaxPoolGradArgs : MaxPoolShape {
  const void* dy = nullptr;
  const uint8_t* argmax = nullptr;
  void* dx = nullptr;
};

// Tasks of one (n, output row) each (forward) or one (n, input row) each (gradient), run by `run`.
void MaxPoolNhwcCpu(const MaxPoolArgs& args, const ParallelRunner& run);
void MaxPoolNhwcGradCpu(const MaxPoolGradArgs& args, const ParallelRunner& run);

#ifdef ONNXCAMPO_WITH_CUDA
// One launch each on `stream` (a cudaStream_t), none for an empty output: nothing allocated,
// nothing synchronised (capturable into a CUDA graph). Forward: a thread per (n, oh, ow, V
// channels); gradient: a thread per (n, h, w, V channels); V = 8 (float16) or 4 (float32) with
// 16-byte loads and stores where C % V == 0 and the buffers are aligned, else 1.
void MaxPoolNhwcCuda(const MaxPoolArgs& args, void* stream);
void MaxPoolNhwcGradCuda(const MaxPoolGradArgs& args, void* stream);
#endif

}  // namespace onnxcampo
