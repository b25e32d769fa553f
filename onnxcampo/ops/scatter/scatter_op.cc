// ai.onnxcampo::ScatterNDAdd(data, indices, updates) -> output, for ONNX Runtime's CPU and CUDA
// execution providers: ONNX ScatterND with reduction="add" (scatter.h has the semantics; docs/ops.md
// the decisions). This file reads and checks the call; scatter_cpu.cc and scatter.cu compute it.
//
// The kernels copy data into the output. The op could declare that output 0 may reuse input 0
// (OrtCustomOp::GetMayInplace, as ORT's own ScatterND kernels do); tried with a computed data
// tensor read by nothing else (onnxruntime 1.32, CPU), the output never aliased it (presumably:
// ORT's planner reuses a buffer only when it can tell both are of one size, and it has no shape
// for a custom op's output), so the op declares nothing. In step graphs data is onnx-ad's zeros
// Constant, an initializer, which ORT does not reuse anyway.
#include <string>
#include <vector>

#include "op_util.h"
#include "scatter.h"

namespace onnxcampo {
namespace {

constexpr const char* kScatterName = "ScatterNDAdd";

const char* TypeName(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "float64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    default: return "a type other than float32/float16";
  }
}

struct ScatterNDAddKernel {
  ScatterNDAddKernel(const OrtKernelInfo* info, bool cuda) : cuda(cuda) {
    Ort::ConstKernelInfo kernel_info(info);
    who = NodeWho(kScatterName, info);
    // The op always adds; a node carried over from ScatterND with another reduction is refused.
    size_t size = 0;
    OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_string(info, "reduction", nullptr, &size);
    if (status == nullptr) {
      std::string reduction(size, '\0');
      status = Ort::GetApi().KernelInfoGetAttribute_string(info, "reduction", &reduction[0], &size);
      if (status == nullptr) {
        reduction.resize(size > 0 ? size - 1 : 0);  // size counts the terminating NUL
        if (reduction != "add") {
          Fail(who, "attribute reduction='" + reduction + "': the op always adds (leave the attribute out, or 'add')");
        }
      }
    }
    if (status != nullptr) Ort::GetApi().ReleaseStatus(status);  // absent: fine
    if (kernel_info.GetInputCount() != 3 || kernel_info.GetOutputCount() != 1) {
      Fail(who, "expected inputs (data, indices, updates) and one output");
    }
    const auto data = kernel_info.GetInputTypeInfo(0).GetTensorTypeAndShapeInfo().GetElementType();
    const auto updates = kernel_info.GetInputTypeInfo(2).GetTensorTypeAndShapeInfo().GetElementType();
    if (!IsFloatOrHalf(data)) Fail(who, std::string("data must be float32 or float16, not ") + TypeName(data));
    if (updates != data) {
      Fail(who, std::string("updates must have data's element type (") + TypeName(data) + "), not " + TypeName(updates));
    }
  }

  // A ScatterError (an index out of range) is the caller's: ORT_INVALID_ARGUMENT.
  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return StatusOf(
        [&] {
          try {
            Compute(context);
          } catch (const ScatterError& e) {
            Fail(who, e.what());
          }
        },
        who, ORT_RUNTIME_EXCEPTION);
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue data = ctx.GetInput(0);
    Ort::ConstValue indices = ctx.GetInput(1);
    Ort::ConstValue updates = ctx.GetInput(2);
    const auto data_info = data.GetTensorTypeAndShapeInfo();
    const auto indices_info = indices.GetTensorTypeAndShapeInfo();
    const auto updates_info = updates.GetTensorTypeAndShapeInfo();
    const auto type = data_info.GetElementType();
    if (!IsFloatOrHalf(type)) Fail(who, std::string("data must be float32 or float16, not ") + TypeName(type));
    if (updates_info.GetElementType() != type) {
      Fail(who, std::string("updates must have data's element type (") + TypeName(type) + "), not " +
                      TypeName(updates_info.GetElementType()));
    }
    if (indices_info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64) {
      Fail(who, std::string("indices must be int64, not ") + TypeName(indices_info.GetElementType()));
    }
    const std::vector<int64_t> data_shape = data_info.GetShape();
    const std::vector<int64_t> index_shape = indices_info.GetShape();
    const std::vector<int64_t> update_shape = updates_info.GetShape();
    if (index_shape.empty()) Fail(who, "indices must have rank >= 1 (its last dimension is the index tuple)");
    const int64_t k = index_shape.back();
    if (k > static_cast<int64_t>(data_shape.size())) {
      Fail(who, "indices' last dimension (" + std::to_string(k) + ") exceeds data's rank (" +
                      std::to_string(data_shape.size()) + "); indices " + ShapeText(index_shape) + ", data " +
                      ShapeText(data_shape));
    }
    if (k > kScatterMaxIndexDims) {
      Fail(who, "index tuples of " + std::to_string(k) + " entries; at most " + std::to_string(kScatterMaxIndexDims) +
                      " are supported");
    }
    std::vector<int64_t> expected(index_shape.begin(), index_shape.end() - 1);
    expected.insert(expected.end(), data_shape.begin() + k, data_shape.end());
    if (update_shape != expected) {
      Fail(who, "updates must have shape indices.shape[:-1] + data.shape[k:] = " + ShapeText(expected) + ", not " +
                      ShapeText(update_shape) + " (data " + ShapeText(data_shape) + ", indices " + ShapeText(index_shape) +
                      ")");
    }

    ScatterArgs args;
    args.half = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    args.k = static_cast<int>(k);
    args.data_elements = static_cast<int64_t>(data_info.GetElementCount());
    args.tuples = static_cast<int64_t>(indices_info.GetElementCount()) / (k > 0 ? k : 1);
    if (k == 0) {  // [..., 0]: one empty tuple per leading position, each selecting all of data
      args.tuples = 1;
      for (size_t i = 0; i + 1 < index_shape.size(); ++i) args.tuples *= index_shape[i];
    }
    args.slice = 1;
    for (size_t i = static_cast<size_t>(k); i < data_shape.size(); ++i) args.slice *= data_shape[i];
    int64_t stride = args.slice;
    for (int j = args.k - 1; j >= 0; --j) {
      args.dims[j] = data_shape[j];
      args.strides[j] = stride;
      stride *= data_shape[j];
    }
    args.data = data.GetTensorRawData();
    args.indices = indices.GetTensorData<int64_t>();
    args.updates = updates.GetTensorRawData();
    args.output = ctx.GetOutput(0, data_shape).GetTensorMutableRawData();
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return ScatterNDAddCuda(args, ctx.GetGPUComputeStream());
#endif
    ScatterNDAddCpu(args);
  }

  std::string who;
  bool cuda;
};

// One op per element type (float32, float16) and execution provider: ORT merges ops of one name
// into one schema whose type constraints are the union, and picks the kernel by the input types,
// so an output's type is known when the model loads (ORT cannot infer the type of an untyped
// output from two untyped inputs).
template <ONNXTensorElementDataType kType>
struct ScatterNDAddOp : OpBase<ScatterNDAddOp<kType>, ScatterNDAddKernel> {
  using OpBase<ScatterNDAddOp<kType>, ScatterNDAddKernel>::OpBase;
  const char* GetName() const { return kScatterName; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : kType;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return kType; }
};

using FloatOp = ScatterNDAddOp<ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT>;
using HalfOp = ScatterNDAddOp<ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16>;

ONNXCAMPO_REGISTER_OPS(scatter, FloatOp, HalfOp);

}  // namespace
}  // namespace onnxcampo
