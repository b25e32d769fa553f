// CPU kernels: plain loops, the reference the CUDA kernels are checked against. Every
// product and sum is rounded on its own (built with -ffp-contract=off) so that the results
// match the standard-op graph node for node.
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace onnxcampo {
namespace {

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

float Grad(const Grads& grads, size_t k, int64_t i) {
  if (grads.half[k]) return HalfToFloat(static_cast<const uint16_t*>(grads.data[k])[i]);
  return static_cast<const float*>(grads.data[k])[i];
}

bool IsSet(const Flag& flag) {
  if (flag.is_float) return *static_cast<const float*>(flag.data) != 0.0f;
  return *static_cast<const bool*>(flag.data);
}

void Copy(float* out, const float* in, int64_t n) {
  if (n > 0 && out != in) std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
}

}  // namespace

void UnscaleCheckFiniteCpu(const UnscaleArgs& args) {
  const float scale = *args.inv_scale;
  bool found = false;
  for (size_t k = 0; k < args.grads.count(); ++k) {
    float* out = args.out[k];
    for (int64_t i = 0; i < args.grads.size[k]; ++i) {
      const float g = Grad(args.grads, k, i);
      found |= !std::isfinite(g);
      out[i] = g * scale;
    }
  }
  *args.found_inf = found;
}

void MultiTensorSgdCpu(const SgdArgs& args) {
  const bool skip = IsSet(args.found_inf);
  const bool has_velocity = !args.v.empty();
  const float lr = *args.lr;
  const float mu = args.momentum;
  for (size_t k = 0; k < args.grads.count(); ++k) {
    const int64_t n = args.grads.size[k];
    if (skip) {
      Copy(args.w_out[k], args.w[k], n);
      if (has_velocity) Copy(args.v_out[k], args.v[k], n);
      continue;
    }
    const float* w = args.w[k];
    float* w_out = args.w_out[k];
    for (int64_t i = 0; i < n; ++i) {
      const float g = Grad(args.grads, k, i);
      if (has_velocity) {
        const float velocity = mu * args.v[k][i] + g;
        args.v_out[k][i] = velocity;
        w_out[i] = w[i] - lr * velocity;
      } else {
        w_out[i] = w[i] - lr * g;
      }
    }
  }
}

void MultiTensorAdamWCpu(const AdamWArgs& args) {
  const bool skip = IsSet(args.found_inf);
  const float step = *args.step;
  *args.step_out = skip ? step : step + 1.0f;
  const float t = step + 1.0f;
  const float c1 = 1.0f - std::pow(args.beta1, t);
  const float c2 = 1.0f - std::pow(args.beta2, t);
  const float one_minus_b1 = static_cast<float>(1.0 - static_cast<double>(args.beta1));
  const float one_minus_b2 = static_cast<float>(1.0 - static_cast<double>(args.beta2));
  const float lr = *args.lr;
  for (size_t k = 0; k < args.grads.count(); ++k) {
    const int64_t n = args.grads.size[k];
    if (skip) {
      Copy(args.w_out[k], args.w[k], n);
      Copy(args.m_out[k], args.m[k], n);
      Copy(args.v_out[k], args.v[k], n);
      continue;
    }
    for (int64_t i = 0; i < n; ++i) {
      const float g = Grad(args.grads, k, i);
      const float w = args.w[k][i];
      const float m = args.beta1 * args.m[k][i] + one_minus_b1 * g;
      const float v = args.beta2 * args.v[k][i] + one_minus_b2 * (g * g);
      args.m_out[k][i] = m;
      args.v_out[k][i] = v;
      const float direction = (m / c1) / (std::sqrt(v / c2) + args.eps);
      args.w_out[k][i] = w - lr * (direction + args.weight_decay * w);
    }
  }
}

}  // namespace onnxcampo
