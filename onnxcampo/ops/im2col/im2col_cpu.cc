// Im2Col on the CPU (im2col.h has the layout). The output is a sequence of lines of Wo elements,
// line (r*N + n)*Ho + oh holding row r = (c*kh + i)*kw + j of image n at output row oh; it is
// cut into tasks of about kChunk elements for ORT's intra-op thread pool. A line reads one input
// row (or none: zeros), copying the output columns whose input column lies in the image and
// zeroing those in the padding; nothing is computed, so any thread count gives the same bits.
#include <algorithm>
#include <cstring>

#include "im2col.h"

namespace onnxcampo {
namespace {

constexpr int64_t kChunk = int64_t{1} << 16;  // output elements per task, as multi_tensor_cpu.cc

// Smallest q >= 0 with q*s >= v (v may be negative).
int64_t CeilDivPositive(int64_t v, int64_t s) { return v <= 0 ? 0 : (v + s - 1) / s; }

template <typename T>
void Lines(const Im2ColArgs& g, int64_t first, int64_t last) {
  const Im2ColAttrs& a = g.a;
  const T* x = static_cast<const T*>(g.x);
  T* dst = static_cast<T*>(g.columns) + first * g.wo;
  // the first line's coordinates, then counters stepped line by line (no division per line)
  int64_t oh = first % g.ho, n = (first / g.ho) % g.n, r = first / (g.ho * g.n);
  for (int64_t line = first; line < last; ++line, dst += g.wo) {
    const int64_t j = r % a.kw, i = (r / a.kw) % a.kh, c = r / (a.kw * a.kh);
    const int64_t h = oh * a.sh + i * a.dh - a.pt;
    if (h < 0 || h >= g.h) {
      std::fill(dst, dst + g.wo, T(0));
    } else {
      const T* src = x + ((n * g.c + c) * g.h + h) * g.w;
      // input column w = ow*sw + offset lies in [0, W) for ow in [lo, hi)
      const int64_t offset = j * a.dw - a.pl;
      const int64_t lo = std::min(g.wo, CeilDivPositive(-offset, a.sw));
      const int64_t hi = g.w - 1 - offset < 0 ? lo : std::max(lo, std::min(g.wo, (g.w - 1 - offset) / a.sw + 1));
      for (int64_t ow = 0; ow < lo; ++ow) dst[ow] = T(0);
      if (a.sw == 1) {
        if (hi > lo) std::memcpy(dst + lo, src + lo + offset, static_cast<size_t>(hi - lo) * sizeof(T));
      } else {
        for (int64_t ow = lo; ow < hi; ++ow) dst[ow] = src[ow * a.sw + offset];
      }
      for (int64_t ow = hi; ow < g.wo; ++ow) dst[ow] = T(0);
    }
    if (++oh == g.ho) {
      oh = 0;
      if (++n == g.n) n = 0, ++r;
    }
  }
}

}  // namespace

void Im2ColCpu(const Im2ColArgs& args, const ParallelRunner& run) {
  const int64_t rows = args.c * args.a.kh * args.a.kw;
  const int64_t lines = rows * args.n * args.ho;
  if (lines == 0 || args.wo == 0) return;
  const int64_t per_task = std::max<int64_t>(1, kChunk / args.wo);
  const size_t tasks = static_cast<size_t>((lines + per_task - 1) / per_task);
  run(tasks, [&](size_t t) {
    const int64_t first = static_cast<int64_t>(t) * per_task;
    const int64_t last = std::min(lines, first + per_task);
    if (args.element_size == 2) {
      Lines<uint16_t>(args, first, last);
    } else {
      Lines<uint32_t>(args, first, last);
    }
  });
}

}  // namespace onnxcampo
