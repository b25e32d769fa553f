// BatchNormStats' and BatchNormGradSums' CUDA kernels (batch_norm.h has the arithmetic).
//
// Memory-bound, one read of every input element. A call is cut into S splits of the P axis; each
// block covers one channel (R > 1, the row kernel: x[p][q][0..R) contiguous, 256 threads taking
// the elements of its p range in order) or 32 channels (R == 1, the column kernel: 32 x 8 threads,
// thread (i, j) adding rows j, j + 8, ... of channel 32 * bx + i); a block merges its threads' states
// in a fixed tree. With S == 1 the block writes the outputs; else it writes its state to a float32
// workspace [S, Q, 3] that a finishing kernel merges per channel in split order. Deterministic:
// no atomics, every merge order fixed by the shape and S.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <stdexcept>

#include "batch_norm.h"
#include "cuda_util.h"

namespace onnxcampo {
namespace {

constexpr int kRowThreads = 256;
constexpr int kColumns = 32, kColumnRows = 8;

template <typename T>
__device__ __forceinline__ float Load(const void* p, int64_t i) {
  if constexpr (sizeof(T) == 2) {
    return __half2float(static_cast<const __half*>(p)[i]);
  } else {
    return static_cast<const float*>(p)[i];
  }
}

// BatchNormStats' state: Welford's count, mean and sum of squared deviations.
struct Moments {
  float n, mean, m2;
  __device__ static Moments Zero() { return {0.0f, 0.0f, 0.0f}; }
  template <typename TA, typename TB>
  __device__ void Add(const ChannelSumsArgs& a, int64_t i) {
    const float x = Load<TA>(a.a, i);
    n += 1.0f;
    const float d = x - mean;
    mean += d / n;
    m2 += d * (x - mean);
  }
  // Chan et al.'s pairwise update: this, then `o`.
  __device__ void Merge(const Moments& o) {
    const float total = n + o.n;
    if (o.n == 0.0f) return;
    if (n == 0.0f) {
      *this = o;
      return;
    }
    const float d = o.mean - mean, w = o.n / total;
    m2 += o.m2 + d * d * n * w;
    mean += d * w;
    n = total;
  }
  __device__ void Write(const ChannelSumsArgs& a, int64_t q) const {
    a.out0[q] = mean * n;
    a.out1[q] = m2;
  }
};

// BatchNormGradSums' state: the sums of dy and of dy * c (the third float unused).
struct Sums {
  float dy, dy_c, unused;
  __device__ static Sums Zero() { return {0.0f, 0.0f, 0.0f}; }
  template <typename TA, typename TB>
  __device__ void Add(const ChannelSumsArgs& a, int64_t i) {
    const float g = Load<TA>(a.a, i);
    dy += g;
    dy_c += g * Load<TB>(a.b, i);
  }
  __device__ void Merge(const Sums& o) {
    dy += o.dy;
    dy_c += o.dy_c;
  }
  __device__ void Write(const ChannelSumsArgs& a, int64_t q) const {
    a.out0[q] = dy;
    a.out1[q] = dy_c * a.scale[q];
  }
};

static_assert(sizeof(Moments) == 3 * sizeof(float) && sizeof(Sums) == 3 * sizeof(float), "three floats a state");

// The state goes to the outputs (one split) or to the workspace.
template <typename State>
__device__ __forceinline__ void Finish(const ChannelSumsArgs& a, float* partial, int64_t split, int64_t q, const State& s) {
  if (partial == nullptr) {
    s.Write(a, q);
  } else {
    reinterpret_cast<State*>(partial)[split * a.Q + q] = s;
  }
}

// R > 1: grid (Q, S), kRowThreads threads; block (q, s) takes rows p of [s*rows, (s+1)*rows).
template <typename State, typename TA, typename TB>
__global__ void __launch_bounds__(kRowThreads) RowKernel(ChannelSumsArgs a, float* partial, int64_t rows) {
  __shared__ State states[kRowThreads];
  const int64_t q = blockIdx.x, split = blockIdx.y;
  const int64_t p0 = split * rows, p1 = min(a.P, p0 + rows);
  const int64_t count = p1 > p0 ? (p1 - p0) * a.R : 0;
  State s = State::Zero();
  if (count < (int64_t{1} << 31)) {  // 32-bit division by R: a 64-bit one would cost more than the load
    const unsigned rlen = static_cast<unsigned>(a.R), total = static_cast<unsigned>(count);
    for (unsigned i = threadIdx.x; i < total; i += kRowThreads) {
      const int64_t p = p0 + i / rlen, r = i % rlen;
      s.template Add<TA, TB>(a, (p * a.Q + q) * a.R + r);
    }
  } else {
    for (int64_t i = threadIdx.x; i < count; i += kRowThreads) {
      const int64_t p = p0 + i / a.R, r = i % a.R;
      s.template Add<TA, TB>(a, (p * a.Q + q) * a.R + r);
    }
  }
  states[threadIdx.x] = s;
  __syncthreads();
  for (int stride = kRowThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) states[threadIdx.x].Merge(states[threadIdx.x + stride]);
    __syncthreads();
  }
  if (threadIdx.x == 0) Finish(a, partial, split, q, states[0]);
}

// R == 1: grid (ceil(Q / 32), S), 32 x 8 threads; thread (i, j) of block (bx, s) adds rows
// s*rows + j, + 8, ... of channel 32 * bx + i; then thread (i, 0) merges j = 0..7 in order.
template <typename State, typename TA, typename TB>
__global__ void __launch_bounds__(kColumns * kColumnRows) ColumnKernel(ChannelSumsArgs a, float* partial, int64_t rows) {
  __shared__ State states[kColumnRows][kColumns];
  const int64_t q = static_cast<int64_t>(blockIdx.x) * kColumns + threadIdx.x, split = blockIdx.y;
  const int64_t p0 = split * rows, p1 = min(a.P, p0 + rows);
  State s = State::Zero();
  if (q < a.Q) {
    for (int64_t p = p0 + threadIdx.y; p < p1; p += kColumnRows) s.template Add<TA, TB>(a, p * a.Q + q);
  }
  states[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && q < a.Q) {
    State total = states[0][threadIdx.x];
    for (int j = 1; j < kColumnRows; ++j) total.Merge(states[j][threadIdx.x]);
    Finish(a, partial, split, q, total);
  }
}

// The splits' states merged per channel in split order, then written.
template <typename State>
__global__ void __launch_bounds__(256) FinishKernel(ChannelSumsArgs a, const float* partial, int64_t splits) {
  const int64_t q = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (q >= a.Q) return;
  const State* states = reinterpret_cast<const State*>(partial);
  State total = states[q];
  for (int64_t s = 1; s < splits; ++s) total.Merge(states[s * a.Q + q]);
  total.Write(a, q);
}

// How a call is cut: S splits of `rows` rows of P each.
struct Split {
  int64_t splits = 1, rows = 0;
};

Split PlanSplit(const ChannelSumsArgs& a, int sms, bool workspace) {
  Split plan;
  plan.rows = std::max<int64_t>(a.P, 1);
  if (!workspace || a.P <= 1) return plan;
  const int64_t target = 4 * int64_t{std::max(sms, 1)};  // blocks wanted
  int64_t wanted, most;
  if (a.R > 1) {
    wanted = (target + a.Q - 1) / a.Q;
    most = std::max<int64_t>(1, a.P * a.R / 4096);  // >= 4096 elements a block
  } else {
    const int64_t blocks_x = (a.Q + kColumns - 1) / kColumns;
    wanted = (target + blocks_x - 1) / blocks_x;
    most = std::max<int64_t>(1, a.P / (8 * kColumnRows));  // >= 8 rows a thread
  }
  const int64_t splits = std::max<int64_t>(1, std::min({wanted, most, a.P, int64_t{65535}}));
  plan.rows = (a.P + splits - 1) / splits;
  plan.splits = (a.P + plan.rows - 1) / plan.rows;
  return plan;
}

template <typename State, typename TA, typename TB>
void Launch(const ChannelSumsArgs& a, const Split& plan, float* workspace, cudaStream_t stream) {
  float* partial = plan.splits > 1 ? workspace : nullptr;
  if (a.R > 1) {
    if (a.Q > INT_MAX) throw std::runtime_error("too many channels for one launch");
    RowKernel<State, TA, TB><<<dim3(static_cast<unsigned>(a.Q), static_cast<unsigned>(plan.splits)), kRowThreads, 0,
                               stream>>>(a, partial, plan.rows);
  } else {
    const int64_t blocks_x = (a.Q + kColumns - 1) / kColumns;
    ColumnKernel<State, TA, TB><<<dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(plan.splits)),
                                  dim3(kColumns, kColumnRows), 0, stream>>>(a, partial, plan.rows);
  }
  CudaCheck(cudaGetLastError(), "channel sums launch");
  if (partial == nullptr) return;
  FinishKernel<State><<<static_cast<unsigned>((a.Q + 255) / 256), 256, 0, stream>>>(a, partial, plan.splits);
  CudaCheck(cudaGetLastError(), "channel sums finishing launch");
}

template <typename State, typename TA>
void LaunchFor(const ChannelSumsArgs& a, const Split& plan, float* workspace, cudaStream_t stream) {
  if (a.b_half) {
    Launch<State, TA, __half>(a, plan, workspace, stream);
  } else {
    Launch<State, TA, float>(a, plan, workspace, stream);
  }
}

template <typename State>
void Run(const ChannelSumsArgs& a, void* workspace, void* stream_handle) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  if (a.Q <= 0) return;
  if (a.P <= 0 || a.R <= 0) {  // nothing to add: zeros
    CudaCheck(cudaMemsetAsync(a.out0, 0, static_cast<size_t>(a.Q) * sizeof(float), stream), "cudaMemsetAsync");
    CudaCheck(cudaMemsetAsync(a.out1, 0, static_cast<size_t>(a.Q) * sizeof(float), stream), "cudaMemsetAsync");
    return;
  }
  const Split plan = PlanSplit(a, MultiprocessorCount(), workspace != nullptr);
  if (a.a_half) {
    LaunchFor<State, __half>(a, plan, static_cast<float*>(workspace), stream);
  } else {
    LaunchFor<State, float>(a, plan, static_cast<float*>(workspace), stream);
  }
}

}  // namespace

size_t ChannelSumsWorkspaceBytes(const ChannelSumsArgs& a) {
  if (a.Q <= 0 || a.P <= 0 || a.R <= 0) return 0;
  const Split plan = PlanSplit(a, MultiprocessorCount(), true);
  return plan.splits > 1 ? static_cast<size_t>(plan.splits * a.Q) * 3 * sizeof(float) : 0;
}

void BatchNormStatsCuda(const ChannelSumsArgs& a, void* workspace, void* stream) {
  ChannelSumsArgs stats = a;
  stats.b_half = false;  // no second input
  Run<Moments>(stats, workspace, stream);
}

void BatchNormGradSumsCuda(const ChannelSumsArgs& a, void* workspace, void* stream) { Run<Sums>(a, workspace, stream); }

}  // namespace onnxcampo
