// ARM NEON tile kernels, compiled on AArch64 only (the seed's target). 8 uint16 lanes per register;
// vhaddq_u16 is the seed's node exactly (floor((x+y)/2), no overflow), vmulq_u16 the exact
// 16-bit product. Leaves are reduced 8 at a time in registers, higher levels in a stack in L1,
// as in the AVX2 kernel. The exact kernel widens with vmlal_s16 (32-bit accumulation).
//
// Built with ONNXCAMPO_NEON_VIA_SIMDE, the same code compiles on x86 against SIMDe's NEON
// emulation (scripts/check_neon_simde.sh), so that it can be checked where no ARM machine is.
#if defined(ONNXCAMPO_NEON_VIA_SIMDE)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/arm/neon.h>
#define ONNXCAMPO_HAVE_NEON 1
#elif defined(__ARM_NEON) && defined(__aarch64__)  // vpaddq_s32 is AArch64
#include <arm_neon.h>
#define ONNXCAMPO_HAVE_NEON 1
#endif

#if defined(ONNXCAMPO_HAVE_NEON)

#include "avg_matmul.h"

namespace onnxcampo {
namespace {

constexpr int kVecs = kCols / 8;  // uint16x8 registers per tile row
constexpr int kChunkDepth = 3;
static_assert(kChunkDepth == 3, "TreeTileNeon's tail handles subtrees of 4, 2 and 1 leaves");

struct Tile {
  uint16x8_t v[kRows][kVecs];
};

template <int L>
inline __attribute__((always_inline)) void Subtree(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k,
                                                   Tile& out) {
  if constexpr (L == 0) {
    uint16x8_t bv[kVecs];
    for (int v = 0; v < kVecs; ++v) bv[v] = vld1q_u16(b + k * kCols + 8 * v);
    for (int r = 0; r < kRows; ++r) {
      const uint16x8_t av = vdupq_n_u16(a[r * lda + k]);
      for (int v = 0; v < kVecs; ++v) out.v[r][v] = vmulq_u16(av, bv[v]);
    }
  } else {
    Tile left, right;
    Subtree<L - 1>(a, lda, b, k, left);
    Subtree<L - 1>(a, lda, b, k + (int64_t{1} << (L - 1)), right);
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kVecs; ++v) out.v[r][v] = vhaddq_u16(left.v[r][v], right.v[r][v]);
    }
  }
}

void Store(uint16_t (*slot)[kCols], const Tile& value) {
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) vst1q_u16(slot[r] + 8 * v, value.v[r][v]);
  }
}

}  // namespace

void TreeTileNeon(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t K, int64_t* s) {
  uint16_t stack[64][kRows][kCols];  // stack[l]: root of a subtree of 2^l leaves awaiting its sibling
  uint64_t occupied = 0;
  int64_t k = 0;
  for (; k + (1 << kChunkDepth) <= K; k += 1 << kChunkDepth) {
    Tile value;
    Subtree<kChunkDepth>(a, lda, b, k, value);
    int level = kChunkDepth;
    while ((occupied >> level) & 1) {
      for (int r = 0; r < kRows; ++r) {
        for (int v = 0; v < kVecs; ++v) value.v[r][v] = vhaddq_u16(vld1q_u16(stack[level][r] + 8 * v), value.v[r][v]);
      }
      occupied &= ~(uint64_t{1} << level);
      ++level;
    }
    Store(stack[level], value);
    occupied |= uint64_t{1} << level;
  }
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
      for (int j = 0; j < kCols; ++j) s[r * kCols + j] += static_cast<int64_t>(stack[level][r][j]) << level;
    }
  }
}

void ExactTileNeon(const uint32_t* a, int64_t lda, const int16_t* b, int64_t K, int64_t* s) {
  // b row t: (b[2t][j], b[2t+1][j]) for j = 0..kCols-1; 8 int16 = 4 columns x 2 k per register.
  // Lanes of lo/hi accumulate a[2t]*b[2t][j] and a[2t+1]*b[2t+1][j] separately; one pairwise
  // add at the end gives the column sums.
  constexpr int kGroups = kCols / 4;
  int32x4_t lo[kRows][kGroups], hi[kRows][kGroups];
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < kGroups; ++g) lo[r][g] = hi[r][g] = vdupq_n_s32(0);
  }
  const int64_t pairs = (K + 1) / 2;
  for (int64_t t = 0; t < pairs; ++t) {
    for (int r = 0; r < kRows; ++r) {
      const int16x8_t av = vreinterpretq_s16_u32(vdupq_n_u32(a[r * lda + t]));
      for (int g = 0; g < kGroups; ++g) {
        const int16x8_t bv = vld1q_s16(b + t * 2 * kCols + 8 * g);
        lo[r][g] = vmlal_s16(lo[r][g], vget_low_s16(av), vget_low_s16(bv));
        hi[r][g] = vmlal_s16(hi[r][g], vget_high_s16(av), vget_high_s16(bv));
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < kGroups; ++g) {
      int32_t lanes[4];
      vst1q_s32(lanes, vpaddq_s32(lo[r][g], hi[r][g]));
      for (int l = 0; l < 4; ++l) s[r * kCols + 4 * g + l] = lanes[l];
    }
  }
}

}  // namespace onnxcampo

#endif  // ONNXCAMPO_HAVE_NEON
