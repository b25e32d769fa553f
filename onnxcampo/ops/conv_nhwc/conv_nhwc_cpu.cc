// The NHWC convolutions on the CPU (conv_nhwc.h): reference kernels for CI and the CPU provider,
// float32 accumulation, each output element's sum over (i, j, channel) or (n, oh, ow) in that
// order (a grouped forward: over its group's Cin / group channels). Tasks: one (n, output row)
// each for the forward and data gradient, one Cout each for the weight gradient.
#include <vector>

#include "conv_nhwc.h"
#include "elementwise/elementwise.h"  // the float16 <-> float32 conversions

namespace onnxcampo {
namespace {

using ew::LoadAsFloat;
using ew::StoreFloat;

// The filter's channels: Cin / group (ci counts within the group of co).
int64_t FilterChannels(const ConvCall& g) { return g.cin / g.group; }

int64_t FilterIndex(const ConvCall& g, int64_t co, int64_t i, int64_t j, int64_t ci) {
  const int64_t c = FilterChannels(g);
  return g.krsc ? ((co * g.a.kh + i) * g.a.kw + j) * c + ci : ((co * c + ci) * g.a.kh + i) * g.a.kw + j;
}

// Calls tap(i, j, x_at) for each filter tap (i, j), in order, whose input pixel for output pixel
// (n, oh, ow) lies inside x (not in the padding); x_at: that pixel's offset in x (its channel 0).
template <typename Tap>
inline void ForEachTap(const ConvCall& g, int64_t n, int64_t oh, int64_t ow, Tap&& tap) {
  const Im2ColAttrs& a = g.a;
  for (int64_t i = 0; i < a.kh; ++i) {
    const int64_t h = oh * a.sh + i * a.dh - a.pt;
    if (h < 0 || h >= g.h) continue;
    for (int64_t j = 0; j < a.kw; ++j) {
      const int64_t w = ow * a.sw + j * a.dw - a.pl;
      if (w < 0 || w >= g.w_) continue;
      tap(i, j, ((n * g.h + h) * g.w_ + w) * g.cin);
    }
  }
}

// y[n, oh, :, :] of the forward convolution; output channel co reads the input channels
// [group_of(co) * Cin / group, ...) of its group.
void ForwardRow(const ConvCall& g, int64_t n, int64_t oh) {
  const int64_t cin_g = FilterChannels(g), cout_g = g.cout / g.group;
  std::vector<float> acc(static_cast<size_t>(g.cout));
  for (int64_t ow = 0; ow < g.wo; ++ow) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    ForEachTap(g, n, oh, ow, [&](int64_t i, int64_t j, int64_t x_at) {
      for (int64_t co = 0; co < g.cout; ++co) {
        const int64_t x_group = x_at + co / cout_g * cin_g;
        float sum = 0.0f;
        for (int64_t ci = 0; ci < cin_g; ++ci) {
          sum += LoadAsFloat(g.x, x_group + ci, g.half) * LoadAsFloat(g.w, FilterIndex(g, co, i, j, ci), g.half);
        }
        acc[co] += sum;
      }
    });
    const int64_t y_at = ((n * g.ho + oh) * g.wo + ow) * g.cout;
    for (int64_t co = 0; co < g.cout; ++co) StoreFloat(g.out, y_at + co, acc[co], g.half);
  }
}

// dx[n, h, :, :]: the sum over the (i, j, co) whose window reads x[n, h, w, :].
void DataRow(const ConvCall& g, int64_t n, int64_t h) {
  const Im2ColAttrs& a = g.a;
  std::vector<float> acc(static_cast<size_t>(g.cin));
  for (int64_t w = 0; w < g.w_; ++w) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t i = 0; i < a.kh; ++i) {
      const int64_t th = h + a.pt - i * a.dh;
      if (th < 0 || th % a.sh != 0 || th / a.sh >= g.ho) continue;
      const int64_t oh = th / a.sh;
      for (int64_t j = 0; j < a.kw; ++j) {
        const int64_t tw = w + a.pl - j * a.dw;
        if (tw < 0 || tw % a.sw != 0 || tw / a.sw >= g.wo) continue;
        const int64_t dy_at = ((n * g.ho + oh) * g.wo + tw / a.sw) * g.cout;
        for (int64_t ci = 0; ci < g.cin; ++ci) {
          float sum = 0.0f;
          for (int64_t co = 0; co < g.cout; ++co) sum += LoadAsFloat(g.dy, dy_at + co, g.half) * LoadAsFloat(g.w, FilterIndex(g, co, i, j, ci), g.half);
          acc[ci] += sum;
        }
      }
    }
    const int64_t dx_at = ((n * g.h + h) * g.w_ + w) * g.cin;
    for (int64_t ci = 0; ci < g.cin; ++ci) StoreFloat(g.out, dx_at + ci, acc[ci], g.half);
  }
}

// dw[co, ...]: for each (i, j, ci) the sum over n, oh, ow.
void FilterOf(const ConvCall& g, int64_t co) {
  const Im2ColAttrs& a = g.a;
  std::vector<float> acc(static_cast<size_t>(a.kh * a.kw * g.cin), 0.0f);
  for (int64_t n = 0; n < g.n; ++n) {
    for (int64_t oh = 0; oh < g.ho; ++oh) {
      for (int64_t ow = 0; ow < g.wo; ++ow) {
        const float d = LoadAsFloat(g.dy, ((n * g.ho + oh) * g.wo + ow) * g.cout + co, g.half);
        ForEachTap(g, n, oh, ow, [&](int64_t i, int64_t j, int64_t x_at) {
          float* row = &acc[static_cast<size_t>((i * a.kw + j) * g.cin)];
          for (int64_t ci = 0; ci < g.cin; ++ci) row[ci] += d * LoadAsFloat(g.x, x_at + ci, g.half);
        });
      }
    }
  }
  for (int64_t i = 0; i < a.kh; ++i) {
    for (int64_t j = 0; j < a.kw; ++j) {
      for (int64_t ci = 0; ci < g.cin; ++ci) {
        StoreFloat(g.out, FilterIndex(g, co, i, j, ci), acc[static_cast<size_t>((i * a.kw + j) * g.cin + ci)], g.half);
      }
    }
  }
}

}  // namespace

void ConvNhwcCpu(const ConvCall& g, const ParallelRunner& run) {
  switch (g.kind) {
    case ConvKind::kForward:
      if (g.n * g.ho == 0) return;
      run(static_cast<size_t>(g.n * g.ho), [&](size_t t) {
        ForwardRow(g, static_cast<int64_t>(t) / g.ho, static_cast<int64_t>(t) % g.ho);
      });
      return;
    case ConvKind::kData:
      if (g.n * g.h == 0) return;
      run(static_cast<size_t>(g.n * g.h), [&](size_t t) {
        DataRow(g, static_cast<int64_t>(t) / g.h, static_cast<int64_t>(t) % g.h);
      });
      return;
    case ConvKind::kFilter:
      if (g.cout == 0) return;
      run(static_cast<size_t>(g.cout), [&](size_t t) { FilterOf(g, static_cast<int64_t>(t)); });
      return;
  }
}

}  // namespace onnxcampo
