// BlockReduceSum's CUDA kernels (the plan, PlanBlockReduce, is in reduce_cpu.cc; reduce.h says
// what each kernel covers).
//
// Memory-bound: every element of x is read once, with loads of up to 16 bytes (8 float16 or 4
// float32 values) along the contiguous dim when its length and x's address allow. Sums are
// float32. No atomics: a split reduction writes float32 partial sums to a workspace that the
// finishing kernel adds up in a fixed order, so results are reproducible run to run.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <stdexcept>
#include <string>

#include "cuda_util.h"
#include "reduce.h"

namespace onnxcampo {
namespace {

// The float32 values of the elements a 32-bit word holds: one float, or two halves (low first).
template <typename T>
__device__ __forceinline__ void WordToFloats(unsigned int word, float* out) {
  if constexpr (sizeof(T) == 4) {
    out[0] = __uint_as_float(word);
  } else {
    out[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(word & 0xffffu)));
    out[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(word >> 16)));
  }
}

// V consecutive elements from p (aligned to V * sizeof(T) bytes), as float32, with one load of
// V * sizeof(T) bytes (no local copy: the words are taken apart in registers).
template <typename T, int V>
__device__ __forceinline__ void LoadFloats(const T* p, float (&out)[V]) {
  constexpr int kBytes = V * static_cast<int>(sizeof(T));
  constexpr int kPer = 4 / static_cast<int>(sizeof(T));  // elements per 32-bit word
  if constexpr (kBytes == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    WordToFloats<T>(raw.x, out);
    WordToFloats<T>(raw.y, out + kPer);
    WordToFloats<T>(raw.z, out + 2 * kPer);
    WordToFloats<T>(raw.w, out + 3 * kPer);
  } else if constexpr (kBytes == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    WordToFloats<T>(raw.x, out);
    WordToFloats<T>(raw.y, out + kPer);
  } else if constexpr (kBytes == 4) {
    WordToFloats<T>(*reinterpret_cast<const unsigned int*>(p), out);
  } else {
    static_assert(kBytes == 2, "one float16");
    out[0] = __half2float(*reinterpret_cast<const __half*>(p));
  }
}

template <bool Half>
__device__ __forceinline__ void Store(void* y, int64_t i, float value) {
  if constexpr (Half) {
    static_cast<__half*>(y)[i] = __float2half_rn(value);
  } else {
    static_cast<float*>(y)[i] = value;
  }
}

struct ColumnArgs {
  const void* x;
  void* out;  // y (partials == 1) or the workspace [chunks, Q]
  int64_t P, Q, rows;
};

// R == 1: blockDim (tx, ty), grid (blocks_x, chunks). Thread (i, j) of block (bx, c) adds rows
// c*rows + j, + ty, ... of columns (bx*tx + i)*V .. + V-1; the block then adds its ty sums per
// column in order j = 0..ty-1. Q % V == 0, so a vector is wholly in or out of range.
template <typename T, int V, bool OutHalf>
__global__ void __launch_bounds__(kReduceThreads, 4) ColumnKernel(ColumnArgs a) {
  __shared__ float sums[kReduceThreads * V];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int width = blockDim.x * V;  // columns of this block
  const int64_t column = static_cast<int64_t>(blockIdx.x) * width + tx * V;
  const int64_t p0 = static_cast<int64_t>(blockIdx.y) * a.rows;
  const int64_t p1 = min(a.P, p0 + a.rows);
  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.0f;
  if (column < a.Q) {
    const T* x = static_cast<const T*>(a.x) + column;
#pragma unroll 4
    for (int64_t p = p0 + ty; p < p1; p += blockDim.y) {
      float v[V];
      LoadFloats<T, V>(x + p * a.Q, v);
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += v[j];
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) sums[ty * width + tx * V + j] = acc[j];
  __syncthreads();
  const int threads = blockDim.x * blockDim.y;
  for (int c = ty * blockDim.x + tx; c < width; c += threads) {
    const int64_t q = static_cast<int64_t>(blockIdx.x) * width + c;
    if (q >= a.Q) continue;
    float total = sums[c];
    for (int j = 1; j < static_cast<int>(blockDim.y); ++j) total += sums[j * width + c];
    Store<OutHalf>(a.out, static_cast<int64_t>(blockIdx.y) * a.Q + q, total);
  }
}

struct RowArgs {
  const void* x;
  void* out;  // y (partials == 1) or the workspace [partials, Q]
  int64_t P, Q, R;
  int64_t items, p_len, r_len, r_chunks;
  int lanes, lane_bits;  // lanes == 1 << lane_bits
};

// R > 1: 1-D blocks of kReduceThreads threads, `lanes` per work item. Item i = k*Q + q with
// k = pc*r_chunks + rc (so its partial sum belongs at out[i]); see reduce.h. Every thread
// reaches the shuffles (an item past the end adds nothing).
template <typename T, int V, bool OutHalf>
__global__ void __launch_bounds__(kReduceThreads, 4) RowKernel(RowArgs a) {
  const int lane = threadIdx.x & (a.lanes - 1);
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (kReduceThreads >> a.lane_bits) + (threadIdx.x >> a.lane_bits);
  float acc = 0.0f;
  if (item < a.items) {
    const int64_t q = item % a.Q;
    const int64_t k = item / a.Q;
    const int64_t rc = k % a.r_chunks, pc = k / a.r_chunks;
    const int64_t p0 = pc * a.p_len, p1 = min(a.P, p0 + a.p_len);
    const int64_t r0 = rc * a.r_len + static_cast<int64_t>(lane) * V, r1 = min(a.R, rc * a.r_len + a.r_len);
    const int64_t stride = static_cast<int64_t>(a.lanes) * V;
    const int64_t next = a.Q * a.R;  // from row (p, q) to row (p + 1, q)
    const T* row = static_cast<const T*>(a.x) + (p0 * a.Q + q) * a.R;
    int64_t p = p0;
    // four rows at a time: four loads in flight however short the rows are
    for (; p + 4 <= p1; p += 4, row += 4 * next) {
#pragma unroll 2
      for (int64_t r = r0; r < r1; r += stride) {
        float v0[V], v1[V], v2[V], v3[V];
        LoadFloats<T, V>(row + r, v0);
        LoadFloats<T, V>(row + next + r, v1);
        LoadFloats<T, V>(row + 2 * next + r, v2);
        LoadFloats<T, V>(row + 3 * next + r, v3);
#pragma unroll
        for (int j = 0; j < V; ++j) acc += v0[j];
#pragma unroll
        for (int j = 0; j < V; ++j) acc += v1[j];
#pragma unroll
        for (int j = 0; j < V; ++j) acc += v2[j];
#pragma unroll
        for (int j = 0; j < V; ++j) acc += v3[j];
      }
    }
    for (; p < p1; ++p, row += next) {
#pragma unroll 4
      for (int64_t r = r0; r < r1; r += stride) {
        float v[V];
        LoadFloats<T, V>(row + r, v);
#pragma unroll
        for (int j = 0; j < V; ++j) acc += v[j];
      }
    }
  }
  for (int offset = a.lanes >> 1; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (item < a.items && lane == 0) Store<OutHalf>(a.out, item, acc);
}

// y[q] = sum over k of partial[k][q]: blockDim (32, 8); thread (i, j) adds k = j, j + 8, ... in
// order, then thread (i, 0) adds the 8 run sums in order j = 0..7.
template <bool OutHalf>
__global__ void __launch_bounds__(256) FinishKernel(const float* partial, void* y, int64_t partials, int64_t Q) {
  __shared__ float runs[8][33];
  const int64_t q = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float acc = 0.0f;
  if (q < Q) {
#pragma unroll 8
    for (int64_t k = threadIdx.y; k < partials; k += 8) acc += partial[k * Q + q];
  }
  runs[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && q < Q) {
    float total = runs[0][threadIdx.x];
#pragma unroll
    for (int j = 1; j < 8; ++j) total += runs[j][threadIdx.x];
    Store<OutHalf>(y, q, total);
  }
}

template <typename T, bool OutHalf>
void LaunchColumns(const BlockReducePlan& plan, const ColumnArgs& args, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(plan.blocks_x), static_cast<unsigned>(plan.chunks));
  const dim3 block(plan.tx, plan.ty);
  switch (plan.vec) {
    case 8:
      if constexpr (sizeof(T) == 2) {
        ColumnKernel<T, 8, OutHalf><<<grid, block, 0, stream>>>(args);
        return;
      }
      break;
    case 4: ColumnKernel<T, 4, OutHalf><<<grid, block, 0, stream>>>(args); return;
    case 2: ColumnKernel<T, 2, OutHalf><<<grid, block, 0, stream>>>(args); return;
    case 1: ColumnKernel<T, 1, OutHalf><<<grid, block, 0, stream>>>(args); return;
  }
  throw std::runtime_error("BlockReduceSum: no column kernel for this vector width");
}

template <typename T, bool OutHalf>
void LaunchRows(const BlockReducePlan& plan, const RowArgs& args, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(plan.blocks);
  switch (plan.vec) {
    case 8:
      if constexpr (sizeof(T) == 2) {
        RowKernel<T, 8, OutHalf><<<grid, kReduceThreads, 0, stream>>>(args);
        return;
      }
      break;
    case 4: RowKernel<T, 4, OutHalf><<<grid, kReduceThreads, 0, stream>>>(args); return;
    case 2: RowKernel<T, 2, OutHalf><<<grid, kReduceThreads, 0, stream>>>(args); return;
    case 1: RowKernel<T, 1, OutHalf><<<grid, kReduceThreads, 0, stream>>>(args); return;
  }
  throw std::runtime_error("BlockReduceSum: no row kernel for this vector width");
}

// The first kernel, writing y (OutHalf as y) or float32 partials.
template <typename T, bool OutHalf>
void LaunchFirst(const BlockReduceArgs& a, const BlockReducePlan& plan, void* out, cudaStream_t stream) {
  if (plan.kind == BlockReducePlan::kColumns) {
    LaunchColumns<T, OutHalf>(plan, ColumnArgs{a.x, out, a.P, a.Q, plan.rows}, stream);
  } else {
    int bits = 0;
    while ((1 << bits) < plan.lanes) ++bits;
    LaunchRows<T, OutHalf>(plan, RowArgs{a.x, out, a.P, a.Q, a.R, plan.items, plan.p_len, plan.r_len, plan.r_chunks,
                                         plan.lanes, bits},
                           stream);
  }
}

template <typename T>
void LaunchFirstFor(const BlockReduceArgs& a, const BlockReducePlan& plan, void* out, bool out_half, cudaStream_t stream) {
  if (out_half) {
    LaunchFirst<T, true>(a, plan, out, stream);
  } else {
    LaunchFirst<T, false>(a, plan, out, stream);
  }
}

}  // namespace

BlockReducePlan PlanBlockReduceCuda(const BlockReduceArgs& args, bool workspace) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(args.x);
  int align = 16;
  while (align > 1 && address % align != 0) align /= 2;
  return PlanBlockReduce(args.P, args.Q, args.R, args.x_half, align, MultiprocessorCount(), workspace);
}

void BlockReduceSumCuda(const BlockReduceArgs& a, const BlockReducePlan& plan, void* workspace, void* stream_handle) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  if (plan.kind == BlockReducePlan::kNothing) return;
  if (plan.kind == BlockReducePlan::kZeros) {  // nothing to add: zeros (all bits 0 in both types)
    CudaCheck(cudaMemsetAsync(a.y, 0, static_cast<size_t>(a.Q) * (a.y_half ? 2 : 4), stream), "cudaMemsetAsync(y)");
    return;
  }
  if (plan.blocks_x > INT_MAX || plan.chunks > 65535 || plan.blocks > INT_MAX) {
    throw std::runtime_error("BlockReduceSum: the call is too large for one launch");
  }
  const bool split = plan.partials > 1;
  if (split && workspace == nullptr) throw std::runtime_error("BlockReduceSum: the plan needs a workspace");
  void* first_out = split ? workspace : a.y;
  const bool first_half = split ? false : a.y_half;
  if (a.x_half) {
    LaunchFirstFor<__half>(a, plan, first_out, first_half, stream);
  } else {
    LaunchFirstFor<float>(a, plan, first_out, first_half, stream);
  }
  CudaCheck(cudaGetLastError(), "BlockReduceSum launch");
  if (!split) return;
  const unsigned blocks = static_cast<unsigned>((a.Q + 31) / 32);
  const dim3 block(32, 8);
  if (a.y_half) {
    FinishKernel<true><<<blocks, block, 0, stream>>>(static_cast<const float*>(workspace), a.y, plan.partials, a.Q);
  } else {
    FinishKernel<false><<<blocks, block, 0, stream>>>(static_cast<const float*>(workspace), a.y, plan.partials, a.Q);
  }
  CudaCheck(cudaGetLastError(), "BlockReduceSum finishing launch");
}

}  // namespace onnxcampo
