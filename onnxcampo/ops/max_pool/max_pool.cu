// MaxPoolNhwc and MaxPoolNhwcGrad on CUDA (max_pool.h has the semantics).
//
// Forward: thread idx (grid-stride) takes output position (n, oh, ow) and V consecutive channels,
// so a warp reads 32*V consecutive channels of one input pixel per tap (coalesced: C = 64 float16
// channels are 8 threads of 16 bytes) and writes y and argmax at offset idx*V. Taps are visited
// in row-major order with the same float32 comparisons as the CPU kernel; y gets the bits of the
// element picked.
// Gradient: thread idx takes input position (n, h, w) and V channels, and gathers from the at most
// ceil(kh/sh) * ceil(kw/sw) windows that hold it (oh ascending, then ow) the dy whose argmax names
// it: each dx element is written once, as a float32 sum in a fixed order (the CPU kernel's), so
// no memset of dx, no atomics, and the same bits on every run.
//
// V = 8 float16 or 4 float32 channels (16-byte loads and stores of x, y, dy, dx; 8- or 4-byte
// ones of argmax) where C % V == 0 and the buffers are aligned (ORT's allocations are), else 1.
// One launch each on ORT's compute stream: nothing allocated, nothing synchronised, so the nodes
// can be captured in a CUDA graph.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda_util.h"
#include "max_pool.h"

namespace onnxcampo {
namespace {

constexpr int kThreads = 256;

struct PoolGeometry {
  int32_t h, w, ho, wo;
  int32_t kh, kw, sh, sw, pt, pl;
  int64_t c;
};

int Blocks(int64_t work) {
  const int most = MultiprocessorCount() * (2048 / kThreads);
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, most)));
}

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

__device__ __forceinline__ float HalfBits(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits & 0xffffu)));
}
__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(lo))) |
         (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(hi))) << 16);
}

// V elements at p as float32 (V = 8 float16 or 4 float32: one 16-byte load).
template <typename T, int V>
__device__ __forceinline__ void Load(const T* p, float (&v)[V]) {
  if constexpr (V == 1) {
    if constexpr (sizeof(T) == 2) {
      v[0] = __half2float(*reinterpret_cast<const __half*>(p));
    } else {
      v[0] = *reinterpret_cast<const float*>(p);
    }
  } else if constexpr (sizeof(T) == 2) {
    static_assert(V == 8, "float16 vectors are 8 wide");
    const uint4 r = *reinterpret_cast<const uint4*>(p);
    const uint32_t words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = HalfBits(words[k]);
      v[2 * k + 1] = HalfBits(words[k] >> 16);
    }
  } else {
    static_assert(V == 4, "float32 vectors are 4 wide");
    const float4 r = *reinterpret_cast<const float4*>(p);
    v[0] = r.x, v[1] = r.y, v[2] = r.z, v[3] = r.w;
  }
}

// The raw bits of V elements at p (float16: 16 bits each), with their float32 values: the forward
// stores the bits of the element it picks, so y is x's element bit for bit (NaN payloads too).
template <typename T, int V>
__device__ __forceinline__ void LoadWithBits(const T* p, float (&v)[V], uint32_t (&bits)[V]) {
  if constexpr (sizeof(T) == 2) {
    if constexpr (V == 8) {
      const uint4 r = *reinterpret_cast<const uint4*>(p);
      const uint32_t words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        bits[2 * k] = words[k] & 0xffffu;
        bits[2 * k + 1] = words[k] >> 16;
      }
    } else {
      bits[0] = __half_as_ushort(*reinterpret_cast<const __half*>(p));
    }
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = HalfBits(bits[k]);
  } else {
    Load<T, V>(p, v);
#pragma unroll
    for (int k = 0; k < V; ++k) bits[k] = __float_as_uint(v[k]);
  }
}

template <typename T, int V>
__device__ __forceinline__ void StoreBits(T* p, const uint32_t (&bits)[V]) {
  if constexpr (sizeof(T) == 2 && V == 8) {
    *reinterpret_cast<uint4*>(p) = make_uint4(bits[0] | (bits[1] << 16), bits[2] | (bits[3] << 16),
                                              bits[4] | (bits[5] << 16), bits[6] | (bits[7] << 16));
  } else if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<__half*>(p) = __ushort_as_half(static_cast<unsigned short>(bits[0]));
  } else if constexpr (V == 4) {
    *reinterpret_cast<uint4*>(p) = make_uint4(bits[0], bits[1], bits[2], bits[3]);
  } else {
    *reinterpret_cast<uint32_t*>(p) = bits[0];
  }
}

// V float32 values stored at p in T (float16: rounded to nearest even).
template <typename T, int V>
__device__ __forceinline__ void Store(T* p, const float (&v)[V]) {
  if constexpr (V == 1) {
    if constexpr (sizeof(T) == 2) {
      *reinterpret_cast<__half*>(p) = __float2half_rn(v[0]);
    } else {
      *reinterpret_cast<float*>(p) = v[0];
    }
  } else if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<uint4*>(p) = make_uint4(Pack(v[0], v[1]), Pack(v[2], v[3]), Pack(v[4], v[5]), Pack(v[6], v[7]));
  } else {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  }
}

// V argmax bytes: one 8-, 4- or 1-byte access.
template <int V>
__device__ __forceinline__ void LoadBytes(const uint8_t* p, uint8_t (&b)[V]) {
  if constexpr (V == 8) {
    const uint2 r = *reinterpret_cast<const uint2*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      b[k] = static_cast<uint8_t>(r.x >> (8 * k));
      b[4 + k] = static_cast<uint8_t>(r.y >> (8 * k));
    }
  } else if constexpr (V == 4) {
    const uint32_t r = *reinterpret_cast<const uint32_t*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) b[k] = static_cast<uint8_t>(r >> (8 * k));
  } else {
    b[0] = *p;
  }
}

template <int V>
__device__ __forceinline__ void StoreBytes(uint8_t* p, const uint8_t (&b)[V]) {
  if constexpr (V == 8) {
    uint2 r = make_uint2(0, 0);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      r.x |= static_cast<uint32_t>(b[k]) << (8 * k);
      r.y |= static_cast<uint32_t>(b[4 + k]) << (8 * k);
    }
    *reinterpret_cast<uint2*>(p) = r;
  } else if constexpr (V == 4) {
    uint32_t r = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) r |= static_cast<uint32_t>(b[k]) << (8 * k);
    *reinterpret_cast<uint32_t*>(p) = r;
  } else {
    *p = b[0];
  }
}

// Thread idx: y[n, oh, ow, V*cg .. V*cg + V - 1] and its argmax, idx = ((n*Ho + oh)*Wo + ow)*C/V + cg.
// `I` is the type of the flat index (32-bit where the output allows it: cheaper divisions).
template <typename T, int V, bool kArgmax, typename I>
__global__ void __launch_bounds__(kThreads) MaxPoolForward(const T* __restrict__ x, T* __restrict__ y,
                                                           uint8_t* __restrict__ argmax, const PoolGeometry g, I groups,
                                                           I channel_groups) {
  const I step = static_cast<I>(gridDim.x) * kThreads;
  for (I idx = static_cast<I>(blockIdx.x) * kThreads + threadIdx.x; idx < groups; idx += step) {
    const I p = idx / channel_groups;
    const I cg = idx - p * channel_groups;
    const I q = p / g.wo;
    const int32_t ow = static_cast<int32_t>(p - q * g.wo);
    const I n = q / g.ho;
    const int32_t oh = static_cast<int32_t>(q - n * g.ho);
    const int32_t h0 = oh * g.sh - g.pt, w0 = ow * g.sw - g.pl;
    const int32_t i_end = min(g.kh, g.h - h0), j_end = min(g.kw, g.w - w0);
    const T* image = x + static_cast<int64_t>(n) * g.h * g.w * g.c + static_cast<int64_t>(cg) * V;
    float best[V];
    uint32_t picked[V];  // the bits of the best element
    uint8_t arg[V];
#pragma unroll
    for (int k = 0; k < V; ++k) best[k] = 0.0f, picked[k] = 0, arg[k] = 0;  // overwritten by the first tap
    bool first = true;  // every window holds an input element (pads < kernel)
    for (int32_t i = max(0, -h0); i < i_end; ++i) {
      const T* row = image + static_cast<int64_t>(h0 + i) * g.w * g.c;
      for (int32_t j = max(0, -w0); j < j_end; ++j) {
        float v[V];
        uint32_t bits[V];
        LoadWithBits<T, V>(row + static_cast<int64_t>(w0 + j) * g.c, v, bits);
        const uint8_t tap = static_cast<uint8_t>(i * g.kw + j);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          if (first || (best[k] == best[k] && (v[k] > best[k] || v[k] != v[k]))) {  // greater, or the first NaN
            best[k] = v[k];
            picked[k] = bits[k];
            arg[k] = tap;
          }
        }
        first = false;
      }
    }
    const int64_t at = static_cast<int64_t>(idx) * V;
    StoreBits<T, V>(y + at, picked);
    if constexpr (kArgmax) StoreBytes<V>(argmax + at, arg);
  }
}

// Thread idx: dx[n, h, w, V*cg .. V*cg + V - 1], idx = ((n*H + h)*W + w)*C/V + cg.
template <typename T, int V, typename I>
__global__ void __launch_bounds__(kThreads) MaxPoolBackward(const T* __restrict__ dy, const uint8_t* __restrict__ argmax,
                                                            T* __restrict__ dx, const PoolGeometry g, I groups,
                                                            I channel_groups) {
  const I step = static_cast<I>(gridDim.x) * kThreads;
  for (I idx = static_cast<I>(blockIdx.x) * kThreads + threadIdx.x; idx < groups; idx += step) {
    const I p = idx / channel_groups;
    const I cg = idx - p * channel_groups;
    const I q = p / g.w;
    const int32_t w = static_cast<int32_t>(p - q * g.w);
    const I n = q / g.h;
    const int32_t h = static_cast<int32_t>(q - n * g.h);
    // the windows holding (h, w): oh*sh - pt <= h <= oh*sh - pt + kh - 1, likewise ow
    const int32_t top = h + g.pt - g.kh + 1, left = w + g.pl - g.kw + 1;
    const int32_t oh_first = top <= 0 ? 0 : (top + g.sh - 1) / g.sh;
    const int32_t oh_last = min(g.ho - 1, (h + g.pt) / g.sh);
    const int32_t ow_first = left <= 0 ? 0 : (left + g.sw - 1) / g.sw;
    const int32_t ow_last = min(g.wo - 1, (w + g.pl) / g.sw);
    const int64_t image = static_cast<int64_t>(n) * g.ho * g.wo * g.c + static_cast<int64_t>(cg) * V;
    float acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = 0.0f;
    for (int32_t oh = oh_first; oh <= oh_last; ++oh) {
      const int32_t i = h + g.pt - oh * g.sh;
      for (int32_t ow = ow_first; ow <= ow_last; ++ow) {
        const uint8_t tap = static_cast<uint8_t>(i * g.kw + (w + g.pl - ow * g.sw));
        const int64_t at = image + (static_cast<int64_t>(oh) * g.wo + ow) * g.c;
        uint8_t picked[V];
        LoadBytes<V>(argmax + at, picked);
        bool any = false;
#pragma unroll
        for (int k = 0; k < V; ++k) any |= picked[k] == tap;
        if (!any) continue;  // no dy to read
        float d[V];
        Load<T, V>(dy + at, d);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          if (picked[k] == tap) acc[k] += d[k];
        }
      }
    }
    Store<T, V>(dx + static_cast<int64_t>(idx) * V, acc);
  }
}

PoolGeometry GeometryOf(const MaxPoolShape& s) {
  for (int64_t value : {s.h, s.w, s.ho, s.wo}) {
    if (value > INT32_MAX) throw std::runtime_error("MaxPoolNhwc: H, W, Ho and Wo must be below 2^31 on CUDA");
  }
  const MaxPoolAttrs& a = s.a;
  return {static_cast<int32_t>(s.h),  static_cast<int32_t>(s.w),  static_cast<int32_t>(s.ho), static_cast<int32_t>(s.wo),
          static_cast<int32_t>(a.kh), static_cast<int32_t>(a.kw), static_cast<int32_t>(a.sh), static_cast<int32_t>(a.sw),
          static_cast<int32_t>(a.pt), static_cast<int32_t>(a.pl), s.c};
}

template <typename T, int V>
void LaunchForward(const MaxPoolArgs& a, const PoolGeometry& g, cudaStream_t stream) {
  const int64_t elements = a.n * a.ho * a.wo * a.c, groups = elements / V;
  const int blocks = Blocks(groups);
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  if (elements <= INT32_MAX) {
    const uint32_t count = static_cast<uint32_t>(groups), channels = static_cast<uint32_t>(a.c / V);
    if (a.argmax != nullptr) {
      MaxPoolForward<T, V, true, uint32_t><<<blocks, kThreads, 0, stream>>>(x, y, a.argmax, g, count, channels);
    } else {
      MaxPoolForward<T, V, false, uint32_t><<<blocks, kThreads, 0, stream>>>(x, y, nullptr, g, count, channels);
    }
  } else if (a.argmax != nullptr) {
    MaxPoolForward<T, V, true, int64_t><<<blocks, kThreads, 0, stream>>>(x, y, a.argmax, g, groups, a.c / V);
  } else {
    MaxPoolForward<T, V, false, int64_t><<<blocks, kThreads, 0, stream>>>(x, y, nullptr, g, groups, a.c / V);
  }
  CudaCheck(cudaGetLastError(), "MaxPoolNhwc launch");
}

template <typename T, int V>
void LaunchBackward(const MaxPoolGradArgs& a, const PoolGeometry& g, cudaStream_t stream) {
  const int64_t elements = a.n * a.h * a.w * a.c, groups = elements / V;
  const int blocks = Blocks(groups);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  if (elements <= INT32_MAX) {
    MaxPoolBackward<T, V, uint32_t><<<blocks, kThreads, 0, stream>>>(dy, a.argmax, dx, g, static_cast<uint32_t>(groups),
                                                                      static_cast<uint32_t>(a.c / V));
  } else {
    MaxPoolBackward<T, V, int64_t><<<blocks, kThreads, 0, stream>>>(dy, a.argmax, dx, g, groups, a.c / V);
  }
  CudaCheck(cudaGetLastError(), "MaxPoolNhwcGrad launch");
}

}  // namespace

void MaxPoolNhwcCuda(const MaxPoolArgs& a, void* stream_handle) {
  if (a.n * a.ho * a.wo * a.c == 0) return;  // nothing to write: no launch
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const PoolGeometry g = GeometryOf(a);
  const int v = a.half ? 8 : 4;
  const bool vector = a.c % v == 0 && Aligned(a.x, 16) && Aligned(a.y, 16) && (a.argmax == nullptr || Aligned(a.argmax, v));
  if (a.half) return vector ? LaunchForward<__half, 8>(a, g, stream) : LaunchForward<__half, 1>(a, g, stream);
  vector ? LaunchForward<float, 4>(a, g, stream) : LaunchForward<float, 1>(a, g, stream);
}

void MaxPoolNhwcGradCuda(const MaxPoolGradArgs& a, void* stream_handle) {
  if (a.n * a.h * a.w * a.c == 0) return;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const PoolGeometry g = GeometryOf(a);
  const int v = a.half ? 8 : 4;
  const bool vector = a.c % v == 0 && Aligned(a.dy, 16) && Aligned(a.dx, 16) && Aligned(a.argmax, v);
  if (a.half) return vector ? LaunchBackward<__half, 8>(a, g, stream) : LaunchBackward<__half, 1>(a, g, stream);
  vector ? LaunchBackward<float, 4>(a, g, stream) : LaunchBackward<float, 1>(a, g, stream);
}

}  // namespace onnxcampo
