// AVX2 tile kernels (this file alone is compiled with -mavx2; avg_matmul.cc calls it only when
// the CPU has AVX2).
//
// Tree: 16 uint16 lanes per register. _mm256_avg_epu16 rounds up ((x+y+1)>>1), the seed's
// tree rounds down; in the complement domain c = 65535 - v the two agree exactly:
//   65535 - floor((x+y)/2) = ceil(((65535-x) + (65535-y))/2) = avg_epu16(~x, ~y)
// so leaves are stored complemented (one xor after the 16-bit multiply, which is exact: a
// product of two uint8 is at most 65025) and every tree node is one avg_epu16. Leaves are
// reduced 8 at a time in registers (a depth-3 subtree), higher levels in a small stack in L1
// (avg_matmul_tree.h, the code the NEON kernel shares).
//
// Exact: _mm256_madd_epi16 on (a[2t], a[2t+1]) x (b[2t][j], b[2t+1][j]) gives a[2t]*b[2t][j] +
// a[2t+1]*b[2t+1][j] in 8 int32 lanes, accumulated in int32: the usual 32-bit accumulation,
// the same tile (2 rows x 32 columns) and the same packed-panel loop.
#include <immintrin.h>

#include "avg_matmul.h"
#include "avg_matmul_tree.h"

namespace onnxcampo {
namespace {

constexpr int kVecs = kCols / 16;  // uint16 registers per tile row

// The tree's registers (avg_matmul_tree.h): complemented leaves, avg_epu16 nodes.
struct Avx2 {
  using Tile = __m256i[kRows][kVecs];

  static void Leaf(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k, Tile& out) {
    const __m256i ones = _mm256_set1_epi32(-1);
    __m256i bv[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      bv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + k * kCols + 16 * v));
    }
    for (int r = 0; r < kRows; ++r) {
      const __m256i av = _mm256_set1_epi16(static_cast<short>(a[r * lda + k]));
      for (int v = 0; v < kVecs; ++v) out[r][v] = _mm256_xor_si256(_mm256_mullo_epi16(av, bv[v]), ones);
    }
  }

  static void Node(const Tile& left, const Tile& right, Tile& out) {
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kVecs; ++v) out[r][v] = _mm256_avg_epu16(left[r][v], right[r][v]);
    }
  }

  static void Load(const uint16_t (*slot)[kCols], Tile& out) {
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kVecs; ++v) out[r][v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(slot[r] + 16 * v));
    }
  }

  static void Store(uint16_t (*slot)[kCols], const Tile& value) {
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kVecs; ++v) _mm256_store_si256(reinterpret_cast<__m256i*>(slot[r] + 16 * v), value[r][v]);
    }
  }

  static int64_t Value(uint16_t root) { return 65535 - root; }  // the complement undone
};

}  // namespace

void TreeTileAvx2(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t K, int64_t* s) {
  tree::TreeTile<Avx2>(a, lda, b, K, s);
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
