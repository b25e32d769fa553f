// The tree tile kernel's reduction, shared by the SIMD kernels (avg_matmul_avx2.cc,
// avg_matmul_neon.cc); each supplies its registers as a struct `Isa` (in an anonymous namespace,
// so that this code is instantiated, and compiled with that file's ISA flags, in that file only):
//
//   Tile                          kRows x kCols uint16 values in registers
//   Leaf(a, lda, b, k, out)       out = the products a[r][k] * b[k][j] of leaf k, as stored
//   Node(left, right, out)        out = the tree node of two sibling subtrees' roots
//   Load(slot, out), Store(slot, value)   a root from / to a stack slot (32-byte aligned)
//   Value(root)                   the stored root's value (the node's floor average)
//
// Leaves are reduced 2^kChunkDepth at a time in registers (a subtree), higher levels in a small
// stack in L1 (stack[l]: the root of a finished subtree of 2^l leaves awaiting its right
// sibling, a binary counter as in TreeTileScalar).
#pragma once

#include <cstdint>

#include "avg_matmul.h"

namespace onnxcampo {
namespace tree {

constexpr int kChunkDepth = 3;  // leaves reduced in registers: 2^3

using Slot = uint16_t[kRows][kCols];

// out = the root of the 2^L leaves k .. k + 2^L - 1.
template <typename Isa, int L>
inline __attribute__((always_inline)) void Subtree(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k,
                                                   typename Isa::Tile& out) {
  if constexpr (L == 0) {
    Isa::Leaf(a, lda, b, k, out);
  } else {
    typename Isa::Tile left, right;
    Subtree<Isa, L - 1>(a, lda, b, k, left);
    Subtree<Isa, L - 1>(a, lda, b, k + (int64_t{1} << (L - 1)), right);
    Isa::Node(left, right, out);
  }
}

// The last K - k < 2^(L+1) leaves: subtrees of 2^L, 2^(L-1), ..., 1 leaves, largest first (the
// binary digits of K - k), each stored at its level.
template <typename Isa, int L>
inline __attribute__((always_inline)) void TailSubtrees(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t K,
                                                        int64_t k, Slot* stack, uint64_t* occupied) {
  if (K - k >= (int64_t{1} << L)) {
    typename Isa::Tile value;
    Subtree<Isa, L>(a, lda, b, k, value);
    Isa::Store(stack[L], value);
    *occupied |= uint64_t{1} << L;
    k += int64_t{1} << L;
  }
  if constexpr (L > 0) TailSubtrees<Isa, L - 1>(a, lda, b, K, k, stack, occupied);
}

// TreeTileScalar's sums, 2^kChunkDepth leaves at a time.
template <typename Isa>
inline __attribute__((always_inline)) void TreeTile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t K,
                                                    int64_t* s) {
  alignas(32) Slot stack[64];
  uint64_t occupied = 0;
  int64_t k = 0;
  for (; k + (1 << kChunkDepth) <= K; k += 1 << kChunkDepth) {
    typename Isa::Tile value;
    Subtree<Isa, kChunkDepth>(a, lda, b, k, value);
    int level = kChunkDepth;
    while ((occupied >> level) & 1) {
      typename Isa::Tile left;
      Isa::Load(stack[level], left);
      Isa::Node(left, value, value);
      occupied &= ~(uint64_t{1} << level);
      ++level;
    }
    Isa::Store(stack[level], value);
    occupied |= uint64_t{1} << level;
  }
  TailSubtrees<Isa, kChunkDepth - 1>(a, lda, b, K, k, stack, &occupied);
  for (int i = 0; i < kRows * kCols; ++i) s[i] = 0;
  for (int level = 0; level < 64; ++level) {
    if (!((occupied >> level) & 1)) continue;
    for (int r = 0; r < kRows; ++r) {
      for (int j = 0; j < kCols; ++j) s[r * kCols + j] += Isa::Value(stack[level][r][j]) << level;
    }
  }
}

}  // namespace tree
}  // namespace onnxcampo
