// The ONNX Runtime op ai.onnxcampo::FusedElementwise (elementwise.h has the program and the
// kernels, elementwise_jit.h the generated CUDA kernels; onnxcampo/ops/elementwise/__init__.py
// specifies it):
//
//   FusedElementwise[program, registers, constants, output_types, input_types](x_1..x_n) -> (y_1..y_m)
//
// A register program per element of the inputs' broadcast shape: float16/float32 in and out; the
// element types of its heterogeneous variadic output come from `output_types` through the op's
// shape-inference function. Also the library's entry points for the tests and scripts
// (onnxcampo.ops.elementwise.jit): the generated kernels' statistics, grids and sources.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "elementwise.h"
#include "elementwise_jit.h"
#include "op_util.h"
#include "reduce/reduce.h"

namespace onnxcampo {

#ifdef ONNXCAMPO_WITH_CUDA
void BlockReduceSumOnStream(OrtKernelContext* ctx, const OrtMemoryInfo* memory, const BlockReduceArgs& args);  // reduce_op.cc
#endif

namespace {

constexpr const char* kFusedElementwise = "FusedElementwise";

// The program is checked when ORT creates the kernel (session creation), with the rules and
// messages of onnxcampo.ops.elementwise.check; each call broadcasts its inputs' shapes.
// `input_types` (optional) names the element types the program was written for. ORT's CPU
// provider runs an fp16 node it has no fp16 neighbours for in fp32 (its InsertCastTransformer:
// Casts to fp32 before the node, back to fp16 after, the node's fp16 inputs and outputs made
// fp32). A node whose fp16 inputs all arrive as fp32 (and no fp32 input as fp16) is run so: its
// fp16 outputs are written as fp32 (the values the program rounded to fp16, which the Casts
// after it keep exactly).
bool RunsInFloat32(const std::vector<int64_t>& declared, const std::vector<ONNXTensorElementDataType>& actual) {
  if (declared.empty() || declared.size() != actual.size()) return false;
  bool converted = false;
  for (size_t k = 0; k < actual.size(); ++k) {
    if (declared[k] == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 && actual[k] == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      converted = true;
    } else if (declared[k] != actual[k]) {
      return false;
    }
  }
  return converted;
}

// The element type output k is written in: `output_types`, or fp32 for an fp16 output of a node
// run in fp32 (RunsInFloat32).
ONNXTensorElementDataType OutputType(const std::vector<int64_t>& output_types, size_t k, bool in_float32) {
  const auto type = static_cast<ONNXTensorElementDataType>(output_types[k]);
  return in_float32 && type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : type;
}

#ifdef ONNXCAMPO_WITH_CUDA
// Which CUDA kernel runs FusedElementwise, read when ORT creates the kernel (so sessions made
// under different settings in one process can be compared): the generated one
// (elementwise_jit.h) unless $ONNXCAMPO_EW_KERNEL is "interpreter" (elementwise.cu).
enum class EwKernel { kGenerated, kInterpreter };
EwKernel ChosenEwKernel() {
  const char* value = std::getenv("ONNXCAMPO_EW_KERNEL");
  return value != nullptr && std::string(value) == "interpreter" ? EwKernel::kInterpreter : EwKernel::kGenerated;
}

// Says once per process, on stderr, that the slower interpreter kernel runs and why.
void WarnInterpreter(const std::string& why) {
  static std::once_flag once;
  std::call_once(once, [&] {
    std::fprintf(stderr, "onnxcampo_ops: FusedElementwise runs its interpreter kernel (slower): %s\n", why.c_str());
  });
}
#endif

// `column_sums` [k, Q], `column_sums_type` and `column_sums_shape` checked as the kernel and the
// shape inference read them (outputs: the node's elementwise outputs); "" or what is wrong.
std::string CheckColumnSums(const std::vector<int64_t>& sums, int64_t type, const std::vector<int64_t>& shape,
                            size_t outputs) {
  if (sums.size() != 2) return "attribute 'column_sums' must hold 2 ints [output, columns], got " + IntsText(sums);
  if (sums[0] < 0 || sums[0] >= static_cast<int64_t>(outputs)) {
    return "column_sums sums output " + std::to_string(sums[0]) + ", the node has " + std::to_string(outputs) +
           " elementwise outputs";
  }
  if (sums[1] < 1) return "column_sums' columns must be >= 1, got " + std::to_string(sums[1]);
  return OutputAttributesError("column_sums_type", type, "column_sums_shape", shape, sums[1],
                               std::to_string(sums[1]) + " columns are summed");
}

struct FusedElementwise {
  FusedElementwise(const OrtKernelInfo* info, bool cuda) : cuda(cuda) {
    Ort::ConstKernelInfo kernel_info(info);
    who = NodeWho(kFusedElementwise, info);
    bool found = false;
    const std::vector<int64_t> code = IntsAttribute(info, "program", &found);
    if (!found) Fail(who, "attribute 'program' (ints) is missing");
    int64_t register_count = 0;
    OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_int64(info, "registers", &register_count);
    if (status != nullptr) {
      Ort::GetApi().ReleaseStatus(status);
      Fail(who, "attribute 'registers' (int) is missing");
    }
    const std::vector<float> constants = FloatsAttribute(info, "constants", &found);  // absent: none
    output_types = IntsAttribute(info, "output_types", &found);
    if (!found) Fail(who, "attribute 'output_types' (ints) is missing");
    const size_t inputs = kernel_info.GetInputCount();
    const size_t outputs = kernel_info.GetOutputCount();
    const std::string error = ew::CheckProgram(code, register_count, constants, inputs, output_types, &program);
    if (!error.empty()) Fail(who, error);
    const std::vector<int64_t> sums = IntsAttribute(info, "column_sums", &found);
    if (found) {
      sum_type = IntAttribute(info, "column_sums_type", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
      sum_shape = IntsAttribute(info, "column_sums_shape", &found);
      if (!found && sums.size() == 2) sum_shape = {sums[1]};
      const std::string sums_error = CheckColumnSums(sums, sum_type, sum_shape, output_types.size());
      if (!sums_error.empty()) Fail(who, sums_error);
      sum_output = static_cast<int>(sums[0]);
      sum_columns = sums[1];
    }
    if (output_types.size() + (sum_output >= 0 ? 1 : 0) != outputs) {
      Fail(who, "output_types has " + std::to_string(output_types.size()) + " entries" +
                    (sum_output >= 0 ? " and column_sums one output" : "") + ", the node " + std::to_string(outputs) +
                    " outputs");
    }
    input_types = IntsAttribute(info, "input_types", &found);  // absent: no check, no fp32 run
    if (found && input_types.size() != inputs) {
      Fail(who, "input_types has " + std::to_string(input_types.size()) + " entries, the node " +
                    std::to_string(inputs) + " inputs");
    }
    std::vector<ONNXTensorElementDataType> actual;
    for (size_t k = 0; k < inputs; ++k) {
      const auto type = kernel_info.GetInputTypeInfo(k).GetTensorTypeAndShapeInfo().GetElementType();
      if (!IsFloatOrHalf(type)) Fail(who, "input " + std::to_string(k) + " must be float32 or float16");
      actual.push_back(type);
    }
    in_float32 = RunsInFloat32(input_types, actual);
    if (!input_types.empty() && !in_float32) {
      for (size_t k = 0; k < inputs; ++k) {
        if (actual[k] != static_cast<ONNXTensorElementDataType>(input_types[k])) {
          Fail(who, "input " + std::to_string(k) + " has element type " + std::to_string(actual[k]) +
                        ", input_types says " + std::to_string(input_types[k]));
        }
      }
    }
    for (size_t k = 0; k < output_types.size(); ++k) {
      const auto type = kernel_info.GetOutputTypeInfo(k).GetTensorTypeAndShapeInfo().GetElementType();
      if (type != OutputType(output_types, k, in_float32)) {
        Fail(who, "output " + std::to_string(k) + " is declared of element type " + std::to_string(type) +
                      ", output_types says " + std::to_string(output_types[k]));
      }
    }
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return StatusOf([&] { Compute(context); }, who, ORT_RUNTIME_EXCEPTION);
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    ew::Layout layout;
    const size_t inputs = ctx.GetInputCount();
    if (inputs < 1 || inputs > static_cast<size_t>(ew::kMaxInputs)) Fail(who, "1..16 inputs, got " + std::to_string(inputs));
    std::vector<std::vector<int64_t>> shapes;
    for (size_t k = 0; k < inputs; ++k) {
      Ort::ConstValue value = ctx.GetInput(k);
      auto info = value.GetTensorTypeAndShapeInfo();
      const auto type = info.GetElementType();
      if (!IsFloatOrHalf(type)) Fail(who, "input " + std::to_string(k) + " must be float32 or float16");
      shapes.push_back(info.GetShape());
      layout.in[k] = value.GetTensorRawData();
      if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) layout.in_half |= 1u << k;
    }
    std::vector<int64_t> shape;
    const std::string error = ew::Prepare(shapes, &shape, &layout);
    if (!error.empty()) Fail(who, error);
    layout.outputs = static_cast<int32_t>(output_types.size());
    for (size_t k = 0; k < output_types.size(); ++k) {
      Ort::UnownedValue value = ctx.GetOutput(k, shape);
      const auto type = value.GetTensorTypeAndShapeInfo().GetElementType();
      if (type != OutputType(output_types, k, in_float32)) {
        Fail(who, "output " + std::to_string(k) + " has element type " + std::to_string(type) + ", output_types says " +
                      std::to_string(output_types[k]));
      }
      layout.out[k] = value.GetTensorMutableRawData();
      if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) layout.out_half |= 1u << k;
    }
    if (sum_output >= 0) return ComputeWithSums(ctx, layout);
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) {
      RunCuda(ctx, layout, nullptr);
      return;
    }
#endif
    ew::FusedElementwiseCpu(program, layout, ThreadPoolRunner(ctx));
  }

  // The column sums of output sum_output as one more output. CUDA: a generated kernel adds them
  // as it stores (partial sums, JitSumGrid) and BlockReduceSum adds the partials up; where that
  // cannot run (no grid worth it, no scratch buffer, the interpreter), the stored output is
  // summed by BlockReduceSum after the kernel. CPU: the stored output is summed.
  void ComputeWithSums(Ort::KernelContext& ctx, const ew::Layout& layout) {
    const size_t m = output_types.size();
    Ort::UnownedValue value = ctx.GetOutput(m, sum_shape);
    const int64_t written = OutputType({sum_type}, 0, in_float32);
    if (value.GetTensorTypeAndShapeInfo().GetElementType() != written) {
      Fail(who, "output " + std::to_string(m) + " has element type " +
                    std::to_string(value.GetTensorTypeAndShapeInfo().GetElementType()) + ", column_sums_type says " +
                    std::to_string(sum_type));
    }
    if (layout.n % sum_columns != 0) {
      Fail(who, "column_sums: output " + std::to_string(sum_output) + " holds " + std::to_string(layout.n) +
                    " elements, not rows of " + std::to_string(sum_columns));
    }
    BlockReduceArgs args;
    args.x = layout.out[sum_output];
    args.x_half = layout.out_half >> sum_output & 1;
    args.y = value.GetTensorMutableRawData();
    args.y_half = written == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    args.P = layout.n / sum_columns, args.Q = sum_columns, args.R = 1;
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) {
      const OrtMemoryInfo* memory = value.GetTensorMemoryInfo();
      ew::JitSums sums;
      sums.output = sum_output;
      sums.columns = sum_columns;
      if (kernel == EwKernel::kGenerated && layout.n > 0 && ew::PlanJitSums(layout.n, sum_columns, ew::JitMaxBlocks(), &sums.grid)) {
        ScratchBuffer partials(ctx.GetOrtKernelContext(), memory, static_cast<size_t>(sums.grid.rows * sum_columns) * sizeof(float));
        sums.partials = static_cast<float*>(partials.get());
        if (sums.partials != nullptr && RunCuda(ctx, layout, &sums)) {
          BlockReduceArgs partial_args = args;
          partial_args.x = sums.partials;
          partial_args.x_half = false;
          partial_args.P = sums.grid.rows;
          return BlockReduceSumOnStream(ctx.GetOrtKernelContext(), memory, partial_args);
        }
      }
      RunCuda(ctx, layout, nullptr);
      return BlockReduceSumOnStream(ctx.GetOrtKernelContext(), memory, args);
    }
#endif
    ew::FusedElementwiseCpu(program, layout, ThreadPoolRunner(ctx));
    BlockReduceSumCpu(args, ThreadPoolRunner(ctx));
  }

#ifdef ONNXCAMPO_WITH_CUDA
  // The generated kernel (with `sums`, also the partial sums; false when it cannot run: nothing
  // ran) or, without sums, the interpreter where the generated kernel cannot run.
  bool RunCuda(Ort::KernelContext& ctx, const ew::Layout& layout, const ew::JitSums* sums) {
    std::string why;
    if (kernel == EwKernel::kGenerated && jit.Launch(program, layout, ctx.GetGPUComputeStream(), &why, sums)) return true;
    if (!why.empty()) WarnInterpreter(why);
    if (sums != nullptr) return false;
    ew::FusedElementwiseCuda(program, layout, ctx.GetGPUComputeStream());
    return true;
  }
#endif

  ew::Program program;
#ifdef ONNXCAMPO_WITH_CUDA
  EwKernel kernel = ChosenEwKernel();
  ew::JitKernel jit;
#endif
  std::vector<int64_t> output_types;
  std::vector<int64_t> input_types;
  int sum_output = -1;  // column_sums: the output summed, its columns, the sums' type and shape
  int64_t sum_columns = 0;
  int64_t sum_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  std::vector<int64_t> sum_shape;
  bool in_float32 = false;
  std::string who;
  bool cuda;
};

// ORT's type and shape inference for the node: element types from `output_types`, every
// output of the numpy broadcast of the input shapes. A dimension is a number where some input
// has a number other than 1, an input's symbol where the others have 1 or the same symbol, and
// a fresh symbol (onnxcampo_ew_<n>) where it cannot be known (distinct symbols, unknown
// dimensions). ORT shows an input without shape information as a scalar (rank 0), and this
// function cannot tell them apart. ORT ignores the status this function returns (custom_ops.cc):
// it reports nothing; the kernel checks the attributes when it is created. Only outputs
// 0 .. len(output_types)-1 are set: ORT does not tell the node's output count here, the kernel
// checks that it matches (ORT 1.32 refuses an index beyond the outputs; 1.21 does not check).
OrtStatusPtr ORT_API_CALL InferFusedElementwise(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  const OrtApi& api = Ort::GetApi();
  try {
    std::vector<int64_t> types;
    if (!InferInts(ctx, "output_types", &types) || types.empty() || types.size() > ew::kMaxOutputs) return nullptr;
    size_t inputs = 0;
    Ort::ThrowOnError(api.ShapeInferContext_GetInputCount(ctx, &inputs));
    std::vector<std::vector<int64_t>> dims(inputs);
    std::vector<std::vector<std::string>> names(inputs);
    std::vector<ONNXTensorElementDataType> actual(inputs);
    size_t rank = 0;
    for (size_t k = 0; k < inputs; ++k) {
      ShapeInferInput(ctx, k, &dims[k], &names[k], &actual[k]);
      rank = std::max(rank, dims[k].size());
    }
    std::vector<int64_t> declared;
    InferInts(ctx, "input_types", &declared);
    const bool in_float32 = RunsInFloat32(declared, actual);
    static std::atomic<uint64_t> fresh{0};
    std::vector<int64_t> shape(rank, 1);
    std::vector<std::string> symbols(rank);
    for (size_t d = 0; d < rank; ++d) {
      int64_t number = 1;
      std::string symbol;
      bool unknown = false;
      for (size_t k = 0; k < inputs; ++k) {
        if (dims[k].size() + d < rank) continue;  // a missing leading dimension: 1
        const size_t e = d + dims[k].size() - rank;
        if (dims[k][e] >= 0) {
          if (dims[k][e] != 1) number = dims[k][e];  // (a clash of numbers fails when the kernel runs)
        } else if (names[k][e].empty()) {
          unknown = true;
        } else if (symbol.empty()) {
          symbol = names[k][e];
        } else if (symbol != names[k][e]) {
          unknown = true;
        }
      }
      if (number != 1) {
        shape[d] = number;
      } else if (unknown) {
        shape[d] = -1;
        symbols[d] = "onnxcampo_ew_" + std::to_string(fresh++);
      } else if (!symbol.empty()) {
        shape[d] = -1;
        symbols[d] = symbol;
      }
    }
    std::vector<const char*> symbol_pointers(rank);
    for (size_t d = 0; d < rank; ++d) symbol_pointers[d] = symbols[d].c_str();
    for (size_t k = 0; k < types.size(); ++k) {
      if (types[k] != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && types[k] != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) continue;
      ShapeInferOutput(ctx, k, OutputType(types, k, in_float32), shape, symbol_pointers);
    }
    std::vector<int64_t> sums, sum_shape;
    if (InferInts(ctx, "column_sums", &sums)) {  // one more output: the column sums
      int64_t sum_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
      InferInt(ctx, "column_sums_type", &sum_type);
      if (!InferInts(ctx, "column_sums_shape", &sum_shape) && sums.size() == 2) sum_shape = {sums[1]};
      if (CheckColumnSums(sums, sum_type, sum_shape, types.size()).empty()) {
        ShapeInferOutput(ctx, types.size(), OutputType({sum_type}, 0, in_float32), sum_shape,
                         std::vector<const char*>(sum_shape.size(), ""));
      }
    }
  } catch (...) {  // nothing may unwind into ORT
  }
  return nullptr;
}

// One variadic heterogeneous input (float16/float32 tensors) and one variadic heterogeneous
// output: ORT's own type inference gives up on such outputs, InferFusedElementwise sets them.
struct FusedElementwiseOp : VariadicOp<FusedElementwiseOp, FusedElementwise, kAnyType, kAnyType> {
  explicit FusedElementwiseOp(bool cuda) : VariadicOp(cuda, InferFusedElementwise) {}
  const char* GetName() const { return kFusedElementwise; }
};

}  // namespace

ONNXCAMPO_REGISTER_OPS(elementwise, FusedElementwiseOp);

}  // namespace onnxcampo

// What FusedElementwise's generated CUDA kernels did in this process (ew::JitStats), "" in a
// library without CUDA (read by onnxcampo.ops.elementwise.jit.kernel_stats).
extern "C" __attribute__((visibility("default"))) const char* OnnxcampoFusedElementwiseStats() {
#ifdef ONNXCAMPO_WITH_CUDA
  static thread_local std::string text;
  text = onnxcampo::ew::JitStats();
  return text.c_str();
#else
  return "";
#endif
}

// The grid a generated FusedElementwise kernel that sums columns runs (ew::PlanJitSums), for the
// tests: returns 1 and fills out[0..2] with blocks, rows, combine when there is one, else 0.
extern "C" __attribute__((visibility("default"))) int OnnxcampoJitSumGrid(int64_t n, int64_t q, int max_blocks,
                                                                           int64_t* out) {
  onnxcampo::ew::JitSumGrid grid;
  if (!onnxcampo::ew::PlanJitSums(n, q, max_blocks, &grid)) return 0;
  out[0] = grid.blocks, out[1] = grid.rows, out[2] = grid.combine;
  return 1;
}

// The CUDA source FusedElementwise's generated kernel has for a node and one call's input shapes
// (elementwise_jit.h), for tests and scripts (onnxcampo.ops.elementwise.jit): `shapes` holds the inputs'
// dimensions one after the other, `ranks[k]` how many are input k's, `input_types[k]` 1 or 10;
// `sum_output` >= 0: the kernel also sums that output's `sum_columns` columns (column_sums).
// Writes the source (NUL-terminated) into `buffer` when it fits and returns its length; a
// negative return -L says the program or shapes are refused and `buffer` holds why (L bytes).
extern "C" __attribute__((visibility("default"))) int64_t OnnxcampoFusedElementwiseSource(
    const int64_t* program, int64_t program_length, int64_t registers, const float* constants, int64_t constant_count,
    const int64_t* output_types, int64_t outputs, const int64_t* input_types, const int64_t* shapes,
    const int64_t* ranks, int64_t inputs, int32_t literal_shape, int32_t sum_output, int64_t sum_columns, char* buffer,
    int64_t size) {
  using namespace onnxcampo::ew;
  std::string text;
  bool refused = true;
  try {
    Program p;
    const std::vector<int64_t> types(output_types, output_types + outputs);
    text = CheckProgram(std::vector<int64_t>(program, program + program_length), registers,
                        std::vector<float>(constants, constants + constant_count), static_cast<size_t>(inputs), types, &p);
    if (text.empty()) {
      std::vector<std::vector<int64_t>> dims;
      for (int64_t k = 0, at = 0; k < inputs; at += ranks[k++]) dims.emplace_back(shapes + at, shapes + at + ranks[k]);
      std::vector<int64_t> shape;
      Layout layout;
      text = Prepare(dims, &shape, &layout);
      if (text.empty()) {
        layout.outputs = static_cast<int32_t>(outputs);
        for (int64_t k = 0; k < inputs; ++k) layout.in_half |= (input_types[k] == 10 ? 1u : 0u) << k;
        for (int64_t k = 0; k < outputs; ++k) layout.out_half |= (output_types[k] == 10 ? 1u : 0u) << k;
        JitOptions options;
        options.index64 = layout.n >= (int64_t{1} << 31);
        options.literal_shape = literal_shape != 0;
        options.sum_output = sum_output;
        options.sum_columns = sum_columns;
        text = GenerateSource(p, layout, options);
        refused = false;
      }
    }
  } catch (const std::exception& e) {
    text = e.what();
  }
  const int64_t length = static_cast<int64_t>(text.size());
  if (buffer != nullptr && size > length) std::memcpy(buffer, text.c_str(), text.size() + 1);
  return refused ? -length : length;
}
