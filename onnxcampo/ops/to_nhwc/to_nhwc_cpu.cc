// NchwToNhwc on the CPU (to_nhwc.h): one task per (n, block of positions), each y element written
// once; float16 conversions as FusedElementwise's (elementwise.h).
#include <algorithm>

#include "elementwise/elementwise.h"
#include "to_nhwc.h"

namespace onnxcampo {

void ToNhwcCpu(const ToNhwcArgs& g, const ParallelRunner& run) {
  constexpr int64_t kBlock = 4096;  // positions a task
  const int64_t blocks = (g.s + kBlock - 1) / kBlock;
  if (g.n == 0 || g.s == 0 || g.channels == 0) return;
  run(static_cast<size_t>(g.n * blocks), [&](size_t task) {
    const int64_t n = static_cast<int64_t>(task) / blocks, b = static_cast<int64_t>(task) % blocks;
    const int64_t end = std::min(g.s, (b + 1) * kBlock);
    for (int64_t s = b * kBlock; s < end; ++s) {
      const int64_t at = (n * g.s + s) * g.channels;
      for (int64_t c = 0; c < g.channels; ++c) {
        const float v = c < g.c ? ew::LoadAsFloat(g.x, (n * g.c + c) * g.s + s, g.x_half) : 0.0f;
        ew::StoreFloat(g.y, at + c, v, g.y_half);
      }
    }
  });
}

}  // namespace onnxcampo
