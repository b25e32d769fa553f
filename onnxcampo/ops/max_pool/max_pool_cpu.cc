// MaxPoolNhwc and MaxPoolNhwcGrad on the CPU (max_pool.h): the reference kernels for CI and the
// CPU provider, comparisons and sums in float32. Tasks: one (n, output row) each for the forward,
// one (n, input row) each for the gradient; every output element is written by one task in one
// fixed order, so the results do not depend on the thread count.
#include <algorithm>
#include <cstring>
#include <vector>

#include "elementwise/elementwise.h"  // the float16 <-> float32 conversions
#include "max_pool.h"

namespace onnxcampo {
namespace {

using ew::LoadAsFloat;
using ew::StoreFloat;

// y[n, oh, :, :] and argmax[n, oh, :, :]; y copies the bits of the element picked (NaN payloads too).
void ForwardRow(const MaxPoolArgs& g, int64_t n, int64_t oh) {
  const MaxPoolAttrs& a = g.a;
  std::vector<float> best(static_cast<size_t>(g.c));
  std::vector<int64_t> from(static_cast<size_t>(g.c));  // the element of x picked
  std::vector<uint8_t> arg(static_cast<size_t>(g.c));
  for (int64_t ow = 0; ow < g.wo; ++ow) {
    bool first = true;  // every window holds an input element (pads < kernel): `best` gets filled
    for (int64_t i = 0; i < a.kh; ++i) {
      const int64_t h = oh * a.sh - a.pt + i;
      if (h < 0 || h >= g.h) continue;
      for (int64_t j = 0; j < a.kw; ++j) {
        const int64_t w = ow * a.sw - a.pl + j;
        if (w < 0 || w >= g.w) continue;
        const int64_t x_at = ((n * g.h + h) * g.w + w) * g.c;
        const uint8_t tap = static_cast<uint8_t>(i * a.kw + j);
        for (int64_t c = 0; c < g.c; ++c) {
          const float v = LoadAsFloat(g.x, x_at + c, g.half);
          const float b = best[c];
          if (first || (b == b && (v > b || v != v))) {  // strictly greater, or the first NaN
            best[c] = v;
            from[c] = x_at + c;
            arg[c] = tap;
          }
        }
        first = false;
      }
    }
    const int64_t y_at = ((n * g.ho + oh) * g.wo + ow) * g.c;
    const size_t bytes = g.half ? 2 : 4;
    for (int64_t c = 0; c < g.c; ++c) {
      std::memcpy(static_cast<char*>(g.y) + (y_at + c) * bytes, static_cast<const char*>(g.x) + from[c] * bytes, bytes);
    }
    if (g.argmax != nullptr) {
      for (int64_t c = 0; c < g.c; ++c) g.argmax[y_at + c] = arg[c];
    }
  }
}

// dx[n, h, :, :]: per element the dy of the windows that picked it, oh ascending, then ow.
void GradRow(const MaxPoolGradArgs& g, int64_t n, int64_t h) {
  const MaxPoolAttrs& a = g.a;
  std::vector<float> acc(static_cast<size_t>(g.c));
  // the windows holding row h: oh*sh - pt <= h <= oh*sh - pt + kh - 1
  const int64_t top = h + a.pt - a.kh + 1;
  const int64_t oh_first = top <= 0 ? 0 : (top + a.sh - 1) / a.sh;
  const int64_t oh_last = std::min(g.ho - 1, (h + a.pt) / a.sh);
  for (int64_t w = 0; w < g.w; ++w) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    const int64_t left = w + a.pl - a.kw + 1;
    const int64_t ow_first = left <= 0 ? 0 : (left + a.sw - 1) / a.sw;
    const int64_t ow_last = std::min(g.wo - 1, (w + a.pl) / a.sw);
    for (int64_t oh = oh_first; oh <= oh_last; ++oh) {
      const int64_t i = h + a.pt - oh * a.sh;
      for (int64_t ow = ow_first; ow <= ow_last; ++ow) {
        const uint8_t tap = static_cast<uint8_t>(i * a.kw + (w + a.pl - ow * a.sw));
        const int64_t at = ((n * g.ho + oh) * g.wo + ow) * g.c;
        for (int64_t c = 0; c < g.c; ++c) {
          if (g.argmax[at + c] == tap) acc[c] += LoadAsFloat(g.dy, at + c, g.half);
        }
      }
    }
    const int64_t dx_at = ((n * g.h + h) * g.w + w) * g.c;
    for (int64_t c = 0; c < g.c; ++c) StoreFloat(g.dx, dx_at + c, acc[c], g.half);
  }
}

}  // namespace

void MaxPoolNhwcCpu(const MaxPoolArgs& g, const ParallelRunner& run) {
  if (g.n * g.ho == 0 || g.wo == 0 || g.c == 0) return;
  run(static_cast<size_t>(g.n * g.ho), [&](size_t t) {
    ForwardRow(g, static_cast<int64_t>(t) / g.ho, static_cast<int64_t>(t) % g.ho);
  });
}

void MaxPoolNhwcGradCpu(const MaxPoolGradArgs& g, const ParallelRunner& run) {
  if (g.n * g.h == 0 || g.w == 0 || g.c == 0) return;
  run(static_cast<size_t>(g.n * g.h), [&](size_t t) {
    GradRow(g, static_cast<int64_t>(t) / g.h, static_cast<int64_t>(t) % g.h);
  });
}

}  // namespace onnxcampo
