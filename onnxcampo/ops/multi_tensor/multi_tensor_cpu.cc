// CPU kernels: the reference the CUDA kernels are checked against. Every product and sum is
// rounded on its own (built with -ffp-contract=off) so that the results match the standard-op
// graph node for node.
//
// The elements of all tensors of a call form one index space, cut into chunks of kChunk
// elements (a chunk may span several small tensors, as a CUDA tile of many biases would not;
// here that keeps the task count low). The chunks run on ORT's intra-op thread pool; each
// element is computed exactly as in a serial loop and written by one chunk only, so the
// results are the same for any thread count. A call of at most kChunk elements is one task,
// which the runner runs on the calling thread.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "elementwise/elementwise.h"  // FloatToHalfBits
#include "multi_tensor.h"

namespace onnxcampo {
namespace {

// Large enough that a chunk's work (~50 us for the unscale, more for AdamW) dwarfs handing a
// task to the pool; small enough that a ResNet-50 set (25.6 M elements) makes ~400 tasks,
// which balance over the threads.
constexpr int64_t kChunk = int64_t{1} << 16;

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = exponent == 0x1f ? (sign | 0x7f800000u | (mantissa << 13))
                                         : (sign | ((exponent + 112u) << 23) | (mantissa << 13));
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

float ToFloat(uint16_t g) { return HalfToFloat(g); }
float ToFloat(float g) { return g; }

// Calls body(g) with gradient k as a `const uint16_t*` (float16) or a `const float*`, so that
// the element loops are compiled once per type instead of testing the type per element.
template <typename Body>
void WithGradient(const Grads& grads, size_t k, Body body) {
  if (grads.half[k]) {
    body(static_cast<const uint16_t*>(grads.data[k]));
  } else {
    body(static_cast<const float*>(grads.data[k]));
  }
}

bool IsSet(const Flag& flag) {
  if (flag.is_float) return *static_cast<const float*>(flag.data) != 0.0f;
  return *static_cast<const bool*>(flag.data);
}

void Copy(float* out, const float* in, int64_t n) {
  if (n > 0 && out != in) std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
}

// The chunks of a call: chunk c covers elements [c * kChunk, (c + 1) * kChunk) of the
// concatenation of all tensors.
class Chunks {
 public:
  explicit Chunks(const std::vector<int64_t>& sizes) : end_(sizes.size()) {
    int64_t total = 0;
    for (size_t k = 0; k < sizes.size(); ++k) end_[k] = total += sizes[k];
    total_ = total;
  }

  size_t count() const { return static_cast<size_t>((total_ + kChunk - 1) / kChunk); }

  // body(k, begin, end) for each part [begin, end) of tensor k that chunk c covers, in order.
  template <typename Body>
  void ForEach(size_t c, Body body) const {
    const int64_t lo = static_cast<int64_t>(c) * kChunk;
    const int64_t hi = std::min(lo + kChunk, total_);
    // The first tensor that ends after lo (earlier ones lie wholly before the chunk).
    size_t k = static_cast<size_t>(std::upper_bound(end_.begin(), end_.end(), lo) - end_.begin());
    for (; k < end_.size(); ++k) {
      const int64_t start = k == 0 ? 0 : end_[k - 1];
      if (start >= hi) break;
      const int64_t begin = std::max(lo, start) - start;
      const int64_t end = std::min(hi, end_[k]) - start;
      if (end > begin) body(k, begin, end);
    }
  }

 private:
  std::vector<int64_t> end_;  // end_[k]: elements of tensors 0..k together
  int64_t total_ = 0;
};

template <typename G>
bool UnscaleRange(const G* g, float scale, float* out, int64_t begin, int64_t end) {
  bool found = false;
  for (int64_t i = begin; i < end; ++i) {
    const float value = ToFloat(g[i]);
    found |= !std::isfinite(value);
    out[i] = value * scale;
  }
  return found;
}

template <typename G>
bool FiniteRange(const G* g, int64_t begin, int64_t end) {
  bool found = false;
  for (int64_t i = begin; i < end; ++i) found |= !std::isfinite(ToFloat(g[i]));
  return found;
}

// The gradient the update uses: g, or with a scale float32(g) * scale (UnscaleRange's out).
struct UpdateGrad {
  const float* inv_scale;
  template <typename G>
  float operator()(const G* g, int64_t i) const { return inv_scale ? ToFloat(g[i]) * *inv_scale : ToFloat(g[i]); }
};

template <typename G>
void SgdRange(const G* g, const float* w, float* w_out, float lr, UpdateGrad grad, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) w_out[i] = w[i] - lr * grad(g, i);
}

template <typename G>
void MomentumRange(const G* g, const float* w, const float* v, float* w_out, float* v_out, float lr, float mu,
                   UpdateGrad grad, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float velocity = mu * v[i] + grad(g, i);
    v_out[i] = velocity;
    w_out[i] = w[i] - lr * velocity;
  }
}

struct AdamWConstants {
  float lr, beta1, beta2, one_minus_b1, one_minus_b2, c1, c2, eps, weight_decay;
};

template <typename G>
void AdamWRange(const G* grad, const float* w_in, const float* m_in, const float* v_in, float* w_out, float* m_out,
                float* v_out, const AdamWConstants& h, UpdateGrad scaled, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = scaled(grad, i);
    const float w = w_in[i];
    const float m = h.beta1 * m_in[i] + h.one_minus_b1 * g;
    const float v = h.beta2 * v_in[i] + h.one_minus_b2 * (g * g);
    m_out[i] = m;
    v_out[i] = v;
    const float direction = (m / h.c1) / (std::sqrt(v / h.c2) + h.eps);
    w_out[i] = w - h.lr * (direction + h.weight_decay * w);
  }
}

}  // namespace

void UnscaleCheckFiniteCpu(const UnscaleArgs& args, const ParallelRunner& run) {
  const bool write = !args.out.empty();
  const float scale = write ? *args.inv_scale : 1.0f;
  const Chunks chunks(args.grads.size);
  // One flag per chunk, combined after the pool is done: no shared write, no atomic.
  std::vector<uint8_t> found(chunks.count(), 0);
  run(chunks.count(), [&](size_t c) {
    bool any = false;
    chunks.ForEach(c, [&](size_t k, int64_t begin, int64_t end) {
      WithGradient(args.grads, k, [&](const auto* g) {
        any |= write ? UnscaleRange(g, scale, args.out[k], begin, end) : FiniteRange(g, begin, end);
      });
    });
    found[c] = any;
  });
  *args.found_inf = std::any_of(found.begin(), found.end(), [](uint8_t f) { return f != 0; });
}

void MultiTensorSgdCpu(const SgdArgs& args, const ParallelRunner& run) {
  const bool skip = IsSet(args.found_inf);
  const bool has_velocity = !args.v.empty();
  const float lr = *args.lr;
  const float mu = args.momentum;
  const Chunks chunks(args.grads.size);
  run(chunks.count(), [&](size_t c) {
    chunks.ForEach(c, [&](size_t k, int64_t begin, int64_t end) {
      if (skip) {
        Copy(args.w_out[k] + begin, args.w[k] + begin, end - begin);
        if (has_velocity) Copy(args.v_out[k] + begin, args.v[k] + begin, end - begin);
        return;
      }
      WithGradient(args.grads, k, [&](const auto* g) {
        if (has_velocity) {
          MomentumRange(g, args.w[k], args.v[k], args.w_out[k], args.v_out[k], lr, mu, UpdateGrad{args.inv_scale}, begin,
                        end);
        } else {
          SgdRange(g, args.w[k], args.w_out[k], lr, UpdateGrad{args.inv_scale}, begin, end);
        }
      });
    });
  });
}

void MultiTensorAdamWCpu(const AdamWArgs& args, const ParallelRunner& run) {
  const bool skip = IsSet(args.found_inf);
  const float step = *args.step;
  *args.step_out = skip ? step : step + 1.0f;
  const float t = step + 1.0f;
  AdamWConstants h;
  h.lr = *args.lr;
  h.beta1 = args.beta1;
  h.beta2 = args.beta2;
  h.one_minus_b1 = static_cast<float>(1.0 - static_cast<double>(args.beta1));
  h.one_minus_b2 = static_cast<float>(1.0 - static_cast<double>(args.beta2));
  h.c1 = 1.0f - std::pow(args.beta1, t);
  h.c2 = 1.0f - std::pow(args.beta2, t);
  h.eps = args.eps;
  h.weight_decay = args.weight_decay;
  const Chunks chunks(args.grads.size);
  run(chunks.count(), [&](size_t c) {
    chunks.ForEach(c, [&](size_t k, int64_t begin, int64_t end) {
      if (skip) {
        Copy(args.w_out[k] + begin, args.w[k] + begin, end - begin);
        Copy(args.m_out[k] + begin, args.m[k] + begin, end - begin);
        Copy(args.v_out[k] + begin, args.v[k] + begin, end - begin);
        return;
      }
      WithGradient(args.grads, k, [&](const auto* g) {
        AdamWRange(g, args.w[k], args.m[k], args.v[k], args.w_out[k], args.m_out[k], args.v_out[k], h,
                   UpdateGrad{args.inv_scale}, begin, end);
      });
    });
  });
}

void MultiTensorCastCpu(const CastArgs& args, const ParallelRunner& run) {
  const Chunks chunks(args.size);
  run(chunks.count(), [&](size_t c) {
    chunks.ForEach(c, [&](size_t k, int64_t begin, int64_t end) {
      const float* in = args.in[k];
      uint16_t* out = args.out[k];
      for (int64_t i = begin; i < end; ++i) out[i] = ew::FloatToHalfBits(in[i]);
    });
  });
}

}  // namespace onnxcampo
