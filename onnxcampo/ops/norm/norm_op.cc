// The ONNX Runtime ops ai.onnxcampo::LayerNormGrad and SoftmaxGrad (norm.h has the arithmetic,
// docs/ops.md the decisions):
//
//   LayerNormGrad[output_type, output_shape](dy, xhat, invstd, gamma[, acc]) -> dx
//   SoftmaxGrad[cols, scale, output_type, output_shape](dy, y) -> dx
//
// dy, xhat (and acc): float32 or float16, rows x cols elements each (any shapes of that many);
// gamma: cols elements (cols = its element count); invstd: rows elements. dx: `output_type` (1
// float32, the default; 10 float16), shaped `output_shape` (default: dy's shape). ORT learns dx's
// type and shape from the attributes and dy (InferLayerNormGrad). SoftmaxGrad: dy and y float32 or
// float16, the same rows of `cols` elements; `scale` (default 1) multiplies dx.
#include <string>
#include <vector>

#include "norm.h"
#include "op_util.h"

namespace onnxcampo {
namespace {

constexpr const char* kName = "LayerNormGrad";
constexpr const char* kSoftmaxName = "SoftmaxGrad";

struct LayerNormGradKernel : NodeKernel<LayerNormGradKernel> {
  LayerNormGradKernel(const OrtKernelInfo* info, bool cuda)
      : NodeKernel<LayerNormGradKernel>(kName, info, cuda), output(info, who) {}

  // The tensor `index` checked to be float32/float16 with `count` elements (count < 0: any).
  Ort::ConstValue Input(Ort::KernelContext& ctx, size_t index, const char* name, int64_t count, bool* half) const {
    Ort::ConstValue value = ctx.GetInput(index);
    auto info = value.GetTensorTypeAndShapeInfo();
    const auto type = info.GetElementType();
    if (!IsFloatOrHalf(type)) Fail(std::string(name) + " must be float32 or float16");
    if (count >= 0 && static_cast<int64_t>(info.GetElementCount()) != count) {
      Fail(std::string(name) + " " + ShapeText(info.GetShape()) + " must hold " + std::to_string(count) +
                    " elements");
    }
    *half = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    return value;
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    NormGradArgs a;
    Ort::ConstValue dy = Input(ctx, 0, "dy", -1, &a.dy_half);
    Ort::ConstValue gamma = Input(ctx, 3, "gamma", -1, &a.gamma_half);
    const std::vector<int64_t> dy_shape = dy.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t count = static_cast<int64_t>(dy.GetTensorTypeAndShapeInfo().GetElementCount());
    a.cols = static_cast<int64_t>(gamma.GetTensorTypeAndShapeInfo().GetElementCount());
    if (a.cols == 0 || count % a.cols != 0) {
      Fail("dy " + ShapeText(dy_shape) + " is not rows of gamma's " + std::to_string(a.cols) + " elements");
    }
    a.rows = count / a.cols;
    Ort::ConstValue xhat = Input(ctx, 1, "xhat", count, &a.xhat_half);
    Ort::ConstValue invstd = Input(ctx, 2, "invstd", a.rows, &a.invstd_half);
    a.dy = dy.GetTensorRawData();
    a.xhat = xhat.GetTensorRawData();
    a.invstd = invstd.GetTensorRawData();
    a.gamma = gamma.GetTensorRawData();
    if (ctx.GetInputCount() > 4) {
      Ort::ConstValue acc = ctx.GetInput(4);
      if (acc != nullptr) a.acc = Input(ctx, 4, "acc", count, &a.acc_half).GetTensorRawData();
    }
    const std::vector<int64_t> out_shape = output.ShapeOr(dy_shape);
    if (ElementCount(out_shape) != count) {
      Fail("attribute 'output_shape' " + ShapeText(out_shape) + " must hold dy's " + std::to_string(count) +
                    " elements");
    }
    a.dx = ctx.GetOutput(0, out_shape).GetTensorMutableRawData();
    a.dx_half = output.half();
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return LayerNormGradCuda(a, ctx.GetGPUComputeStream());
#endif
    LayerNormGradCpu(a, ThreadPoolRunner(ctx));
  }

  OutputAttributes output;
};

// dx's type from output_type, its shape from output_shape or dy's (ORT ignores the status).
OrtStatusPtr ORT_API_CALL InferLayerNormGrad(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  ONNXTensorElementDataType type;
  if (!InferOutputType(ctx, &type)) return nullptr;
  Quietly([&] {  // nothing may unwind into ORT; the kernel says what is wrong
    std::vector<int64_t> dims;
    if (!InferInts(ctx, "output_shape", &dims)) dims = ShapeInferInputDims(ctx, 0);
    ShapeInferOutput(ctx, 0, type, dims);
  });
  return nullptr;
}

// Four inputs of any float type and an optional fifth (acc); one output typed by the inference.
struct LayerNormGradOpType : TypedOp<LayerNormGradOpType, LayerNormGradKernel> {
  static constexpr ONNXTensorElementDataType kInputTypes[] = {kAnyType, kAnyType, kAnyType, kAnyType, kAnyType};
  static constexpr ONNXTensorElementDataType kOutputTypes[] = {kAnyType};
  explicit LayerNormGradOpType(bool cuda) : TypedOp(cuda, InferLayerNormGrad) {}
  const char* GetName() const { return kName; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 4 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
};

struct SoftmaxGradKernel : NodeKernel<SoftmaxGradKernel> {
  SoftmaxGradKernel(const OrtKernelInfo* info, bool cuda)
      : NodeKernel<SoftmaxGradKernel>(kSoftmaxName, info, cuda), output(info, who) {
    cols = IntAttribute(info, "cols", 0);
    if (cols < 1) Fail("attribute 'cols' (the softmax axis' length, >= 1) is missing or < 1");
    scale = FloatAttribute(info, "scale", 1.0f);
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue dy = ctx.GetInput(0);
    Ort::ConstValue y = ctx.GetInput(1);
    auto dy_info = dy.GetTensorTypeAndShapeInfo();
    auto y_info = y.GetTensorTypeAndShapeInfo();
    if (!IsFloatOrHalf(dy_info.GetElementType()) || !IsFloatOrHalf(y_info.GetElementType())) {
      Fail("dy and y must be float32 or float16");
    }
    const int64_t count = static_cast<int64_t>(dy_info.GetElementCount());
    if (static_cast<int64_t>(y_info.GetElementCount()) != count || count % cols != 0) {
      Fail("dy " + ShapeText(dy_info.GetShape()) + " and y " + ShapeText(y_info.GetShape()) +
                    " must be the same rows of " + std::to_string(cols) + " elements");
    }
    const std::vector<int64_t> out_shape = output.ShapeOr(dy_info.GetShape());
    if (ElementCount(out_shape) != count) {
      Fail("attribute 'output_shape' " + ShapeText(out_shape) + " must hold dy's elements");
    }
    SoftmaxGradArgs a;
    a.dy = dy.GetTensorRawData();
    a.dy_half = dy_info.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    a.y = y.GetTensorRawData();
    a.y_half = y_info.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    a.dx = ctx.GetOutput(0, out_shape).GetTensorMutableRawData();
    a.dx_half = output.half();
    a.scale = scale;
    a.cols = cols;
    a.rows = count / cols;
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return SoftmaxGradCuda(a, ctx.GetGPUComputeStream());
#endif
    SoftmaxGradCpu(a, ThreadPoolRunner(ctx));
  }

  OutputAttributes output;
  int64_t cols = 0;
  float scale = 1.0f;
};

// Two inputs of any float type, one output typed by the inference (the same function: dx is
// shaped like the first input or output_shape).
struct SoftmaxGradOpType : TypedOp<SoftmaxGradOpType, SoftmaxGradKernel> {
  static constexpr ONNXTensorElementDataType kInputTypes[] = {kAnyType, kAnyType};
  static constexpr ONNXTensorElementDataType kOutputTypes[] = {kAnyType};
  explicit SoftmaxGradOpType(bool cuda) : TypedOp(cuda, InferLayerNormGrad) {}
  const char* GetName() const { return kSoftmaxName; }
};

ONNXCAMPO_REGISTER_OPS(norm, LayerNormGradOpType, SoftmaxGradOpType);

}  // namespace

}  // namespace onnxcampo
