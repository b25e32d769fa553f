// ConvWeightGrad on the CPU (conv_grad.h): for each (co, ci) the kh*kw sums over n, oh, ow in
// that order, float32 accumulation, the inner loop over ow reading dy contiguously.
#include <algorithm>
#include <vector>

#include "conv_grad.h"
#include "elementwise/elementwise.h"  // the float16 <-> float32 conversions

namespace onnxcampo {
namespace {

using ew::LoadAsFloat;

void Pair(const ConvGradArgs& g, int64_t co, int64_t ci) {
  const Im2ColAttrs& a = g.a;
  std::vector<float> acc(static_cast<size_t>(a.kh * a.kw), 0.0f);
  std::vector<float> row(static_cast<size_t>(g.wo)), xs(static_cast<size_t>(g.w));
  for (int64_t n = 0; n < g.n; ++n) {
    for (int64_t oh = 0; oh < g.ho; ++oh) {
      const int64_t dy_row = ((n * g.cout + co) * g.ho + oh) * g.wo;
      for (int64_t ow = 0; ow < g.wo; ++ow) row[ow] = LoadAsFloat(g.dy, dy_row + ow, g.half);
      for (int64_t i = 0; i < a.kh; ++i) {
        const int64_t h = oh * a.sh + i * a.dh - a.pt;
        if (h < 0 || h >= g.h) continue;
        const int64_t x_row = ((n * g.cin + ci) * g.h + h) * g.w;
        for (int64_t c = 0; c < g.w; ++c) xs[c] = LoadAsFloat(g.x, x_row + c, g.half);
        for (int64_t j = 0; j < a.kw; ++j) {
          const int64_t offset = j * a.dw - a.pl;
          float sum = 0.0f;
          for (int64_t ow = 0; ow < g.wo; ++ow) {
            const int64_t c = ow * a.sw + offset;
            if (c >= 0 && c < g.w) sum += row[ow] * xs[c];
          }
          acc[i * a.kw + j] += sum;
        }
      }
    }
  }
  const int64_t base = (co * g.cin + ci) * a.kh * a.kw;
  for (int64_t k = 0; k < a.kh * a.kw; ++k) {
    ew::StoreFloat(g.dw, base + k, acc[k], g.half);
  }
}

}  // namespace

void ConvWeightGradCpu(const ConvGradArgs& args, const ParallelRunner& run) {
  const int64_t pairs = args.cout * args.cin;
  if (pairs == 0) return;
  run(static_cast<size_t>(pairs), [&](size_t t) {
    Pair(args, static_cast<int64_t>(t) / args.cin, static_cast<int64_t>(t) % args.cin);
  });
}

}  // namespace onnxcampo
