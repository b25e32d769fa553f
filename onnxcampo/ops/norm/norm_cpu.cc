// LayerNormGrad and SoftmaxGrad on the CPU (norm.h has the arithmetic): rows spread over the session's thread
// pool in chunks, each row by one thread in column order, so results do not depend on the
// thread count.
#include <algorithm>
#include <cstdint>

#include "elementwise/elementwise.h"  // LoadAsFloat, StoreFloat
#include "norm.h"

namespace onnxcampo {
namespace {

constexpr int64_t kRowsPerTask = 16;

}  // namespace

void LayerNormGradCpu(const NormGradArgs& a, const ParallelRunner& run) {
  const int64_t tasks = (a.rows + kRowsPerTask - 1) / kRowsPerTask;
  const float inv_cols = 1.0f / static_cast<float>(a.cols);
  run(static_cast<size_t>(tasks), [&](size_t task) {
    const int64_t begin = static_cast<int64_t>(task) * kRowsPerTask;
    const int64_t end = std::min(a.rows, begin + kRowsPerTask);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = r * a.cols;
      float sum_g = 0.0f, sum_gx = 0.0f;
      for (int64_t j = 0; j < a.cols; ++j) {
        const float g = ew::LoadAsFloat(a.dy, base + j, a.dy_half) * ew::LoadAsFloat(a.gamma, j, a.gamma_half);
        sum_g += g;
        sum_gx += g * ew::LoadAsFloat(a.xhat, base + j, a.xhat_half);
      }
      const float mean_g = sum_g * inv_cols, mean_gx = sum_gx * inv_cols;
      const float inv = ew::LoadAsFloat(a.invstd, r, a.invstd_half);
      for (int64_t j = 0; j < a.cols; ++j) {
        const float g = ew::LoadAsFloat(a.dy, base + j, a.dy_half) * ew::LoadAsFloat(a.gamma, j, a.gamma_half);
        float v = inv * ((g - mean_g) - ew::LoadAsFloat(a.xhat, base + j, a.xhat_half) * mean_gx);
        if (a.acc != nullptr) v += ew::LoadAsFloat(a.acc, base + j, a.acc_half);
        ew::StoreFloat(a.dx, base + j, v, a.dx_half);
      }
    }
  });
}

void SoftmaxGradCpu(const SoftmaxGradArgs& a, const ParallelRunner& run) {
  const int64_t tasks = (a.rows + kRowsPerTask - 1) / kRowsPerTask;
  run(static_cast<size_t>(tasks), [&](size_t task) {
    const int64_t begin = static_cast<int64_t>(task) * kRowsPerTask;
    const int64_t end = std::min(a.rows, begin + kRowsPerTask);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = r * a.cols;
      float dot = 0.0f;
      for (int64_t j = 0; j < a.cols; ++j) {
        dot += ew::LoadAsFloat(a.dy, base + j, a.dy_half) * ew::LoadAsFloat(a.y, base + j, a.y_half);
      }
      for (int64_t j = 0; j < a.cols; ++j) {
        const float y = ew::LoadAsFloat(a.y, base + j, a.y_half), dy = ew::LoadAsFloat(a.dy, base + j, a.dy_half);
        ew::StoreFloat(a.dx, base + j, a.scale * (y * (dy - dot)), a.dx_half);
      }
    }
  });
}

}  // namespace onnxcampo
