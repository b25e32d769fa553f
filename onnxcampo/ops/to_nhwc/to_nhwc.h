// NchwToNhwc (ai.onnxcampo): y = Pad(Cast(Transpose(x))) in one pass, where a channels-last graph
// receives a channels-first input (the image of a CNN's training step, float32 NCHW, which its
// float16 channels-last stem reads padded to 4 or 8 channels):
//
//   y[n, s, c] = c < C ? output_type(x[n, c, s]) : 0      x [N, C, S...], y [N, S..., channels]
//
// (S the spatial positions in order; float32 -> float16 rounds to nearest even, float16 ->
// float32 is exact, NaN stays NaN). Free of ONNX Runtime types: to_nhwc_op.cc is the ORT op,
// to_nhwc_cpu.cc the CPU kernel, to_nhwc.cu the CUDA kernel. Both write every element of y
// once (no atomics): the same bits on every run and thread count.
#pragma once

#include <cstdint>

#include "parallel.h"

namespace onnxcampo {

struct ToNhwcArgs {
  const void* x = nullptr;  // [N, C, S]
  bool x_half = false;
  void* y = nullptr;  // [N, S, channels]
  bool y_half = false;
  int64_t n = 0, c = 0, s = 0, channels = 0;  // channels >= c
};

void ToNhwcCpu(const ToNhwcArgs& args, const ParallelRunner& run);

#ifdef ONNXCAMPO_WITH_CUDA
// One launch on `stream` (a cudaStream_t); nothing allocated or synchronised (capturable).
void ToNhwcCuda(const ToNhwcArgs& args, void* stream);
#endif

}  // namespace onnxcampo
