// BlockReduceSum: y[q] = sum over p, r of x[p][q][r], x a contiguous [P, Q, R] array of float16
// or float32, accumulated in float32 and rounded once to y's type (float32 or float16). Free of
// ONNX Runtime types, like multi_tensor.h: reduce_op.cc is the ORT op, reduce_cpu.cc the CPU kernel
// and the CUDA launch plan, reduce.cu the CUDA kernels.
//
// Both kernels are deterministic: every element is added in an order fixed by the shape (and,
// on CUDA, the plan: the device's SM count and the input's alignment), never by timing; there
// are no atomics. Results are the same bit for bit run to run, and on the CPU for any thread
// count.
#pragma once

#include <cstddef>
#include <cstdint>

#include "parallel.h"

namespace onnxcampo {

struct BlockReduceArgs {
  const void* x = nullptr;  // P*Q*R elements
  bool x_half = false;      // float16 (else float32)
  void* y = nullptr;        // Q elements
  bool y_half = false;
  int64_t P = 0, Q = 0, R = 0;
};

// How the CUDA kernels cover one call (PlanBlockReduce; docs/ops.md "BlockReduceSum").
//
// kColumns (R == 1, x a row-major [P, Q] matrix): blocks of tx * ty threads; block (bx, c) sums
// columns [bx*tx*vec, (bx+1)*tx*vec) over rows [c*rows, (c+1)*rows): thread (i, j) adds rows
// c*rows + j, + ty, ... of its vec columns (vec-element loads along Q, coalesced), the block
// adds its ty partial sums per column in order j = 0..ty-1.
// kRows (R > 1): rows (p, q) of R contiguous elements; a group of `lanes` threads (a power of two
// <= 32, inside one warp) takes work item i = (k, q), k = pc*r_chunks + rc: rows p of chunk pc
// ([pc*p_len, (pc+1)*p_len)) and elements [rc*r_len, (rc+1)*r_len) of each; lane l adds the
// vec-element vectors l, l + lanes, ... of four rows at a time (then of the rows left, one by
// one), p ascending, then the group adds its lanes by a fixed xor butterfly.
// Either way, with partials == 1 the sums go to y; else to a float32 workspace [partials, Q] that
// a second kernel adds up per column in order k = 0..partials-1 (8 strided runs, then the 8
// run sums in order), rounding once to y's type.
struct BlockReducePlan {
  enum Kind : int { kNothing = 0, kZeros = 1, kColumns = 2, kRows = 3 };
  int kind = kNothing;
  int vec = 1;  // elements per load (16 bytes at most)
  // kColumns
  int tx = 0, ty = 0;
  int64_t blocks_x = 0, chunks = 0, rows = 0;
  // kRows
  int lanes = 0;
  int64_t items = 0, p_chunks = 0, p_len = 0, r_chunks = 0, r_len = 0, blocks = 0;
  // both
  int64_t partials = 1;
  size_t workspace_bytes = 0;  // partials > 1: partials * Q float32 values
};

constexpr int kReduceThreads = 256;  // threads per block of the first kernel

// The plan for a call on a device of `sms` multiprocessors. `x_align`: the largest power of two
// (<= 16) dividing x's address. `workspace`: whether a workspace may be used (false: partials
// is 1, one kernel, less parallel). Pure host arithmetic (reduce_cpu.cc), exported for the tests
// (OnnxcampoBlockReducePlan in reduce_op.cc).
BlockReducePlan PlanBlockReduce(int64_t P, int64_t Q, int64_t R, bool x_half, int x_align, int sms, bool workspace);

// CPU: Q is cut into ranges that `run` spreads over threads; each y[q] is computed by one task
// in one fixed order (p ascending; for R > 1 each row summed in 8 interleaved float32 partial
// sums added pairwise), whatever the thread count.
void BlockReduceSumCpu(const BlockReduceArgs& args, const ParallelRunner& run);

#ifdef ONNXCAMPO_WITH_CUDA
// The device's SM count (cached per thread and device) and the plan for this call.
BlockReducePlan PlanBlockReduceCuda(const BlockReduceArgs& args, bool workspace);
// One or two kernel launches (or a memset) on `stream`; `workspace` holds plan.workspace_bytes.
// Nothing is allocated and nothing synchronises, so it can be captured in a CUDA graph.
void BlockReduceSumCuda(const BlockReduceArgs& args, const BlockReducePlan& plan, void* workspace, void* stream);
#endif

}  // namespace onnxcampo
