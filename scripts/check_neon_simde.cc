// Checks the NEON tile kernels (onnxcampo/ops/avg_matmul/avg_matmul_neon.cc) on x86 through SIMDe's NEON emulation:
// they must equal the scalar tiles bit for bit. Built and run by scripts/check_neon_simde.sh.
#include <cstdio>
#include <random>
#include <vector>

#include "avg_matmul.h"

using namespace onnxcampo;

int main() {
  std::mt19937 rng(1);
  int failures = 0;
  for (int64_t K : {1, 2, 3, 7, 8, 9, 13, 64, 100, 131, 256, 1000, 1024}) {
    const int64_t pairs = (K + 1) / 2;
    std::vector<uint16_t> a16(kRows * K), b16(K * kCols);
    std::vector<uint32_t> a32(kRows * pairs, 0);
    std::vector<int16_t> b32(pairs * 2 * kCols, 0);
    for (int r = 0; r < kRows; ++r) {
      for (int64_t k = 0; k < K; ++k) {
        const uint16_t v = (K % 3 == 0) ? 255 : rng() % 256;
        a16[r * K + k] = v;
        a32[r * pairs + k / 2] |= static_cast<uint32_t>(v) << (16 * (k % 2));
      }
    }
    for (int64_t k = 0; k < K; ++k) {
      for (int j = 0; j < kCols; ++j) {
        const uint16_t v = rng() % 256;
        b16[k * kCols + j] = v;
        b32[((k / 2) * kCols + j) * 2 + k % 2] = static_cast<int16_t>(v);
      }
    }
    int64_t want[kRows * kCols], got[kRows * kCols];
    TreeTileScalar(a16.data(), K, b16.data(), K, want);
    TreeTileNeon(a16.data(), K, b16.data(), K, got);
    for (int i = 0; i < kRows * kCols; ++i) failures += want[i] != got[i];
    ExactTileScalar(a32.data(), pairs, b32.data(), K, want);
    ExactTileNeon(a32.data(), pairs, b32.data(), K, got);
    for (int i = 0; i < kRows * kCols; ++i) failures += want[i] != got[i];
  }
  std::printf("NEON (SIMDe) tiles vs scalar tiles: %d mismatches\n", failures);
  return failures != 0;
}
