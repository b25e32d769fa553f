// NchwToNhwc on CUDA (to_nhwc.h). A thread (grid-stride) takes one position (n, s) and writes its
// `channels` values: a warp reads 32 consecutive positions of each input channel (coalesced) and
// writes 32 * channels consecutive output elements; float16 outputs of an even channel count are
// written in pairs (4-byte stores; 8-byte ones for a multiple of 4, the padded stem's layout).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda_util.h"
#include "to_nhwc.h"

namespace onnxcampo {
namespace {

constexpr int kThreads = 256;

template <typename In>
__device__ __forceinline__ float Read(const In* x, int64_t i) {
  if constexpr (sizeof(In) == 2) {
    return __half2float(reinterpret_cast<const __half*>(x)[i]);
  } else {
    return x[i];
  }
}

__device__ __forceinline__ uint32_t HalfBits(float v) { return __half_as_ushort(__float2half_rn(v)); }

// kPack: float16 values written 1, 2 or 4 at a time (0: float32 output).
template <typename In, int kPack>
__global__ void __launch_bounds__(kThreads) ToNhwcKernel(const In* __restrict__ x, void* __restrict__ y, int64_t n,
                                                         int64_t c, int64_t s, int64_t channels) {
  const int64_t positions = n * s;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < positions;
       p += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t batch = p / s, at = p - batch * s;
    const In* column = x + batch * c * s + at;
    auto value = [&](int64_t k) { return k < c ? Read(column, k * s) : 0.0f; };
    if constexpr (kPack == 0) {
      float* out = static_cast<float*>(y) + p * channels;
      for (int64_t k = 0; k < channels; ++k) out[k] = value(k);
    } else if constexpr (kPack == 4) {
      uint2* out = reinterpret_cast<uint2*>(static_cast<uint16_t*>(y) + p * channels);
      for (int64_t k = 0; k < channels; k += 4) {
        out[k / 4] = make_uint2(HalfBits(value(k)) | HalfBits(value(k + 1)) << 16,
                                HalfBits(value(k + 2)) | HalfBits(value(k + 3)) << 16);
      }
    } else if constexpr (kPack == 2) {
      uint32_t* out = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(y) + p * channels);
      for (int64_t k = 0; k < channels; k += 2) out[k / 2] = HalfBits(value(k)) | HalfBits(value(k + 1)) << 16;
    } else {
      uint16_t* out = static_cast<uint16_t*>(y) + p * channels;
      for (int64_t k = 0; k < channels; ++k) out[k] = static_cast<uint16_t>(HalfBits(value(k)));
    }
  }
}

template <typename In>
void Launch(const ToNhwcArgs& g, int blocks, cudaStream_t stream) {
  const In* x = static_cast<const In*>(g.x);
  const uintptr_t address = reinterpret_cast<uintptr_t>(g.y);
  if (!g.y_half) {
    ToNhwcKernel<In, 0><<<blocks, kThreads, 0, stream>>>(x, g.y, g.n, g.c, g.s, g.channels);
  } else if (g.channels % 4 == 0 && address % 8 == 0) {
    ToNhwcKernel<In, 4><<<blocks, kThreads, 0, stream>>>(x, g.y, g.n, g.c, g.s, g.channels);
  } else if (g.channels % 2 == 0 && address % 4 == 0) {
    ToNhwcKernel<In, 2><<<blocks, kThreads, 0, stream>>>(x, g.y, g.n, g.c, g.s, g.channels);
  } else {
    ToNhwcKernel<In, 1><<<blocks, kThreads, 0, stream>>>(x, g.y, g.n, g.c, g.s, g.channels);
  }
}

}  // namespace

void ToNhwcCuda(const ToNhwcArgs& g, void* stream_handle) {
  const int64_t positions = g.n * g.s;
  if (positions == 0 || g.channels == 0) return;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const int most = MultiprocessorCount() * (2048 / kThreads);
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((positions + kThreads - 1) / kThreads, most)));
  if (g.x_half) {
    Launch<__half>(g, blocks, stream);
  } else {
    Launch<float>(g, blocks, stream);
  }
  CudaCheck(cudaGetLastError(), "NchwToNhwc launch");
}

}  // namespace onnxcampo
