// 8-bit matrix multiplies with float32 output: the tree-averaging one of the averaging-networks
// seed (16-bit accumulator) and an exact one with 32-bit accumulation (the same tiling, for a
// fair benchmark). Free of ONNX Runtime types; docs/avg-matmul.md states the arithmetic.
//
// Y[i][j] = float32(S[i][j] - zb[j]*rowsum_A[i] - za[i]*colsum_B[j] + K*za[i]*zb[j])
//
// where S is the sum over k of the raw uint8 products A[i][k]*B[k][j] (exact, or approximated
// by pairwise floor-averaging along a tree) and the zero-point terms are exact integers.
#pragma once

#include <cstdint>

#include "parallel.h"  // ParallelRunner: how tiles are run (serially, or by the runtime's thread pool)

namespace onnxcampo {

enum class Accumulation { kTreeAverage, kExact32 };

struct MatMulU8Args {
  int64_t M = 0, K = 0, N = 0;
  const uint8_t* A = nullptr;   // M x K, row-major
  const uint8_t* B = nullptr;   // K x N, row-major
  const uint8_t* za = nullptr;  // nullptr (0), one value, or M values (per row of A)
  int64_t za_count = 0;
  const uint8_t* zb = nullptr;  // nullptr (0), one value, or N values (per column of B)
  int64_t zb_count = 0;
  float* Y = nullptr;           // M x N
};

// Largest K for Accumulation::kExact32: K * 255 * 255 must fit in int32.
constexpr int64_t kExact32MaxK = 33025;

// Which kernel runs: "avx2", "neon" or "scalar" (the portable fallback, also chosen by
// $ONNXCAMPO_AVG_MATMUL_SCALAR=1 when the library loads, for tests of the dispatch).
const char* MatMulU8Isa();

void MatMulU8(const MatMulU8Args& args, Accumulation mode, const ParallelRunner& run);

// ---- ISA-specific tile kernels (internal) -------------------------------------------------
// A tile is kRows rows x kCols columns of S. `a` holds kRows rows of A widened to uint16
// (row stride lda); `b` is a packed column panel: for the tree, K rows of kCols uint16; for the
// exact kernel, ceil(K/2) rows of kCols pairs (b[2t][j], b[2t+1][j]) as int16, and `a` pairs
// (a[2t], a[2t+1]) as uint32 (row stride lda in uint32). `s` receives kRows x kCols sums.
constexpr int kRows = 2;
constexpr int kCols = 32;

void TreeTileScalar(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t K, int64_t* s);
void ExactTileScalar(const uint32_t* a, int64_t lda, const int16_t* b, int64_t K, int64_t* s);
#if defined(__x86_64__) || defined(__i386__)
void TreeTileAvx2(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t K, int64_t* s);
void ExactTileAvx2(const uint32_t* a, int64_t lda, const int16_t* b, int64_t K, int64_t* s);
#endif
#if (defined(__ARM_NEON) && defined(__aarch64__)) || defined(ONNXCAMPO_NEON_VIA_SIMDE)
void TreeTileNeon(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t K, int64_t* s);
void ExactTileNeon(const uint32_t* a, int64_t lda, const int16_t* b, int64_t K, int64_t* s);
#endif

}  // namespace onnxcampo
