// BatchNormStats and BatchNormGradSums on the CPU (batch_norm.h has the arithmetic): channels
// spread over the session's thread pool, each channel by one thread in a fixed order (p, then r
// ascending), so results do not depend on the thread count. The sums are float64 (one running sum
// over a channel's 800k values would lose three digits in float32; the CUDA kernels' trees do not),
// rounded once to float32. BatchNormStats reads x twice per channel (the sum, then the squared
// deviations from its mean): the two-pass value that the CUDA kernels' Welford merge computes in
// one read.
#include <algorithm>
#include <cstdint>

#include "batch_norm.h"
#include "elementwise/elementwise.h"  // LoadAsFloat

namespace onnxcampo {
namespace {

constexpr int64_t kChannelsPerTask = 4;

// body(q) for every channel, spread over `run`.
template <typename Body>
void ForChannels(int64_t Q, const ParallelRunner& run, Body&& body) {
  const int64_t tasks = (Q + kChannelsPerTask - 1) / kChannelsPerTask;
  run(static_cast<size_t>(tasks), [&](size_t task) {
    const int64_t begin = static_cast<int64_t>(task) * kChannelsPerTask;
    for (int64_t q = begin; q < std::min(Q, begin + kChannelsPerTask); ++q) body(q);
  });
}

// visit(index) for the elements of channel q in order.
template <typename Visit>
void ForElements(const ChannelSumsArgs& a, int64_t q, Visit&& visit) {
  for (int64_t p = 0; p < a.P; ++p) {
    const int64_t base = (p * a.Q + q) * a.R;
    for (int64_t r = 0; r < a.R; ++r) visit(base + r);
  }
}

}  // namespace

void BatchNormStatsCpu(const ChannelSumsArgs& a, const ParallelRunner& run) {
  const double n = static_cast<double>(a.P) * static_cast<double>(a.R);
  ForChannels(a.Q, run, [&](int64_t q) {
    double sum = 0.0;
    ForElements(a, q, [&](int64_t i) { sum += ew::LoadAsFloat(a.a, i, a.a_half); });
    const double mean = n > 0 ? sum / n : 0.0;
    double centered = 0.0;
    ForElements(a, q, [&](int64_t i) {
      const double d = ew::LoadAsFloat(a.a, i, a.a_half) - mean;
      centered += d * d;
    });
    a.out0[q] = static_cast<float>(sum);
    a.out1[q] = static_cast<float>(centered);
  });
}

void BatchNormGradSumsCpu(const ChannelSumsArgs& a, const ParallelRunner& run) {
  ForChannels(a.Q, run, [&](int64_t q) {
    double sum_dy = 0.0, sum_dy_c = 0.0;
    ForElements(a, q, [&](int64_t i) {
      const double dy = ew::LoadAsFloat(a.a, i, a.a_half);
      sum_dy += dy;
      sum_dy_c += dy * ew::LoadAsFloat(a.b, i, a.b_half);
    });
    a.out0[q] = static_cast<float>(sum_dy);
    a.out1[q] = static_cast<float>(sum_dy_c * a.scale[q]);
  });
}

}  // namespace onnxcampo
