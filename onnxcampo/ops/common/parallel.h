// How the CPU kernels spread work: serially, or over ONNX Runtime's intra-op thread pool
// (common/op_util.h's ThreadPoolRunner builds the runner from the kernel context). Free of ONNX Runtime types.
#pragma once

#include <cstddef>
#include <functional>

namespace onnxcampo {

// `run(count, task)` must call task(0) .. task(count - 1), in any order, possibly concurrently.
using ParallelRunner = std::function<void(size_t count, const std::function<void(size_t)>& task)>;

}  // namespace onnxcampo
