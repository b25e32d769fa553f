// Im2Col on CUDA (im2col.h has the layout): one thread per output element, grid-stride loop over
// the flat output index, so consecutive threads write consecutive columns (along ow, then oh, n)
// of one row: coalesced stores, and loads that step by the stride along one input row. Values
// move as raw 2- or 4-byte words (no arithmetic). The flat index is split into (row, n, oh, ow)
// and the row into (c, i, j) by multiply-shift division by invariant integers (FastDivmod) when
// the output and the input have fewer than 2^31 elements (every ResNet-class layer); larger
// calls take an int64 kernel with plain division.
//
// One launch on ORT's compute stream; no allocation, no memcpy, no synchronisation, so the node
// can be captured in a CUDA graph.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda_util.h"
#include "im2col.h"

namespace onnxcampo {
namespace {

constexpr int kThreads = 256;

// n / d and n % d for 0 <= n < 2^31 and 1 <= d < 2^31 (Granlund-Montgomery; ORT's fast_divmod).
struct FastDivmod {
  uint32_t d = 1, m = 1, s = 0;
  FastDivmod() = default;
  explicit FastDivmod(uint32_t divisor) : d(divisor) {
    while (s < 32 && (uint32_t{1} << s) < d) ++s;
    const uint64_t one = 1;
    m = static_cast<uint32_t>(((one << 32) * ((one << s) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t Div(uint32_t n) const { return (__umulhi(n, m) + n) >> s; }
};

struct Geometry32 {
  FastDivmod columns, wo, ho, kw, kh;  // divisors of the flat index, then of the row
  int32_t c, h, w, sh, sw, dh, dw, pt, pl;
  uint32_t total;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) Im2Col32(const T* __restrict__ x, T* __restrict__ out, const Geometry32 g) {
  for (uint32_t idx = blockIdx.x * kThreads + threadIdx.x; idx < g.total; idx += gridDim.x * kThreads) {
    const uint32_t row = g.columns.Div(idx);
    const uint32_t column = idx - row * g.columns.d;
    const uint32_t t = g.wo.Div(column);
    const int32_t ow = static_cast<int32_t>(column - t * g.wo.d);
    const uint32_t n = g.ho.Div(t);
    const int32_t oh = static_cast<int32_t>(t - n * g.ho.d);
    const uint32_t u = g.kw.Div(row);
    const int32_t j = static_cast<int32_t>(row - u * g.kw.d);
    const uint32_t c = g.kh.Div(u);
    const int32_t i = static_cast<int32_t>(u - c * g.kh.d);
    const int32_t h = oh * g.sh + i * g.dh - g.pt;
    const int32_t w = ow * g.sw + j * g.dw - g.pl;
    T value = 0;
    if (static_cast<uint32_t>(h) < static_cast<uint32_t>(g.h) && static_cast<uint32_t>(w) < static_cast<uint32_t>(g.w)) {
      value = x[((n * g.c + c) * g.h + h) * g.w + w];
    }
    out[idx] = value;
  }
}

struct Geometry64 {
  int64_t columns, wo, ho, kw, kh, c, h, w, sh, sw, dh, dw, pt, pl, total;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) Im2Col64(const T* __restrict__ x, T* __restrict__ out, const Geometry64 g) {
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; idx < g.total;
       idx += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = idx / g.columns, column = idx % g.columns;
    const int64_t ow = column % g.wo, oh = (column / g.wo) % g.ho, n = column / (g.wo * g.ho);
    const int64_t j = row % g.kw, i = (row / g.kw) % g.kh, c = row / (g.kw * g.kh);
    const int64_t h = oh * g.sh + i * g.dh - g.pt;
    const int64_t w = ow * g.sw + j * g.dw - g.pl;
    T value = 0;
    if (h >= 0 && h < g.h && w >= 0 && w < g.w) value = x[((n * g.c + c) * g.h + h) * g.w + w];
    out[idx] = value;
  }
}

int BlocksFor(int64_t total) {
  const int most = MultiprocessorCount() * (2048 / kThreads);  // one wave of resident blocks; the grid-stride loop does the rest
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(most, (total + kThreads - 1) / kThreads)));
}

template <typename T>
void Launch(const Im2ColArgs& g, cudaStream_t stream) {
  const Im2ColAttrs& a = g.a;
  const int64_t rows = g.c * a.kh * a.kw, columns = g.n * g.ho * g.wo;
  const int64_t total = rows * columns;
  if (total == 0) return;
  const int blocks = BlocksFor(total);
  const T* x = static_cast<const T*>(g.x);
  T* out = static_cast<T*>(g.columns);
  const int64_t limit = (int64_t{1} << 31) - 1;
  const int64_t inputs = g.n * g.c * g.h * g.w;
  // every int32 quantity of Im2Col32 below 2^31: the flat indices, and h, w from their parts
  const bool small = total <= limit && inputs <= limit &&
                     (g.ho - 1) * a.sh + (a.kh - 1) * a.dh <= limit && (g.wo - 1) * a.sw + (a.kw - 1) * a.dw <= limit &&
                     a.pt <= limit && a.pl <= limit;
  if (small) {
    Geometry32 q;
    q.columns = FastDivmod(static_cast<uint32_t>(columns));
    q.wo = FastDivmod(static_cast<uint32_t>(g.wo));
    q.ho = FastDivmod(static_cast<uint32_t>(g.ho));
    q.kw = FastDivmod(static_cast<uint32_t>(a.kw));
    q.kh = FastDivmod(static_cast<uint32_t>(a.kh));
    q.c = static_cast<int32_t>(g.c), q.h = static_cast<int32_t>(g.h), q.w = static_cast<int32_t>(g.w);
    q.sh = static_cast<int32_t>(a.sh), q.sw = static_cast<int32_t>(a.sw);
    q.dh = static_cast<int32_t>(a.dh), q.dw = static_cast<int32_t>(a.dw);
    q.pt = static_cast<int32_t>(a.pt), q.pl = static_cast<int32_t>(a.pl);
    q.total = static_cast<uint32_t>(total);
    Im2Col32<T><<<blocks, kThreads, 0, stream>>>(x, out, q);
  } else {
    const Geometry64 q{columns, g.wo, g.ho, a.kw, a.kh, g.c, g.h, g.w, a.sh, a.sw, a.dh, a.dw, a.pt, a.pl, total};
    Im2Col64<T><<<blocks, kThreads, 0, stream>>>(x, out, q);
  }
  CudaCheck(cudaGetLastError(), "Im2Col launch");
}

}  // namespace

void Im2ColCuda(const Im2ColArgs& args, void* stream) {
  if (args.element_size == 2) {
    Launch<uint16_t>(args, static_cast<cudaStream_t>(stream));
  } else {
    Launch<uint32_t>(args, static_cast<cudaStream_t>(stream));
  }
}

}  // namespace onnxcampo
