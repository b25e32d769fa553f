// The ONNX Runtime ops ai.onnxcampo::SoftmaxCrossEntropy and SoftmaxCrossEntropyGrad (xent.h has
// the arithmetic, docs/ops.md the decisions):
//
//   SoftmaxCrossEntropy[classes, output_type](x, labels) -> (picked, lse)
//   SoftmaxCrossEntropyGrad[classes, output_type, output_shape, output_columns](x, lse, labels, scale) -> dx
//
// x: float32 or float16 [..., width]; `classes` (default width) <= width columns of each row are
// the logits. labels: int64 with one element per row. picked: `output_type` (1 float32, the
// default; 10 float16), labels' shape; lse: float32, labels' shape. scale: float32 or float16,
// 1 or rows elements. dx: `output_type`, `output_shape` (default x's shape with the last
// dimension `output_columns`), rows * output_columns elements; `output_columns` (default
// `classes`) >= classes: each row of dx padded with zeros to it (a GEMM's padded K or N). ORT learns the outputs' types and shapes from the
// attributes and the inputs (InferForward, InferGrad).
#include <string>
#include <vector>

#include "op_util.h"
#include "xent.h"

namespace onnxcampo {
namespace {

constexpr const char* kForwardName = "SoftmaxCrossEntropy";
constexpr const char* kGradName = "SoftmaxCrossEntropyGrad";

// The rows x width view of x and the class count, checked; `classes` < 0: the attribute is absent.
struct Rows {
  int64_t rows = 0, width = 0, classes = 0;
};

Rows ReadRows(const std::string& who, const std::vector<int64_t>& x_shape, int64_t classes) {
  if (x_shape.empty()) Fail(who, "x must have rank >= 1 (the classes are its last axis)");
  Rows out;
  out.width = x_shape.back();
  out.classes = classes < 0 ? out.width : classes;
  if (out.classes < 1 || out.classes > out.width) {
    Fail(who, "attribute 'classes' (" + std::to_string(out.classes) + ") must lie in [1, " + std::to_string(out.width) +
                  "], x's last dimension; x " + ShapeText(x_shape));
  }
  out.rows = ElementCount(x_shape) / out.width;
  return out;
}

void CheckFloat(const std::string& who, const char* name, ONNXTensorElementDataType type) {
  if (!IsFloatOrHalf(type)) Fail(who, std::string(name) + " must be float32 or float16");
}

void CheckLabels(const std::string& who, Ort::ConstValue& labels, int64_t rows) {
  auto info = labels.GetTensorTypeAndShapeInfo();
  if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64) Fail(who, "labels must be int64");
  if (static_cast<int64_t>(info.GetElementCount()) != rows) {
    Fail(who, "labels " + ShapeText(info.GetShape()) + " must hold one label per row of x (" + std::to_string(rows) + ")");
  }
}

struct ForwardKernel : NodeKernel<ForwardKernel> {
  ForwardKernel(const OrtKernelInfo* info, bool cuda) : NodeKernel<ForwardKernel>(kForwardName, info, cuda) {
    classes = IntAttribute(info, "classes", -1);
    output_type = OutputTypeAttribute(info, who);
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue x = ctx.GetInput(0);
    Ort::ConstValue labels = ctx.GetInput(1);
    auto x_info = x.GetTensorTypeAndShapeInfo();
    CheckFloat(who, "x", x_info.GetElementType());
    const Rows rows = ReadRows(who, x_info.GetShape(), classes);
    CheckLabels(who, labels, rows.rows);
    const std::vector<int64_t> shape = labels.GetTensorTypeAndShapeInfo().GetShape();
    XentArgs args;
    args.x = x.GetTensorRawData();
    args.x_half = x_info.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    args.labels = labels.GetTensorData<int64_t>();
    args.rows = rows.rows, args.width = rows.width, args.classes = rows.classes;
    args.picked = ctx.GetOutput(0, shape).GetTensorMutableRawData();
    args.picked_half = output_type == kHalfType;
    args.lse_out = ctx.GetOutput(1, shape).GetTensorMutableData<float>();
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return SoftmaxCrossEntropyCuda(args, ctx.GetGPUComputeStream());
#endif
    SoftmaxCrossEntropyCpu(args, ThreadPoolRunner(ctx));
  }

  int64_t classes = -1, output_type = kFloatType;
};

struct GradKernel : NodeKernel<GradKernel> {
  GradKernel(const OrtKernelInfo* info, bool cuda) : NodeKernel<GradKernel>(kGradName, info, cuda), output(info, who) {
    classes = IntAttribute(info, "classes", -1);
    columns = IntAttribute(info, "output_columns", -1);
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue x = ctx.GetInput(0);
    Ort::ConstValue lse = ctx.GetInput(1);
    Ort::ConstValue labels = ctx.GetInput(2);
    Ort::ConstValue scale = ctx.GetInput(3);
    auto x_info = x.GetTensorTypeAndShapeInfo();
    auto lse_info = lse.GetTensorTypeAndShapeInfo();
    auto scale_info = scale.GetTensorTypeAndShapeInfo();
    CheckFloat(who, "x", x_info.GetElementType());
    CheckFloat(who, "scale", scale_info.GetElementType());
    const std::vector<int64_t> x_shape = x_info.GetShape();
    const Rows rows = ReadRows(who, x_shape, classes);
    CheckLabels(who, labels, rows.rows);
    if (lse_info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ||
        static_cast<int64_t>(lse_info.GetElementCount()) != rows.rows) {
      Fail("lse must be float32 with one value per row of x (" + std::to_string(rows.rows) + ")");
    }
    const int64_t scales = static_cast<int64_t>(scale_info.GetElementCount());
    if (scales != 1 && scales != rows.rows) {
      Fail("scale must hold 1 value or one per row (" + std::to_string(rows.rows) + "), not " +
                    std::to_string(scales));
    }
    const int64_t dx_width = columns < 0 ? rows.classes : columns;
    if (dx_width < rows.classes) {
      Fail("attribute 'output_columns' (" + std::to_string(dx_width) + ") must be >= classes (" +
                    std::to_string(rows.classes) + ")");
    }
    std::vector<int64_t> out_shape = output.shape;
    if (!output.has_shape) {
      out_shape = x_shape;
      out_shape.back() = dx_width;
    }
    if (ElementCount(out_shape) != rows.rows * dx_width) {
      Fail("attribute 'output_shape' " + ShapeText(out_shape) + " must hold rows x " +
                    std::string(columns < 0 ? "classes" : "output_columns") + " = " +
                    std::to_string(rows.rows * dx_width) + " elements");
    }
    XentArgs args;
    args.x = x.GetTensorRawData();
    args.x_half = x_info.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    args.labels = labels.GetTensorData<int64_t>();
    args.rows = rows.rows, args.width = rows.width, args.classes = rows.classes;
    args.lse = lse.GetTensorData<float>();
    args.scale = scale.GetTensorRawData();
    args.scale_half = scale_info.GetElementType() == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    args.scale_per_row = scales != 1;
    args.dx = ctx.GetOutput(0, out_shape).GetTensorMutableRawData();
    args.dx_half = output.half();
    args.dx_width = dx_width;
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return SoftmaxCrossEntropyGradCuda(args, ctx.GetGPUComputeStream());
#endif
    SoftmaxCrossEntropyGradCpu(args, ThreadPoolRunner(ctx));
  }

  OutputAttributes output;
  int64_t classes = -1, columns = -1;
};

// picked and lse shaped like labels (their dimensions as ORT knows them; -1 where it does not).
OrtStatusPtr ORT_API_CALL InferForward(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  ONNXTensorElementDataType type;
  if (!InferOutputType(ctx, &type)) return nullptr;
  Quietly([&] {  // nothing may unwind into ORT; the kernel says what is wrong
    const std::vector<int64_t> dims = ShapeInferInputDims(ctx, 1);
    ShapeInferOutput(ctx, 0, type, dims);
    ShapeInferOutput(ctx, 1, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, dims);
  });
  return nullptr;
}

OrtStatusPtr ORT_API_CALL InferGrad(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  ONNXTensorElementDataType type;
  if (!InferOutputType(ctx, &type)) return nullptr;
  Quietly([&] {
    std::vector<int64_t> dims;
    if (!InferInts(ctx, "output_shape", &dims)) {
      dims = ShapeInferInputDims(ctx, 0);
      int64_t classes = 0;
      if (dims.empty()) return;
      if (InferInt(ctx, "classes", &classes)) dims.back() = classes;
      if (InferInt(ctx, "output_columns", &classes)) dims.back() = classes;
    }
    ShapeInferOutput(ctx, 0, type, dims);
  });
  return nullptr;
}

// x untyped (float32 or float16, checked by the kernel), labels int64; picked untyped (its type
// set by InferForward), lse float32.
struct ForwardOp : TypedOp<ForwardOp, ForwardKernel> {
  static constexpr ONNXTensorElementDataType kInputTypes[] = {kAnyType, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64};
  static constexpr ONNXTensorElementDataType kOutputTypes[] = {kAnyType, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
  explicit ForwardOp(bool cuda) : TypedOp(cuda, InferForward) {}
  const char* GetName() const { return kForwardName; }
};

// x and scale untyped, lse float32, labels int64; dx untyped (InferGrad).
struct GradOp : TypedOp<GradOp, GradKernel> {
  static constexpr ONNXTensorElementDataType kInputTypes[] = {kAnyType, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                                                              ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, kAnyType};
  static constexpr ONNXTensorElementDataType kOutputTypes[] = {kAnyType};
  explicit GradOp(bool cuda) : TypedOp(cuda, InferGrad) {}
  const char* GetName() const { return kGradName; }
};

ONNXCAMPO_REGISTER_OPS(xent, ForwardOp, GradOp);

}  // namespace
}  // namespace onnxcampo
