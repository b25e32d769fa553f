// CUDA kernels: one launch covers every tensor of a call.
//
// The tensors of a call are cut into tiles of kTile elements; block b walks tiles b,
// b + gridDim.x, ... and finds a tile's tensor by binary search in a table that travels as a
// kernel parameter (__grid_constant__, read from the constant bank, no device copy and no
// extra memcpy). CUDA 12.1+ allows 32 KB of parameters on sm_70+, room for ~460 tensors of
// AdamW; a call with more tensors takes one launch per table.
//
// These kernels are bound by memory bandwidth. A thread moves kVec consecutive elements per
// step with 16-byte loads and stores (one uint4 of float16 gradients, two float4 of float32)
// when every pointer of the tensor is 16-byte aligned (ORT's allocations are 256-byte
// aligned); a tensor's last kVec - 1 elements, and tensors of unaligned buffers, go element
// by element. Both paths compute every element with the same float32 operations.
//
// Built with -fmad=false so that products and sums round like the standard-op graph's
// separate Mul and Add nodes (these kernels are memory-bound; the FMA saves nothing).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda_util.h"
#include "multi_tensor.h"

namespace onnxcampo {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 8192;                // elements per tile (32 per thread)
constexpr int kVec = 8;                    // elements per vector step (kTile is a multiple)
constexpr uint8_t kHalf = 1;               // Table::flags: float16 gradient
constexpr uint8_t kAligned = 2;            // Table::flags: every pointer 16-byte aligned
constexpr int kParamBytes = 32764 - 256;   // CUDA's limit, less room for the other parameters

template <int P>  // P pointers per tensor: the gradient first, then the op's other tensors
struct Table {
  static constexpr int kCapacity = (kParamBytes - 16) / (8 * P + 8 + 4 + 1);
  int count;
  int tiles;
  const void* ptr[P][kCapacity];
  int64_t size[kCapacity];
  int32_t tile_end[kCapacity];  // tiles of tensors 0..k together
  uint8_t flags[kCapacity];     // kHalf | kAligned
};
static_assert(sizeof(Table<7>) <= kParamBytes, "AdamW table exceeds the kernel parameter space");

int GridFor(int tiles) {
  const int blocks = MultiprocessorCount() * (2048 / kThreads);
  return std::max(1, std::min(tiles, blocks));
}

// Fills tables of at most kCapacity tensors from `first` on; `pointers(k, slot)` gives the
// pointer of tensor k in slot p. Returns the index of the first tensor not taken.
template <int P, typename Pointers>
size_t Fill(Table<P>& table, const Grads& grads, size_t first, Pointers pointers) {
  table.count = 0;
  int tiles = 0;
  size_t k = first;
  for (; k < grads.count() && table.count < Table<P>::kCapacity; ++k) {
    const int slot = table.count++;
    bool aligned = true;
    for (int p = 0; p < P; ++p) {
      table.ptr[p][slot] = pointers(k, p);
      aligned = aligned && reinterpret_cast<uintptr_t>(table.ptr[p][slot]) % 16 == 0;  // null counts as aligned
    }
    table.size[slot] = grads.size[k];
    table.flags[slot] = static_cast<uint8_t>((grads.half[k] ? kHalf : 0) | (aligned ? kAligned : 0));
    const int64_t more = (grads.size[k] + kTile - 1) / kTile;
    if (tiles + more > (1LL << 30)) throw std::runtime_error("onnxcampo_ops: too many elements in one call");
    tiles += static_cast<int>(more);
    table.tile_end[slot] = tiles;
  }
  table.tiles = tiles;
  return k;
}

template <int W>
struct Width {
  static constexpr int value = W;
};

template <int W>
struct Vec {
  float x[W];
};

// W consecutive float32 values from p[i]; W == kVec needs p + i 16-byte aligned.
template <int W>
__device__ __forceinline__ Vec<W> Load(const void* p, int64_t i) {
  Vec<W> v;
  const float* f = static_cast<const float*>(p) + i;
  if constexpr (W == 1) {
    v.x[0] = *f;
  } else {
#pragma unroll
    for (int j = 0; j < W; j += 4) {
      const float4 q = *reinterpret_cast<const float4*>(f + j);
      v.x[j] = q.x, v.x[j + 1] = q.y, v.x[j + 2] = q.z, v.x[j + 3] = q.w;
    }
  }
  return v;
}

// W consecutive gradients (float16 or float32) from p[i], as float32.
template <int W>
__device__ __forceinline__ Vec<W> LoadGrad(const void* p, bool half, int64_t i) {
  if (!half) return Load<W>(p, i);
  Vec<W> v;
  const __half* h = static_cast<const __half*>(p) + i;
  if constexpr (W == 1) {
    v.x[0] = __half2float(*h);
  } else {
#pragma unroll
    for (int j = 0; j < W; j += 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(h + j);
      const __half2* pairs = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __half22float2(pairs[q]);
        v.x[j + 2 * q] = f.x, v.x[j + 2 * q + 1] = f.y;
      }
    }
  }
  return v;
}

template <int W>
__device__ __forceinline__ void Store(const void* p, int64_t i, const Vec<W>& v) {
  float* f = static_cast<float*>(const_cast<void*>(p)) + i;
  if constexpr (W == 1) {
    *f = v.x[0];
  } else {
#pragma unroll
    for (int j = 0; j < W; j += 4) *reinterpret_cast<float4*>(f + j) = make_float4(v.x[j], v.x[j + 1], v.x[j + 2], v.x[j + 3]);
  }
}

__device__ __forceinline__ bool IsSet(const void* flag, bool is_float) {
  return is_float ? *static_cast<const float*>(flag) != 0.0f : *static_cast<const bool*>(flag);
}

// Calls op(Width<W>{}, k, i) for the elements i .. i + W - 1 of every tensor k: W = kVec over
// the aligned body of a tile, W = 1 for the rest. The tile loop is block-uniform.
template <int P, typename Op>
__device__ __forceinline__ void ForEach(const Table<P>& t, Op op) {
  for (int tile = blockIdx.x; tile < t.tiles; tile += gridDim.x) {
    int lo = 0, hi = t.count - 1;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (t.tile_end[mid] > tile) hi = mid; else lo = mid + 1;
    }
    const int tile_begin = lo ? t.tile_end[lo - 1] : 0;
    const int64_t first = static_cast<int64_t>(tile - tile_begin) * kTile;
    const int64_t last = min(first + kTile, t.size[lo]);
    int64_t rest = first;
    if (t.flags[lo] & kAligned) {
      rest = first + (last - first) / kVec * kVec;
#pragma unroll 2
      for (int64_t i = first + kVec * threadIdx.x; i < rest; i += kVec * kThreads) op(Width<kVec>{}, lo, i);
    }
    for (int64_t i = rest + threadIdx.x; i < last; i += kThreads) op(Width<1>{}, lo, i);
  }
}

// Write false: the check alone (CheckFinite), slot 1 and inv_scale unused.
template <bool Write>
__global__ void __launch_bounds__(kThreads) UnscaleKernel(const __grid_constant__ Table<2> t, const float* inv_scale, bool* found_inf) {
  const float scale = Write ? *inv_scale : 1.0f;
  bool found = false;
  ForEach(t, [&](auto width, int k, int64_t i) {
    constexpr int W = decltype(width)::value;
    const Vec<W> g = LoadGrad<W>(t.ptr[0][k], t.flags[k] & kHalf, i);
    Vec<W> u;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      found |= !isfinite(g.x[j]);
      u.x[j] = g.x[j] * scale;
    }
    if constexpr (Write) Store<W>(t.ptr[1][k], i, u);
  });
  if (__syncthreads_or(found) && threadIdx.x == 0) *found_inf = true;
}

// The gradient the update uses: g, or with inv_scale float32(g) * *inv_scale (what
// UnscaleKernel writes as u, the same product).
template <int W>
__device__ __forceinline__ Vec<W> LoadUpdateGrad(const void* p, bool half, int64_t i, const float* inv_scale) {
  Vec<W> g = LoadGrad<W>(p, half, i);
  if (inv_scale != nullptr) {
    const float scale = *inv_scale;
#pragma unroll
    for (int j = 0; j < W; ++j) g.x[j] = g.x[j] * scale;
  }
  return g;
}

// slots: 0 g, 1 w, 2 v, 3 w_out, 4 v_out
__global__ void __launch_bounds__(kThreads) SgdKernel(const __grid_constant__ Table<5> t, const float* lr, const void* flag,
                                                      bool flag_is_float, float mu, bool has_velocity,
                                                      const float* inv_scale) {
  const bool skip = IsSet(flag, flag_is_float);
  const float rate = *lr;
  ForEach(t, [&](auto width, int k, int64_t i) {
    constexpr int W = decltype(width)::value;
    Vec<W> w = Load<W>(t.ptr[1][k], i);
    if (skip) {
      Store<W>(t.ptr[3][k], i, w);
      if (has_velocity) Store<W>(t.ptr[4][k], i, Load<W>(t.ptr[2][k], i));
      return;
    }
    const Vec<W> g = LoadUpdateGrad<W>(t.ptr[0][k], t.flags[k] & kHalf, i, inv_scale);
    if (has_velocity) {
      Vec<W> v = Load<W>(t.ptr[2][k], i);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        v.x[j] = mu * v.x[j] + g.x[j];
        w.x[j] = w.x[j] - rate * v.x[j];
      }
      Store<W>(t.ptr[4][k], i, v);
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) w.x[j] = w.x[j] - rate * g.x[j];
    }
    Store<W>(t.ptr[3][k], i, w);
  });
}

struct AdamWHyper {
  float beta1, beta2, one_minus_b1, one_minus_b2, eps, weight_decay;
};

// slots: 0 g, 1 w, 2 m, 3 v, 4 w_out, 5 m_out, 6 v_out
__global__ void __launch_bounds__(kThreads) AdamWKernel(const __grid_constant__ Table<7> t, const float* lr, const float* step,
                                                        float* step_out, const void* flag, bool flag_is_float, AdamWHyper h,
                                                        const float* inv_scale) {
  const bool skip = IsSet(flag, flag_is_float);
  const float rate = *lr;
  const float now = *step + 1.0f;
  if (blockIdx.x == 0 && threadIdx.x == 0) *step_out = skip ? *step : now;
  const float c1 = 1.0f - powf(h.beta1, now);
  const float c2 = 1.0f - powf(h.beta2, now);
  ForEach(t, [&](auto width, int k, int64_t i) {
    constexpr int W = decltype(width)::value;
    Vec<W> w = Load<W>(t.ptr[1][k], i);
    Vec<W> m = Load<W>(t.ptr[2][k], i);
    Vec<W> v = Load<W>(t.ptr[3][k], i);
    if (!skip) {
      const Vec<W> g = LoadUpdateGrad<W>(t.ptr[0][k], t.flags[k] & kHalf, i, inv_scale);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        m.x[j] = h.beta1 * m.x[j] + h.one_minus_b1 * g.x[j];
        v.x[j] = h.beta2 * v.x[j] + h.one_minus_b2 * (g.x[j] * g.x[j]);
        const float direction = (m.x[j] / c1) / (sqrtf(v.x[j] / c2) + h.eps);
        w.x[j] = w.x[j] - rate * (direction + h.weight_decay * w.x[j]);
      }
    }
    Store<W>(t.ptr[4][k], i, w);
    Store<W>(t.ptr[5][k], i, m);
    Store<W>(t.ptr[6][k], i, v);
  });
}

// slots: 0 the float32 input, 1 the float16 output
static_assert(kVec == 8, "CastKernel stores a vector step as one uint4 of 8 float16");
__global__ void __launch_bounds__(kThreads) CastKernel(const __grid_constant__ Table<2> t) {
  ForEach(t, [&](auto width, int k, int64_t i) {
    constexpr int W = decltype(width)::value;
    const Vec<W> x = Load<W>(t.ptr[0][k], i);
    __half* out = static_cast<__half*>(const_cast<void*>(t.ptr[1][k])) + i;
    if constexpr (W == 1) {
      *out = __float2half_rn(x.x[0]);
    } else {
      uint4 raw;
      __half2* pairs = reinterpret_cast<__half2*>(&raw);
#pragma unroll
      for (int q = 0; q < 4; ++q) pairs[q] = __floats2half2_rn(x.x[2 * q], x.x[2 * q + 1]);
      *reinterpret_cast<uint4*>(out) = raw;  // kVec == 8 halves: one 16-byte store
    }
  });
}

}  // namespace

void MultiTensorCastCuda(const CastArgs& args, void* stream_handle) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  Grads inputs;  // what Fill reads: the sizes, float32 data
  inputs.data.assign(args.in.begin(), args.in.end());
  inputs.half.assign(args.in.size(), 0);
  inputs.size = args.size;
  Table<2> table;
  size_t next = 0;
  do {
    next = Fill(table, inputs, next, [&](size_t k, int p) -> const void* {
      return p == 0 ? static_cast<const void*>(args.in[k]) : static_cast<const void*>(args.out[k]);
    });
    CastKernel<<<GridFor(table.tiles), kThreads, 0, stream>>>(table);
    CudaCheck(cudaGetLastError(), "MultiTensorCast launch");
  } while (next < inputs.count());
}

void UnscaleCheckFiniteCuda(const UnscaleArgs& args, void* stream_handle) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  CudaCheck(cudaMemsetAsync(args.found_inf, 0, sizeof(bool), stream), "cudaMemsetAsync(found_inf)");
  Table<2> table;
  size_t next = 0;
  do {
    const bool write = !args.out.empty();
    next = Fill(table, args.grads, next, [&](size_t k, int p) -> const void* {
      return p == 0 ? args.grads.data[k] : (write ? args.out[k] : nullptr);
    });
    if (write) {
      UnscaleKernel<true><<<GridFor(table.tiles), kThreads, 0, stream>>>(table, args.inv_scale, args.found_inf);
    } else {
      UnscaleKernel<false><<<GridFor(table.tiles), kThreads, 0, stream>>>(table, nullptr, args.found_inf);
    }
    CudaCheck(cudaGetLastError(), "UnscaleCheckFinite launch");
  } while (next < args.grads.count());
}

void MultiTensorSgdCuda(const SgdArgs& args, void* stream_handle) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const bool has_velocity = !args.v.empty();
  Table<5> table;
  size_t next = 0;
  do {
    next = Fill(table, args.grads, next, [&](size_t k, int p) -> const void* {
      switch (p) {
        case 0: return args.grads.data[k];
        case 1: return args.w[k];
        case 2: return has_velocity ? args.v[k] : nullptr;
        case 3: return args.w_out[k];
        default: return has_velocity ? args.v_out[k] : nullptr;
      }
    });
    SgdKernel<<<GridFor(table.tiles), kThreads, 0, stream>>>(table, args.lr, args.found_inf.data, args.found_inf.is_float,
                                                             args.momentum, has_velocity, args.inv_scale);
    CudaCheck(cudaGetLastError(), "MultiTensorSGD launch");
  } while (next < args.grads.count());
}

void MultiTensorAdamWCuda(const AdamWArgs& args, void* stream_handle) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const AdamWHyper hyper{args.beta1, args.beta2, static_cast<float>(1.0 - static_cast<double>(args.beta1)),
                         static_cast<float>(1.0 - static_cast<double>(args.beta2)), args.eps, args.weight_decay};
  Table<7> table;
  size_t next = 0;
  do {
    next = Fill(table, args.grads, next, [&](size_t k, int p) -> const void* {
      const void* slots[7] = {args.grads.data[k], args.w[k], args.m[k], args.v[k], args.w_out[k], args.m_out[k], args.v_out[k]};
      return slots[p];
    });
    AdamWKernel<<<GridFor(table.tiles), kThreads, 0, stream>>>(table, args.lr, args.step, args.step_out, args.found_inf.data,
                                                               args.found_inf.is_float, hyper, args.inv_scale);
    CudaCheck(cudaGetLastError(), "MultiTensorAdamW launch");
  } while (next < args.grads.count());
}

}  // namespace onnxcampo
