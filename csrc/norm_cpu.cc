// LayerNormGrad and SoftmaxGrad on the CPU (norm.h has the arithmetic): rows spread over the session's thread
// pool in chunks, each row by one thread in column order, so results do not depend on the
// thread count.
#include <algorithm>
#include <cstdint>

#include "elementwise.h"  // HalfBitsToFloat, FloatToHalfBits
#include "norm.h"

namespace onnxcampo {
namespace {

constexpr int64_t kRowsPerTask = 16;

float Load(const void* p, bool half, int64_t i) {
  return half ? ew::HalfBitsToFloat(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

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
        const float g = Load(a.dy, a.dy_half, base + j) * Load(a.gamma, a.gamma_half, j);
        sum_g += g;
        sum_gx += g * Load(a.xhat, a.xhat_half, base + j);
      }
      const float mean_g = sum_g * inv_cols, mean_gx = sum_gx * inv_cols;
      const float inv = Load(a.invstd, a.invstd_half, r);
      for (int64_t j = 0; j < a.cols; ++j) {
        const float g = Load(a.dy, a.dy_half, base + j) * Load(a.gamma, a.gamma_half, j);
        float v = inv * ((g - mean_g) - Load(a.xhat, a.xhat_half, base + j) * mean_gx);
        if (a.acc != nullptr) v += Load(a.acc, a.acc_half, base + j);
        if (a.dx_half) {
          static_cast<uint16_t*>(a.dx)[base + j] = ew::FloatToHalfBits(v);
        } else {
          static_cast<float*>(a.dx)[base + j] = v;
        }
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
      for (int64_t j = 0; j < a.cols; ++j) dot += Load(a.dy, a.dy_half, base + j) * Load(a.y, a.y_half, base + j);
      for (int64_t j = 0; j < a.cols; ++j) {
        const float v = a.scale * (Load(a.y, a.y_half, base + j) * (Load(a.dy, a.dy_half, base + j) - dot));
        if (a.dx_half) {
          static_cast<uint16_t*>(a.dx)[base + j] = ew::FloatToHalfBits(v);
        } else {
          static_cast<float*>(a.dx)[base + j] = v;
        }
      }
    }
  });
}

}  // namespace onnxcampo
