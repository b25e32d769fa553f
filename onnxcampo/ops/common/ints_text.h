// "[a, b, ...]": how the ops' messages print shapes and int attributes. Free of ONNX Runtime types,
// so that the headers nvcc compiles (im2col.h, max_pool.h) share it with the op glue (op_util.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace onnxcampo {

inline std::string IntsText(const std::vector<int64_t>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

}  // namespace onnxcampo
