// SoftmaxCrossEntropy and its gradient on the CPU (xent.h has the arithmetic): rows spread over
// the session's thread pool in chunks, each row computed by one thread in column order (max,
// then the float64 sum of the float32 exp(x - max)), so results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "elementwise/elementwise.h"  // LoadAsFloat, StoreFloat
#include "xent.h"

namespace onnxcampo {
namespace {

constexpr int64_t kRowsPerTask = 16;

// The label of row r as a column, or -1 when it lies outside [-C, C).
int64_t Column(int64_t label, int64_t classes) {
  if (label < 0) label += classes;
  return label >= 0 && label < classes ? label : -1;
}

template <typename Row>
void ForRows(int64_t rows, const ParallelRunner& run, Row row) {
  const int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  run(static_cast<size_t>(tasks), [&](size_t task) {
    const int64_t begin = static_cast<int64_t>(task) * kRowsPerTask;
    const int64_t end = std::min(rows, begin + kRowsPerTask);
    for (int64_t r = begin; r < end; ++r) row(r);
  });
}

}  // namespace

void SoftmaxCrossEntropyCpu(const XentArgs& a, const ParallelRunner& run) {
  ForRows(a.rows, run, [&](int64_t r) {
    const int64_t base = r * a.width;
    float most = -INFINITY;
    for (int64_t j = 0; j < a.classes; ++j) most = std::max(most, ew::LoadAsFloat(a.x, base + j, a.x_half));
    double sum = 0.0;  // float64: a serial float32 sum of 50257 terms drifts by 1e-5 (the CUDA kernel's tree does not)
    for (int64_t j = 0; j < a.classes; ++j) sum += std::exp(ew::LoadAsFloat(a.x, base + j, a.x_half) - most);
    const float lse = static_cast<float>(most + std::log(sum));
    const int64_t column = Column(a.labels[r], a.classes);
    a.lse_out[r] = lse;
    ew::StoreFloat(a.picked, r, column < 0 ? 0.0f : ew::LoadAsFloat(a.x, base + column, a.x_half) - lse, a.picked_half);
  });
}

void SoftmaxCrossEntropyGradCpu(const XentArgs& a, const ParallelRunner& run) {
  ForRows(a.rows, run, [&](int64_t r) {
    const int64_t dx_width = a.dx_width > 0 ? a.dx_width : a.classes;
    const int64_t base = r * a.width, out = r * dx_width;
    const float s = ew::LoadAsFloat(a.scale, a.scale_per_row ? r : 0, a.scale_half);
    const int64_t column = Column(a.labels[r], a.classes);
    const float total = column < 0 ? 0.0f : s;  // ReduceSum(g) of the unfused graph
    for (int64_t j = 0; j < a.classes; ++j) {
      const float g = j == column ? s : 0.0f;
      const float p = std::exp(ew::LoadAsFloat(a.x, base + j, a.x_half) - a.lse[r]);
      ew::StoreFloat(a.dx, out + j, g - p * total, a.dx_half);
    }
    for (int64_t j = a.classes; j < dx_width; ++j) ew::StoreFloat(a.dx, out + j, 0.0f, a.dx_half);
  });
}

}  // namespace onnxcampo
