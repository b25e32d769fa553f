#!/bin/sh
# Compile the NEON kernels on x86 against SIMDe (https://github.com/simd-everywhere/simde, the
# header-only NEON emulation; e.g. `pip download --no-deps simde-py` and unpack it, or
# `apt-get install libsimde-dev`) and check them against the scalar kernels bit for bit.
#   SIMDE_INCLUDE=/path/holding/simde scripts/check_neon_simde.sh
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
include=${SIMDE_INCLUDE:-/usr/include}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
c++ -std=c++17 -O2 -Wall -Wextra -I"$root/onnxcampo/ops/common" -I"$root/onnxcampo/ops/avg_matmul" -I"$include" -DONNXCAMPO_NEON_VIA_SIMDE \
    "$root/scripts/check_neon_simde.cc" "$root/onnxcampo/ops/avg_matmul/avg_matmul_neon.cc" "$root/onnxcampo/ops/avg_matmul/avg_matmul.cc" \
    "$root/onnxcampo/ops/avg_matmul/avg_matmul_avx2.cc" -mavx2 -o "$out/check"  # -mavx2: the x86 dispatch links the AVX2 tiles
"$out/check"
