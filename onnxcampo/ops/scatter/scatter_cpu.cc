// ScatterNDAdd on the CPU: the reference the CUDA kernel is checked against. One serial pass in
// index order, so every output element is data + its updates summed in the order of their index
// tuples, each addition rounded on its own (float32; float16 rounds the float32 sum of two halves
// to half, which is the correctly rounded half sum, as numpy's np.add.at computes it).
#include <cstring>
#include <string>

#include "scatter.h"

namespace onnxcampo {
namespace {

float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN (payload kept)
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;  // +-0
  } else {        // subnormal: normalise
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | ((113u - static_cast<uint32_t>(shift)) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Round to nearest even; overflow to inf; NaN stays NaN (quiet, payload's top bits kept).
uint16_t FloatToHalfBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) {  // inf or NaN
    const uint32_t nan = magnitude > 0x7f800000u ? 0x200u | ((magnitude >> 13) & 0x3ffu) : 0u;
    return static_cast<uint16_t>(sign | 0x7c00u | nan);
  }
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal half (or zero, or 2^-14 after rounding)
    // Adding 0.5 leaves a float whose last place is 2^-24, the half's subnormal step: the FPU
    // rounds |value| to a multiple of it, to nearest even.
    float scaled;
    std::memcpy(&scaled, &magnitude, sizeof scaled);
    const float sum = scaled + 0.5f;
    uint32_t sum_bits;
    std::memcpy(&sum_bits, &sum, sizeof sum_bits);
    return static_cast<uint16_t>(sign | (sum_bits - 0x3f000000u));
  }
  const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

}  // namespace

void ScatterNDAddCpu(const ScatterArgs& a) {
  const size_t element_bytes = a.half ? 2 : 4;
  if (a.data_elements > 0 && a.output != a.data) {
    std::memcpy(a.output, a.data, static_cast<size_t>(a.data_elements) * element_bytes);
  }
  for (int64_t t = 0; t < a.tuples; ++t) {
    int64_t offset = 0;
    for (int j = 0; j < a.k; ++j) {
      int64_t index = a.indices[t * a.k + j];
      const int64_t dim = a.dims[j];
      if (index < -dim || index >= dim) {
        throw ScatterError("index " + std::to_string(index) + " (index tuple " + std::to_string(t) + ", entry " +
                           std::to_string(j) + ") is out of range for data dimension " + std::to_string(j) +
                           " of size " + std::to_string(dim) + " (allowed: " + std::to_string(-dim) + " .. " +
                           std::to_string(dim - 1) + ")");
      }
      if (index < 0) index += dim;
      offset += index * a.strides[j];
    }
    if (a.half) {
      uint16_t* out = static_cast<uint16_t*>(a.output) + offset;
      const uint16_t* update = static_cast<const uint16_t*>(a.updates) + t * a.slice;
      for (int64_t i = 0; i < a.slice; ++i) out[i] = FloatToHalfBits(HalfBitsToFloat(out[i]) + HalfBitsToFloat(update[i]));
    } else {
      float* out = static_cast<float*>(a.output) + offset;
      const float* update = static_cast<const float*>(a.updates) + t * a.slice;
      for (int64_t i = 0; i < a.slice; ++i) out[i] = out[i] + update[i];
    }
  }
}

}  // namespace onnxcampo
