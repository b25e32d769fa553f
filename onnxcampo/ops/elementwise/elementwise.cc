// FusedElementwise on the host: the program check, the broadcast layout of a call (both used by
// the CPU and the CUDA kernel), and the CPU kernel.
//
// CPU kernel: the output elements are cut into chunks of kChunk, the tasks of one ParallelFor
// on ORT's intra-op pool. A chunk runs the program on blocks of kLanes consecutive elements
// (Execute's lanes: one instruction over a whole block, so the interpretation costs little
// per element and the float32 loops vectorise). Each element gets the same operations whatever
// its block and chunk, and is written by one task only: the results do not depend on the
// thread count.
#include <algorithm>
#include <cstring>

#include "elementwise.h"

namespace onnxcampo {
namespace ew {
namespace {

constexpr int kLanes = 64;                   // elements per block
constexpr int64_t kChunk = int64_t{1} << 15;  // elements per task (512 blocks)

const char* const kNames[kOpcodeCount] = {"LOAD", "CONST", "STORE", "ADD", "SUB", "MUL", "DIV", "POW",
                                          "MAX", "MIN", "NEG", "ABS", "EXP", "LOG", "SQRT", "RECIP",
                                          "TANH", "ERF", "SIGMOID", "RELU", "ROUND_F16", "COPY",
                                          "GREATER", "LESS", "GREATER_EQUAL", "LESS_EQUAL", "EQUAL"};

bool IsBinary(int64_t op) { return IsBinaryOp(op); }

std::string List(const std::vector<int64_t>& values) {
  std::string text = "[";
  for (size_t k = 0; k < values.size(); ++k) text += (k ? ", " : "") + std::to_string(values[k]);
  return text + "]";
}

}  // namespace

std::string CheckProgram(const std::vector<int64_t>& program, int64_t registers, const std::vector<float>& constants,
                         size_t inputs, const std::vector<int64_t>& output_types, Program* out) {
  if (program.empty() || program.size() % 4 != 0) return "program must be a non-empty list of 4-int instructions";
  const size_t count = program.size() / 4;
  if (count > static_cast<size_t>(kMaxInstructions)) {
    return "program has " + std::to_string(count) + " instructions, more than " + std::to_string(kMaxInstructions);
  }
  if (registers < 1 || registers > kMaxRegisters) {
    return "registers must be 1.." + std::to_string(kMaxRegisters) + ", got " + std::to_string(registers);
  }
  if (inputs < 1 || inputs > static_cast<size_t>(kMaxInputs)) {
    return "1.." + std::to_string(kMaxInputs) + " inputs, got " + std::to_string(inputs);
  }
  const bool types_ok = std::all_of(output_types.begin(), output_types.end(), [](int64_t t) { return t == 1 || t == 10; });
  if (output_types.empty() || output_types.size() > static_cast<size_t>(kMaxOutputs) || !types_ok) {
    return "1.." + std::to_string(kMaxOutputs) + " outputs of type 1 or 10, got " + List(output_types);
  }
  Program p;
  p.count = static_cast<int32_t>(count);
  p.registers = static_cast<int32_t>(registers);
  std::vector<int64_t> constant_slot(constants.size(), -1);
  int used_constants = 0;
  uint64_t written = 0;  // bit r: register r written
  uint32_t stored = 0;   // bit k: output k stored
  for (size_t k = 0; k < count; ++k) {
    const int64_t code = program[4 * k], dst = program[4 * k + 1], a = program[4 * k + 2], b = program[4 * k + 3];
    const std::string where = "instruction " + std::to_string(k);
    if (code < 0 || code >= kOpcodeCount) return where + ": unknown opcode " + std::to_string(code);
    // What the instruction reads: nothing (LOAD, CONST), r[a] (STORE, unary), r[a] and r[b].
    int64_t reads[2];
    int read_count = 0;
    if (code != kLoad && code != kConst) reads[read_count++] = a;
    if (IsBinary(code)) reads[read_count++] = b;
    for (int q = 0; q < read_count; ++q) {
      const int64_t r = reads[q];
      if (r < 0 || r >= kMaxRegisters || !(written >> r & 1)) {
        return where + " (" + kNames[code] + ") reads register " + std::to_string(r) + " before any write";
      }
    }
    if (code == kLoad && (a < 0 || a >= static_cast<int64_t>(inputs))) {
      return where + ": LOAD of input " + std::to_string(a) + ", the node has " + std::to_string(inputs);
    }
    if (code == kConst && (a < 0 || a >= static_cast<int64_t>(constants.size()))) {
      return where + ": CONST " + std::to_string(a) + ", the node has " + std::to_string(constants.size()) + " constants";
    }
    if (code == kStore) {
      if (dst < 0 || dst >= static_cast<int64_t>(output_types.size()) || (stored >> dst & 1)) {
        return where + ": STORE to output " + std::to_string(dst) + " (outputs " + std::to_string(output_types.size()) +
               ", each stored once)";
      }
      stored |= 1u << dst;
    } else {
      if (dst < 0 || dst >= registers) {
        return where + ": register " + std::to_string(dst) + " of " + std::to_string(registers);
      }
      written |= uint64_t{1} << dst;
    }
    Instr& in = p.code[k];
    in.op = static_cast<uint8_t>(code);
    in.dst = static_cast<uint8_t>(dst);
    if (code == kConst) {
      if (constant_slot[a] < 0) {
        constant_slot[a] = used_constants;
        p.constants[used_constants++] = constants[a];
      }
      in.a = static_cast<uint8_t>(constant_slot[a]);
    } else {
      in.a = static_cast<uint8_t>(a);  // LOAD: the input; else a register (checked above)
    }
    in.b = IsBinary(code) ? static_cast<uint8_t>(b) : 0;
  }
  std::vector<int64_t> missing;
  for (size_t k = 0; k < output_types.size(); ++k) {
    if (!(stored >> k & 1)) missing.push_back(static_cast<int64_t>(k));
  }
  if (!missing.empty()) return "outputs " + List(missing) + " are never stored";
  if (out != nullptr) *out = p;
  return "";
}

std::string Prepare(const std::vector<std::vector<int64_t>>& shapes, std::vector<int64_t>* out_shape, Layout* layout) {
  size_t rank = 0;
  for (const auto& s : shapes) rank = std::max(rank, s.size());
  std::vector<int64_t> shape(rank, 1);
  for (const auto& s : shapes) {
    for (size_t d = 0; d < s.size(); ++d) {
      int64_t& o = shape[rank - s.size() + d];
      if (s[d] == 1 || s[d] == o) continue;
      if (o != 1) {
        std::string text = "input shapes do not broadcast:";
        for (const auto& t : shapes) text += " " + List(t);
        return text;
      }
      o = s[d];
    }
  }
  *out_shape = shape;
  const size_t inputs = shapes.size();
  layout->inputs = static_cast<int32_t>(inputs);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  layout->n = n;
  layout->rank = 0;
  layout->any_strided = 0;
  if (n == 0) return "";
  // Per-input strides over the output's dimensions (0 where the input broadcasts), size-1
  // output dimensions dropped, then adjacent dimensions merged where all inputs allow it.
  std::vector<int64_t> dims;
  std::vector<std::vector<int64_t>> strides(inputs);
  std::vector<std::vector<int64_t>> full(inputs, std::vector<int64_t>(rank, 0));
  for (size_t k = 0; k < inputs; ++k) {
    const auto& s = shapes[k];
    int64_t step = 1;
    for (size_t d = s.size(); d-- > 0;) {
      full[k][rank - s.size() + d] = s[d] == 1 ? 0 : step;
      step *= s[d];
    }
  }
  for (size_t d = 0; d < rank; ++d) {
    if (shape[d] == 1) continue;
    bool merge = !dims.empty();
    for (size_t k = 0; k < inputs && merge; ++k) merge = strides[k].back() == full[k][d] * shape[d];
    if (merge) {
      dims.back() *= shape[d];
      for (size_t k = 0; k < inputs; ++k) strides[k].back() = full[k][d];
    } else {
      dims.push_back(shape[d]);
      for (size_t k = 0; k < inputs; ++k) strides[k].push_back(full[k][d]);
    }
  }
  if (dims.size() > static_cast<size_t>(kMaxDims)) {
    return "the broadcast shape " + List(shape) + " keeps " + std::to_string(dims.size()) +
           " dimensions after merging the contiguous ones, more than " + std::to_string(kMaxDims);
  }
  layout->rank = static_cast<int32_t>(dims.size());
  std::vector<int64_t> contiguous(dims.size());
  int64_t step = 1;
  for (size_t d = dims.size(); d-- > 0;) {
    layout->dim[d] = dims[d];
    contiguous[d] = step;
    step *= dims[d];
  }
  for (size_t k = 0; k < inputs; ++k) {
    int64_t elements = 1;
    for (int64_t d : shapes[k]) elements *= d;
    for (size_t d = 0; d < dims.size(); ++d) layout->stride[k][d] = strides[k][d];
    if (elements == 1) {
      layout->kind[k] = kScalar;
    } else if (strides[k] == contiguous) {
      layout->kind[k] = kFull;
    } else {
      layout->kind[k] = kStrided;
      layout->any_strided = 1;
    }
  }
  return "";
}

namespace {

template <typename T>
float ToFloat(T v);
template <>
float ToFloat<float>(float v) { return v; }
template <>
float ToFloat<uint16_t>(uint16_t v) { return HalfBitsToFloat(v); }

template <typename T>
void FromFloat(float v, T* out);
template <>
void FromFloat<float>(float v, float* out) { *out = v; }
template <>
void FromFloat<uint16_t>(float v, uint16_t* out) { *out = FloatToHalfBits(v); }

// Input k's values at elements first .. first + lanes - 1 (coordinates `coord`, for a strided
// input) into dst; the other lanes get 0.
template <typename T>
void LoadInput(const Layout& t, int k, int64_t first, const int64_t* coord, int lanes, float* dst) {
  const T* x = static_cast<const T*>(t.in[k]);
  int j = 0;
  switch (t.kind[k]) {
    case kFull:
      for (; j < lanes; ++j) dst[j] = ToFloat<T>(x[first + j]);
      break;
    case kScalar: {
      const float v = ToFloat<T>(x[0]);
      for (; j < lanes; ++j) dst[j] = v;
      break;
    }
    default: {
      const int64_t* s = t.stride[k];
      int64_t c[kMaxDims];
      int64_t offset = 0;
      for (int d = 0; d < t.rank; ++d) {
        c[d] = coord[d];
        offset += c[d] * s[d];
      }
      for (; j < lanes; ++j) {
        dst[j] = ToFloat<T>(x[offset]);
        for (int d = t.rank - 1; d >= 0; --d) {  // next element: the innermost coordinate first
          offset += s[d];
          if (++c[d] < t.dim[d]) break;
          offset -= s[d] * t.dim[d];
          c[d] = 0;
        }
      }
    }
  }
  for (; j < kLanes; ++j) dst[j] = 0.0f;
}

template <typename T>
void StoreOutput(const Layout& t, int k, int64_t first, int lanes, const float* src) {
  T* y = static_cast<T*>(t.out[k]) + first;
  for (int j = 0; j < lanes; ++j) FromFloat<T>(src[j], y + j);
}

void RunChunk(const Program& p, const Layout& t, int64_t begin, int64_t end) {
  alignas(64) float r[kMaxRegisters][kLanes];
  int64_t coord[kMaxDims] = {};
  for (int64_t first = begin; first < end; first += kLanes) {
    const int lanes = static_cast<int>(std::min<int64_t>(kLanes, end - first));
    if (t.any_strided) {
      int64_t rest = first;
      for (int d = t.rank - 1; d >= 0; --d) {
        coord[d] = rest % t.dim[d];
        rest /= t.dim[d];
      }
    }
    auto load = [&](int k, float* dst) {
      if (t.in_half >> k & 1) {
        LoadInput<uint16_t>(t, k, first, coord, lanes, dst);
      } else {
        LoadInput<float>(t, k, first, coord, lanes, dst);
      }
    };
    auto store = [&](int k, const float* src) {
      if (t.out_half >> k & 1) {
        StoreOutput<uint16_t>(t, k, first, lanes, src);
      } else {
        StoreOutput<float>(t, k, first, lanes, src);
      }
    };
    Execute<kLanes>(p, r, load, store);
  }
}

}  // namespace

void FusedElementwiseCpu(const Program& program, const Layout& layout, const ParallelRunner& run) {
  if (layout.n == 0) return;
  const size_t chunks = static_cast<size_t>((layout.n + kChunk - 1) / kChunk);
  run(chunks, [&](size_t c) {
    const int64_t begin = static_cast<int64_t>(c) * kChunk;
    RunChunk(program, layout, begin, std::min(begin + kChunk, layout.n));
  });
}

}  // namespace ew
}  // namespace onnxcampo
