// BlockReduceSum on the CPU, and the CUDA kernels' launch plan (host arithmetic only).
//
// CPU: y[q] = sum over p, r of x[p][q][r] in float32, rounded once to y's type. Q is cut into
// ranges of about kWork elements of x each; the ranges are the tasks of ORT's intra-op pool and
// each y[q] is computed by one task in one order, so the result does not depend on the thread
// count:
//   R == 1: acc[q] += x[p][q] for p = 0, 1, ... (the inner loop runs along a row, over the
//           range's columns: contiguous loads, independent sums the compiler vectorises);
//   R > 1:  acc[q] += rowsum(p, q) for p = 0, 1, ..., each row summed in 8 interleaved partial
//           sums (element r into sum r % 8) added pairwise at the end.
// float16 inputs are converted by a table of all 65536 values (exact), float16 outputs rounded as
// FusedElementwise's (elementwise.h: to nearest even, overflow to inf, NaN to a quiet NaN).
// Built with -ffp-contract=off like the other CPU kernels (no FMA here anyway).
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "elementwise/elementwise.h"  // the float16 <-> float32 conversions
#include "reduce.h"

namespace onnxcampo {
namespace {

constexpr int64_t kWork = int64_t{1} << 16;  // elements of x per task, about

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Every float16 bit pattern's float32 value (256 KB, built once): one load per element, no
// branches in the loops.
const float* HalfTable() {
  static const std::vector<float> table = [] {
    std::vector<float> values(65536);
    for (uint32_t h = 0; h < 65536; ++h) values[h] = ew::HalfBitsToFloat(static_cast<uint16_t>(h));
    return values;
  }();
  return table.data();
}

struct FromHalf {
  const float* table;
  float operator()(uint16_t h) const { return table[h]; }
};
struct FromFloat {
  float operator()(float f) const { return f; }
};

template <typename T, typename Convert>
float RowSum(const T* row, int64_t n, Convert convert) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t r = 0;
  for (; r + 8 <= n; r += 8) {
    for (int j = 0; j < 8; ++j) s[j] += convert(row[r + j]);
  }
  for (int j = 0; r < n; ++r, ++j) s[j] += convert(row[r]);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

template <typename T, typename Convert>
void ReduceRange(const T* x, const BlockReduceArgs& a, int64_t q0, int64_t q1, float* acc, Convert convert) {
  const int64_t n = q1 - q0;
  std::fill(acc, acc + n, 0.0f);
  if (a.R == 1) {
    for (int64_t p = 0; p < a.P; ++p) {
      const T* row = x + p * a.Q + q0;
      for (int64_t i = 0; i < n; ++i) acc[i] += convert(row[i]);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    float sum = 0.0f;
    for (int64_t p = 0; p < a.P; ++p) sum += RowSum(x + (p * a.Q + q0 + i) * a.R, a.R, convert);
    acc[i] = sum;
  }
}

}  // namespace

void BlockReduceSumCpu(const BlockReduceArgs& a, const ParallelRunner& run) {
  if (a.Q <= 0) return;
  const int64_t per_q = std::max<int64_t>(1, a.P * a.R);
  // columns per task: about kWork elements; for R == 1 at least 256 (1 KB row segments of
  // float32: contiguous loads along the row)
  int64_t width = std::max<int64_t>(1, kWork / per_q);
  if (a.R == 1) width = std::max<int64_t>(256, CeilDiv(width, 64) * 64);
  width = std::min(width, a.Q);
  const size_t tasks = static_cast<size_t>(CeilDiv(a.Q, width));
  const float* table = a.x_half ? HalfTable() : nullptr;
  run(tasks, [&](size_t task) {
    const int64_t q0 = static_cast<int64_t>(task) * width;
    const int64_t q1 = std::min(a.Q, q0 + width);
    std::vector<float> acc(static_cast<size_t>(q1 - q0));
    if (a.P <= 0 || a.R <= 0) {
      std::fill(acc.begin(), acc.end(), 0.0f);
    } else if (a.x_half) {
      ReduceRange(static_cast<const uint16_t*>(a.x), a, q0, q1, acc.data(), FromHalf{table});
    } else {
      ReduceRange(static_cast<const float*>(a.x), a, q0, q1, acc.data(), FromFloat{});
    }
    if (a.y_half) {
      uint16_t* y = static_cast<uint16_t*>(a.y) + q0;
      for (int64_t i = 0; i < q1 - q0; ++i) y[i] = ew::FloatToHalfBits(acc[i]);
    } else {
      std::memcpy(static_cast<float*>(a.y) + q0, acc.data(), acc.size() * sizeof(float));
    }
  });
}

BlockReducePlan PlanBlockReduce(int64_t P, int64_t Q, int64_t R, bool x_half, int x_align, int sms, bool workspace) {
  BlockReducePlan plan;
  if (Q <= 0) return plan;
  if (P <= 0 || R <= 0) {
    plan.kind = BlockReducePlan::kZeros;
    return plan;
  }
  const int elem = x_half ? 2 : 4;
  // Enough threads to fill the device (2048 per SM) when the call is large enough.
  const int64_t target_threads = int64_t{std::max(1, sms)} * 2048;
  // The widest load (16 bytes at most) that divides the contiguous dim and x's alignment.
  auto vector_for = [&](int64_t n) {
    int v = 16 / elem;
    while (v > 1 && (n % v != 0 || x_align < v * elem)) v /= 2;
    return v;
  };
  if (R == 1) {
    plan.kind = BlockReducePlan::kColumns;
    plan.vec = vector_for(Q);
    const int64_t lanes_needed = CeilDiv(Q, plan.vec);
    plan.tx = 1;
    while (plan.tx < 32 && plan.tx < lanes_needed) plan.tx *= 2;
    plan.ty = kReduceThreads / plan.tx;
    plan.blocks_x = CeilDiv(Q, int64_t{plan.tx} * plan.vec);
    plan.chunks = 1;
    if (workspace) {
      const int64_t wanted = CeilDiv(CeilDiv(target_threads, kReduceThreads), plan.blocks_x);
      const int64_t most = std::min<int64_t>(CeilDiv(P, 4 * int64_t{plan.ty}), 65535);  // >= 4 rows a thread
      plan.chunks = std::max<int64_t>(1, std::min(wanted, most));
    }
    plan.rows = CeilDiv(P, plan.chunks);
    plan.chunks = CeilDiv(P, plan.rows);
    plan.partials = plan.chunks;
  } else {
    plan.kind = BlockReducePlan::kRows;
    plan.vec = vector_for(R);
    const int64_t vectors = R / plan.vec;
    plan.lanes = 1;
    while (plan.lanes < 32 && 2 * plan.lanes < vectors) plan.lanes *= 2;  // each lane >= 2 vectors a row
    const int64_t step = int64_t{plan.lanes} * plan.vec;  // elements one pass of a group covers
    const int64_t groups_wanted = CeilDiv(target_threads, plan.lanes);
    plan.p_chunks = 1;
    plan.r_chunks = 1;
    plan.r_len = R;
    if (workspace) {
      // each item at least 8 passes of its group over x (when the call has them)
      const int64_t most = std::max<int64_t>(1, std::min(P, P * R / (8 * step)));
      plan.p_chunks = std::max<int64_t>(1, std::min(CeilDiv(groups_wanted, Q), most));
      plan.p_len = CeilDiv(P, plan.p_chunks);
      plan.p_chunks = CeilDiv(P, plan.p_len);
      if (Q * plan.p_chunks < groups_wanted / 2) {  // few, long rows: cut the rows too
        const int64_t passes = CeilDiv(R, step);
        const int64_t r_most = std::max<int64_t>(1, passes / 4);  // >= 4 passes an item
        const int64_t r_chunks = std::max<int64_t>(1, std::min(CeilDiv(groups_wanted, Q * plan.p_chunks), r_most));
        plan.r_len = CeilDiv(passes, r_chunks) * step;
        plan.r_chunks = CeilDiv(R, plan.r_len);
      }
    }
    plan.p_len = CeilDiv(P, plan.p_chunks);
    plan.items = Q * plan.p_chunks * plan.r_chunks;
    plan.blocks = CeilDiv(plan.items, kReduceThreads / plan.lanes);
    plan.partials = plan.p_chunks * plan.r_chunks;
  }
  plan.workspace_bytes = plan.partials > 1 ? static_cast<size_t>(plan.partials * Q) * sizeof(float) : 0;
  return plan;
}

}  // namespace onnxcampo
