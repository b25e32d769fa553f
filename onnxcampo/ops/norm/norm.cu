// LayerNormGrad and SoftmaxGrad on CUDA (norm.h has the arithmetic): one block per row. Pass 1: each thread adds
// g and g * xhat over its columns (t, t + T, ...), the warp and then the block add the pairs.
// Pass 2 reads the row again (from L1/L2: a BERT row is 1.5 KB of float16) and writes dx. Built
// with -fmad=false like the other kernels.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_util.h"
#include "norm.h"

namespace onnxcampo {
namespace {

__device__ __forceinline__ float Load(const void* p, bool half, int64_t i) {
  return half ? __half2float(static_cast<const __half*>(p)[i]) : static_cast<const float*>(p)[i];
}

__global__ void LayerNormGradKernel(const NormGradArgs a) {
  const int64_t r = blockIdx.x;
  const int64_t base = r * a.cols;
  float sum_g = 0.0f, sum_gx = 0.0f;
  for (int64_t j = threadIdx.x; j < a.cols; j += blockDim.x) {
    const float g = Load(a.dy, a.dy_half, base + j) * Load(a.gamma, a.gamma_half, j);
    sum_g += g;
    sum_gx += g * Load(a.xhat, a.xhat_half, base + j);
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    sum_g += __shfl_xor_sync(0xffffffffu, sum_g, offset);
    sum_gx += __shfl_xor_sync(0xffffffffu, sum_gx, offset);
  }
  __shared__ float gs[32], gxs[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) {
    gs[warp] = sum_g;
    gxs[warp] = sum_gx;
  }
  __syncthreads();
  if (warp == 0) {
    sum_g = lane < warps ? gs[lane] : 0.0f;
    sum_gx = lane < warps ? gxs[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) {
      sum_g += __shfl_xor_sync(0xffffffffu, sum_g, offset);
      sum_gx += __shfl_xor_sync(0xffffffffu, sum_gx, offset);
    }
    if (lane == 0) {
      gs[0] = sum_g;
      gxs[0] = sum_gx;
    }
  }
  __syncthreads();
  const float inv_cols = 1.0f / static_cast<float>(a.cols);
  const float mean_g = gs[0] * inv_cols, mean_gx = gxs[0] * inv_cols;
  const float inv = Load(a.invstd, a.invstd_half, r);
  for (int64_t j = threadIdx.x; j < a.cols; j += blockDim.x) {
    const float g = Load(a.dy, a.dy_half, base + j) * Load(a.gamma, a.gamma_half, j);
    float v = inv * ((g - mean_g) - Load(a.xhat, a.xhat_half, base + j) * mean_gx);
    if (a.acc != nullptr) v += Load(a.acc, a.acc_half, base + j);
    if (a.dx_half) {
      static_cast<__half*>(a.dx)[base + j] = __float2half_rn(v);
    } else {
      static_cast<float*>(a.dx)[base + j] = v;
    }
  }
}

// The sum of `v` over the block (every thread gets it); `shared` holds 32 floats.
__device__ __forceinline__ float BlockSum(float v, float* shared) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? shared[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  return shared[0];
}

__global__ void SoftmaxGradKernel(const SoftmaxGradArgs a) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * a.cols;
  float dot = 0.0f;
  for (int64_t j = threadIdx.x; j < a.cols; j += blockDim.x) dot += Load(a.dy, a.dy_half, base + j) * Load(a.y, a.y_half, base + j);
  __shared__ float shared[32];
  dot = BlockSum(dot, shared);
  for (int64_t j = threadIdx.x; j < a.cols; j += blockDim.x) {
    const float v = a.scale * (Load(a.y, a.y_half, base + j) * (Load(a.dy, a.dy_half, base + j) - dot));
    if (a.dx_half) {
      static_cast<__half*>(a.dx)[base + j] = __float2half_rn(v);
    } else {
      static_cast<float*>(a.dx)[base + j] = v;
    }
  }
}

// A thread for every 2 columns up to 1024 (a power of two, at least a warp).
int Threads(int64_t cols) {
  int threads = 32;
  while (threads < 1024 && threads * 2 < cols) threads *= 2;
  return threads;
}

}  // namespace

void LayerNormGradCuda(const NormGradArgs& a, void* stream_handle) {
  if (a.rows == 0 || a.cols == 0) return;
  LayerNormGradKernel<<<static_cast<unsigned>(a.rows), Threads(a.cols), 0, static_cast<cudaStream_t>(stream_handle)>>>(a);
  CudaCheck(cudaGetLastError(), "LayerNormGrad launch");
}

void SoftmaxGradCuda(const SoftmaxGradArgs& a, void* stream_handle) {
  if (a.rows == 0 || a.cols == 0) return;
  SoftmaxGradKernel<<<static_cast<unsigned>(a.rows), Threads(a.cols), 0, static_cast<cudaStream_t>(stream_handle)>>>(a);
  CudaCheck(cudaGetLastError(), "SoftmaxGrad launch");
}

}  // namespace onnxcampo
