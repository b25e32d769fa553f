// 8-bit matmul driver: packs A and B, picks the ISA kernel at run time, runs tiles (on the
// runtime's thread pool when given one) and applies the exact zero-point terms. Also the
// portable scalar tile kernels: the fallback, and the plain statement of the arithmetic.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "avg_matmul.h"

namespace onnxcampo {

// ---- scalar tiles -------------------------------------------------------------------------

void TreeTileScalar(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t K, int64_t* s) {
  // Leaves enter one at a time; stack[l] holds the root of a finished subtree of 2^l leaves
  // until its right sibling arrives (a binary counter), so the subtrees left at the end are
  // K's binary digits over consecutive leaves, largest first.
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kCols; ++j) {
      uint32_t stack[64];
      uint64_t occupied = 0;
      for (int64_t k = 0; k < K; ++k) {
        uint32_t value = static_cast<uint32_t>(a[r * lda + k]) * b[k * kCols + j];  // <= 65025
        int level = 0;
        while ((occupied >> level) & 1) {
          value = (stack[level] + value) >> 1;  // floor((x + y) / 2), 17 bits in a uint32
          occupied &= ~(uint64_t{1} << level);
          ++level;
        }
        stack[level] = value;
        occupied |= uint64_t{1} << level;
      }
      int64_t sum = 0;
      for (int level = 0; level < 64; ++level) {
        if ((occupied >> level) & 1) sum += static_cast<int64_t>(stack[level]) << level;
      }
      s[r * kCols + j] = sum;
    }
  }
}

void ExactTileScalar(const uint32_t* a, int64_t lda, const int16_t* b, int64_t K, int64_t* s) {
  const int64_t pairs = (K + 1) / 2;
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kCols; ++j) {
      int32_t sum = 0;
      for (int64_t t = 0; t < pairs; ++t) {
        const uint32_t pair = a[r * lda + t];
        sum += static_cast<int32_t>(pair & 0xffff) * b[t * 2 * kCols + 2 * j] +
               static_cast<int32_t>(pair >> 16) * b[t * 2 * kCols + 2 * j + 1];
      }
      s[r * kCols + j] = sum;
    }
  }
}

// ---- dispatch -----------------------------------------------------------------------------

namespace {

enum class Isa { kScalar, kAvx2, kNeon };

Isa DetectIsa() {
  const char* forced = std::getenv("ONNXCAMPO_AVG_MATMUL_SCALAR");
  if (forced != nullptr && std::strcmp(forced, "") != 0 && std::strcmp(forced, "0") != 0) return Isa::kScalar;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) return Isa::kAvx2;
#elif defined(__ARM_NEON) && defined(__aarch64__)
  return Isa::kNeon;  // every AArch64 core has Advanced SIMD
#endif
  return Isa::kScalar;
}

Isa CurrentIsa() {
  static const Isa isa = DetectIsa();
  return isa;
}

using TreeTileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t*);
using ExactTileFn = void (*)(const uint32_t*, int64_t, const int16_t*, int64_t, int64_t*);

TreeTileFn TreeTile() {
  switch (CurrentIsa()) {
#if defined(__x86_64__) || defined(__i386__)
    case Isa::kAvx2: return TreeTileAvx2;
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
    case Isa::kNeon: return TreeTileNeon;
#endif
    default: return TreeTileScalar;
  }
}

ExactTileFn ExactTile() {
  switch (CurrentIsa()) {
#if defined(__x86_64__) || defined(__i386__)
    case Isa::kAvx2: return ExactTileAvx2;
#endif
#if defined(__ARM_NEON) && defined(__aarch64__)
    case Isa::kNeon: return ExactTileNeon;
#endif
    default: return ExactTileScalar;
  }
}

int64_t ZeroPoint(const uint8_t* values, int64_t count, int64_t index) {
  if (count == 0) return 0;
  return values[count == 1 ? 0 : index];
}

}  // namespace

const char* MatMulU8Isa() {
  switch (CurrentIsa()) {
    case Isa::kAvx2: return "avx2";
    case Isa::kNeon: return "neon";
    default: return "scalar";
  }
}

// ---- the driver ---------------------------------------------------------------------------

void MatMulU8(const MatMulU8Args& args, Accumulation mode, const ParallelRunner& run) {
  const int64_t M = args.M, K = args.K, N = args.N;
  if (M == 0 || N == 0) return;
  if (mode == Accumulation::kExact32 && K > kExact32MaxK) {
    throw std::invalid_argument("K = " + std::to_string(K) + " exceeds " + std::to_string(kExact32MaxK) +
                                ", where 32-bit accumulation of uint8 products may overflow");
  }
  const int64_t row_blocks = (M + kRows - 1) / kRows;
  const int64_t panels = (N + kCols - 1) / kCols;
  const bool tree = mode == Accumulation::kTreeAverage;

  // Packed operands. Rows past M and columns past N are zero: their sums are computed and dropped.
  const int64_t pairs = (K + 1) / 2;
  std::vector<uint16_t> a16, b16;
  std::vector<uint32_t> a32;
  std::vector<int16_t> b32;
  int64_t lda;
  if (tree) {
    lda = K;
    a16.assign(static_cast<size_t>(row_blocks * kRows * K), 0);
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t k = 0; k < K; ++k) a16[i * K + k] = args.A[i * K + k];
    }
    b16.assign(static_cast<size_t>(panels * K * kCols), 0);
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t width = std::min(N, (p + 1) * kCols) - p * kCols;
      for (int64_t k = 0; k < K; ++k) {
        const uint8_t* row = args.B + k * N + p * kCols;
        uint16_t* out = b16.data() + (p * K + k) * kCols;
        for (int64_t c = 0; c < width; ++c) out[c] = row[c];
      }
    }
  } else {
    lda = pairs;
    a32.assign(static_cast<size_t>(row_blocks * kRows * pairs), 0);
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t k = 0; k < K; ++k) a32[i * pairs + k / 2] |= static_cast<uint32_t>(args.A[i * K + k]) << (16 * (k % 2));
    }
    b32.assign(static_cast<size_t>(panels * pairs * 2 * kCols), 0);
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t width = std::min(N, (p + 1) * kCols) - p * kCols;
      for (int64_t t = 0; t < pairs; ++t) {
        const uint8_t* even = args.B + 2 * t * N + p * kCols;
        const uint8_t* odd = 2 * t + 1 < K ? even + N : nullptr;
        int16_t* out = b32.data() + (p * pairs + t) * 2 * kCols;
        for (int64_t c = 0; c < width; ++c) {
          out[2 * c] = even[c];
          out[2 * c + 1] = odd != nullptr ? odd[c] : 0;
        }
      }
    }
  }

  // Exact zero-point terms: sum(a*b) - zb*sum(a) - za*sum(b) + K*za*zb.
  std::vector<int64_t> row_sums(static_cast<size_t>(M), 0), col_sums(static_cast<size_t>(N), 0);
  if (args.zb_count) {
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t k = 0; k < K; ++k) row_sums[i] += args.A[i * K + k];
    }
  }
  if (args.za_count) {
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t j = 0; j < N; ++j) col_sums[j] += args.B[k * N + j];
    }
  }

  const TreeTileFn tree_tile = TreeTile();
  const ExactTileFn exact_tile = ExactTile();
  auto task = [&](size_t index) {
    // Panel-major: consecutive tiles reuse one panel of B (K x 32 columns) from cache.
    const int64_t panel = static_cast<int64_t>(index) / row_blocks;
    const int64_t block = static_cast<int64_t>(index) % row_blocks;
    int64_t s[kRows * kCols];
    if (tree) {
      tree_tile(a16.data() + block * kRows * lda, lda, b16.data() + panel * K * kCols, K, s);
    } else {
      exact_tile(a32.data() + block * kRows * lda, lda, b32.data() + panel * pairs * 2 * kCols, K, s);
    }
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = block * kRows + r;
      if (i >= M) break;
      const int64_t za = ZeroPoint(args.za, args.za_count, i);
      for (int64_t c = 0; c < kCols; ++c) {
        const int64_t j = panel * kCols + c;
        if (j >= N) break;
        const int64_t zb = ZeroPoint(args.zb, args.zb_count, j);
        const int64_t value = s[r * kCols + c] - zb * row_sums[i] - za * col_sums[j] + K * za * zb;
        args.Y[i * N + j] = static_cast<float>(value);
      }
    }
  };
  run(static_cast<size_t>(row_blocks * panels), task);
}

}  // namespace onnxcampo
