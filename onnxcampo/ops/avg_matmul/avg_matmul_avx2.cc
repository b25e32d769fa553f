// AVX2 tile kernels (this file alone is compiled with -mavx2; avg_matmul.cc calls it only when
// the CPU has AVX2).
//
// Tree: 16 uint16 lanes per register. _mm256_avg_epu16 rounds up ((x+y+1)>>1), the seed's
// tree rounds down; in the complement domain c = 65535 - v the two agree exactly:
//   65535 - floor((x+y)/2) = ceil(((65535-x) + (65535-y))/2) = avg_epu16(~x, ~y)
// so leaves are stored complemented (one xor after the 16-bit multiply, which is exact: a
// product of two uint8 is at most 65025) and every tree node is one avg_epu16. Leaves are
// reduced 8 at a time in registers (a depth-3 subtree), higher levels in a small stack in L1.
//
// Exact: _mm256_madd_epi16 on (a[2t], a[2t+1]) x (b[2t][j], b[2t+1][j]) gives a[2t]*b[2t][j] +
// a[2t+1]*b[2t+1][j] in 8 int32 lanes, accumulated in int32: the usual 32-bit accumulation,
// the same tile (2 rows x 32 columns) and the same packed-panel loop.
#include <immintrin.h>

#include "avg_matmul.h"

namespace onnxcampo {
namespace {

constexpr int kVecs = kCols / 16;  // uint16 registers per tile row
constexpr int kChunkDepth = 3;      // leaves reduced in registers: 2^3 (the tail below assumes 3)

static_assert(kChunkDepth == 3, "TreeTileAvx2's tail handles subtrees of 4, 2 and 1 leaves");

using Tile = __m256i[kRows][kVecs];

template <int L>
__attribute__((always_inline)) inline void Subtree(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k,
                                                   Tile& out) {
  if constexpr (L == 0) {
    const __m256i ones = _mm256_set1_epi32(-1);
    __m256i bv[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      bv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + k * kCols + 16 * v));
    }
    for (int r = 0; r < kRows; ++r) {
      const __m256i av = _mm256_set1_epi16(static_cast<short>(a[r * lda + k]));
      for (int v = 0; v < kVecs; ++v) out[r][v] = _mm256_xor_si256(_mm256_mullo_epi16(av, bv[v]), ones);
    }
  } else {
    Tile left, right;
    Subtree<L - 1>(a, lda, b, k, left);
    Subtree<L - 1>(a, lda, b, k + (int64_t{1} << (L - 1)), right);
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kVecs; ++v) out[r][v] = _mm256_avg_epu16(left[r][v], right[r][v]);
    }
  }
}

void Store(uint16_t (*slot)[kCols], const Tile& value) {
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) _mm256_store_si256(reinterpret_cast<__m256i*>(slot[r] + 16 * v), value[r][v]);
  }
}

}  // namespace

void TreeTileAvx2(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t K, int64_t* s) {
  // stack[l]: the complemented root of the subtree of 2^l leaves waiting for its right sibling
  alignas(32) uint16_t stack[64][kRows][kCols];
  uint64_t occupied = 0;
  int64_t k = 0;
  for (; k + (1 << kChunkDepth) <= K; k += 1 << kChunkDepth) {
    Tile value;
    Subtree<kChunkDepth>(a, lda, b, k, value);
    int level = kChunkDepth;
    while ((occupied >> level) & 1) {
      for (int r = 0; r < kRows; ++r) {
        for (int v = 0; v < kVecs; ++v) {
          const __m256i left = _mm256_load_si256(reinterpret_cast<const __m256i*>(stack[level][r] + 16 * v));
          value[r][v] = _mm256_avg_epu16(left, value[r][v]);
        }
      }
      occupied &= ~(uint64_t{1} << level);
      ++level;
    }
    Store(stack[level], value);
    occupied |= uint64_t{1} << level;
  }
  // The last K mod 8 leaves: subtrees of 4, 2, 1 leaves, largest first (K's binary digits).
  if (K - k >= 4) {
    Tile value;
    Subtree<2>(a, lda, b, k, value);
    Store(stack[2], value);
    occupied |= 4;
    k += 4;
  }
  if (K - k >= 2) {
    Tile value;
    Subtree<1>(a, lda, b, k, value);
    Store(stack[1], value);
    occupied |= 2;
    k += 2;
  }
  if (K - k >= 1) {
    Tile value;
    Subtree<0>(a, lda, b, k, value);
    Store(stack[0], value);
    occupied |= 1;
  }
  for (int i = 0; i < kRows * kCols; ++i) s[i] = 0;
  for (int level = 0; level < 64; ++level) {
    if (!((occupied >> level) & 1)) continue;
    for (int r = 0; r < kRows; ++r) {
      for (int j = 0; j < kCols; ++j) s[r * kCols + j] += static_cast<int64_t>(65535 - stack[level][r][j]) << level;
    }
  }
}

void ExactTileAvx2(const uint32_t* a, int64_t lda, const int16_t* b, int64_t K, int64_t* s) {
  constexpr int kLanes = kCols / 8;  // int32 registers per tile row
  __m256i acc[kRows][kLanes];
  for (int r = 0; r < kRows; ++r) {
    for (int q = 0; q < kLanes; ++q) acc[r][q] = _mm256_setzero_si256();
  }
  const int64_t pairs = (K + 1) / 2;
  for (int64_t t = 0; t < pairs; ++t) {
    __m256i bv[kLanes];
    for (int q = 0; q < kLanes; ++q) {
      bv[q] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + t * 2 * kCols + 16 * q));
    }
    for (int r = 0; r < kRows; ++r) {
      const __m256i av = _mm256_set1_epi32(static_cast<int>(a[r * lda + t]));
      for (int q = 0; q < kLanes; ++q) acc[r][q] = _mm256_add_epi32(acc[r][q], _mm256_madd_epi16(av, bv[q]));
    }
  }
  alignas(32) int32_t lanes[8];
  for (int r = 0; r < kRows; ++r) {
    for (int q = 0; q < kLanes; ++q) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[r][q]);
      for (int l = 0; l < 8; ++l) s[r * kCols + 8 * q + l] = lanes[l];
    }
  }
}

}  // namespace onnxcampo
