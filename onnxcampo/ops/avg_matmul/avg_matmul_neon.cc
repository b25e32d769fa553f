// ARM NEON tile kernels, compiled on AArch64 only (the seed's target). 8 uint16 lanes per register;
// vhaddq_u16 is the seed's node exactly (floor((x+y)/2), no overflow), vmulq_u16 the exact
// 16-bit product. Leaves are reduced 8 at a time in registers, higher levels in a stack in L1,
// by the code the AVX2 kernel shares (avg_matmul_tree.h). The exact kernel widens with
// vmlal_s16 (32-bit accumulation).
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
#include "avg_matmul_tree.h"

namespace onnxcampo {
namespace {

constexpr int kVecs = kCols / 8;  // uint16x8 registers per tile row

// The tree's registers (avg_matmul_tree.h): the products themselves, vhaddq_u16 nodes.
struct Neon {
  struct Tile {
    uint16x8_t v[kRows][kVecs];
  };

  static void Leaf(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t k, Tile& out) {
    uint16x8_t bv[kVecs];
    for (int v = 0; v < kVecs; ++v) bv[v] = vld1q_u16(b + k * kCols + 8 * v);
    for (int r = 0; r < kRows; ++r) {
      const uint16x8_t av = vdupq_n_u16(a[r * lda + k]);
      for (int v = 0; v < kVecs; ++v) out.v[r][v] = vmulq_u16(av, bv[v]);
    }
  }

  static void Node(const Tile& left, const Tile& right, Tile& out) {
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kVecs; ++v) out.v[r][v] = vhaddq_u16(left.v[r][v], right.v[r][v]);
    }
  }

  static void Load(const uint16_t (*slot)[kCols], Tile& out) {
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kVecs; ++v) out.v[r][v] = vld1q_u16(slot[r] + 8 * v);
    }
  }

  static void Store(uint16_t (*slot)[kCols], const Tile& value) {
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kVecs; ++v) vst1q_u16(slot[r] + 8 * v, value.v[r][v]);
    }
  }

  static int64_t Value(uint16_t root) { return root; }
};

}  // namespace

void TreeTileNeon(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t K, int64_t* s) {
  tree::TreeTile<Neon>(a, lda, b, K, s);
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
