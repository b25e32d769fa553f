// SoftmaxCrossEntropy and its gradient on CUDA (xent.h has the arithmetic), one block per row.
//
// Forward: thread t reads columns t, t + T, ... of its row, four at a time (independent loads in
// flight), and keeps a running (max m, sum s of exp(x - m)); a new maximum rescales s by
// exp(m_old - m_new). The warp, then the block, combines the pairs: one read of the logits, where
// ORT's LogSoftmax reads them twice and writes log probabilities as large as the logits, which
// the unfused loss then reads again (Mul with the one-hot, Exp in the backward).
// Backward: the same row walk, reading x and writing dx once; the label's column adds the scale.
// Rows are not aligned (GPT-2's 50257 columns): plain element loads, coalesced along the row.
// expf and logf are CUDA's full-precision functions (the library is built with -fmad=false).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "cuda_util.h"
#include "xent.h"

namespace onnxcampo {
namespace {

constexpr int kUnroll = 4;

template <typename T>
__device__ __forceinline__ float Load(const T* p, int64_t i);
template <>
__device__ __forceinline__ float Load<float>(const float* p, int64_t i) { return p[i]; }
template <>
__device__ __forceinline__ float Load<__half>(const __half* p, int64_t i) { return __half2float(p[i]); }

__device__ __forceinline__ void Store(void* p, bool half, int64_t i, float v) {
  if (half) {
    static_cast<__half*>(p)[i] = __float2half_rn(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

__device__ __forceinline__ int64_t Column(int64_t label, int64_t classes) {
  if (label < 0) label += classes;
  return label >= 0 && label < classes ? label : -1;
}

// (m, s) combined with (m2, s2); a side with no element yet (m = -inf, s = 0) leaves the other.
__device__ __forceinline__ void Combine(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY && s2 == 0.0f) return;
  if (m == -INFINITY && s == 0.0f) {
    m = m2;
    s = s2;
    return;
  }
  const float top = fmaxf(m, m2);
  s = s * expf(m - top) + s2 * expf(m2 - top);
  m = top;
}

__device__ __forceinline__ void Add(float& m, float& s, float v) {
  if (v > m) {
    s = s * expf(m - v) + 1.0f;  // m = -inf at first: s is 0, 0 * 0 + 1
    m = v;
  } else {
    s += expf(v - m);  // v NaN: s NaN, as ORT's LogSoftmax
  }
}

template <typename T>
__global__ void ForwardKernel(const T* x, const int64_t* labels, int64_t width, int64_t classes, void* picked,
                              bool picked_half, float* lse_out) {
  const int64_t r = blockIdx.x;
  const T* row = x + r * width;
  float m = -INFINITY, s = 0.0f;
  const int64_t step = static_cast<int64_t>(blockDim.x) * kUnroll;
  int64_t j = threadIdx.x;
  for (; j + (kUnroll - 1) * blockDim.x < classes; j += step) {
    float v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) v[k] = Load(row, j + k * blockDim.x);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) Add(m, s, v[k]);
  }
  for (; j < classes; j += blockDim.x) Add(m, s, Load(row, j));

  for (int offset = 16; offset > 0; offset >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    Combine(m, s, m2, s2);
  }
  __shared__ float ms[32], ss[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) {
    ms[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < warps ? ms[lane] : -INFINITY;
    s = lane < warps ? ss[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
      const float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
      Combine(m, s, m2, s2);
    }
    if (lane == 0) {
      const float lse = m + logf(s);
      const int64_t column = Column(labels[r], classes);
      lse_out[r] = lse;
      Store(picked, picked_half, r, column < 0 ? 0.0f : Load(row, column) - lse);
    }
  }
}

template <typename T, typename S>
__global__ void BackwardKernel(const T* x, const float* lse, const int64_t* labels, const S* scale, bool per_row,
                               int64_t width, int64_t classes, void* dx, bool dx_half, int64_t dx_width) {
  const int64_t r = blockIdx.x;
  const T* row = x + r * width;
  const float s = Load(scale, per_row ? r : 0);
  const int64_t column = Column(labels[r], classes);
  const float total = column < 0 ? 0.0f : s;
  const float shift = lse[r];
  const int64_t out = r * dx_width;
#pragma unroll kUnroll
  for (int64_t j = threadIdx.x; j < classes; j += blockDim.x) {
    const float g = j == column ? s : 0.0f;
    Store(dx, dx_half, out + j, g - expf(Load(row, j) - shift) * total);
  }
  for (int64_t j = classes + threadIdx.x; j < dx_width; j += blockDim.x) Store(dx, dx_half, out + j, 0.0f);
}

// Threads per block: enough for four columns each up to 1024 (a power of two, at least a warp).
int Threads(int64_t classes) {
  int threads = 32;
  while (threads < 1024 && threads * kUnroll < classes) threads *= 2;
  return threads;
}

}  // namespace

void SoftmaxCrossEntropyCuda(const XentArgs& a, void* stream_handle) {
  if (a.rows == 0) return;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const int threads = Threads(a.classes);
  if (a.x_half) {
    ForwardKernel<__half><<<static_cast<unsigned>(a.rows), threads, 0, stream>>>(
        static_cast<const __half*>(a.x), a.labels, a.width, a.classes, a.picked, a.picked_half, a.lse_out);
  } else {
    ForwardKernel<float><<<static_cast<unsigned>(a.rows), threads, 0, stream>>>(
        static_cast<const float*>(a.x), a.labels, a.width, a.classes, a.picked, a.picked_half, a.lse_out);
  }
  CudaCheck(cudaGetLastError(), "SoftmaxCrossEntropy launch");
}

void SoftmaxCrossEntropyGradCuda(const XentArgs& a, void* stream_handle) {
  if (a.rows == 0 || a.classes == 0) return;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const int threads = Threads(a.classes);
  const unsigned blocks = static_cast<unsigned>(a.rows);
  auto launch = [&](auto x, auto scale) {
    BackwardKernel<<<blocks, threads, 0, stream>>>(x, a.lse, a.labels, scale, a.scale_per_row, a.width, a.classes,
                                                   a.dx, a.dx_half, a.dx_width > 0 ? a.dx_width : a.classes);
  };
  const auto* xh = static_cast<const __half*>(a.x);
  const auto* xf = static_cast<const float*>(a.x);
  const auto* sh = static_cast<const __half*>(a.scale);
  const auto* sf = static_cast<const float*>(a.scale);
  if (a.x_half) {
    a.scale_half ? launch(xh, sh) : launch(xh, sf);
  } else {
    a.scale_half ? launch(xf, sh) : launch(xf, sf);
  }
  CudaCheck(cudaGetLastError(), "SoftmaxCrossEntropyGrad launch");
}

}  // namespace onnxcampo
