// The ai.onnxcampo::ConvWeightGrad custom op (CPU and CUDA): attributes, checks, output type and
// shape for ORT's graph, and the kernels of conv_grad_cpu.cc / conv_grad.cu. Registered with ONNXCAMPO_REGISTER_OPS.
//
//   ConvWeightGrad[kernel_shape, strides, dilations, pads](x [N, Cin, H, W], dy [N, Cout, Ho, Wo])
//     -> dw [Cout, Cin, kh, kw]
#include <string>
#include <vector>

#include "conv_grad.h"
#include "op_util.h"

namespace onnxcampo {
namespace {

constexpr const char* kName = "ConvWeightGrad";

// Output type and shape for ORT's graph: x's element type and [Cout, Cin, kh, kw] when dy's and
// x's channel counts and kernel_shape are known (numbers only), else the type alone.
OrtStatusPtr InferConvWeightGrad(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  if (ShapeInferInputCount(ctx) != 2) return nullptr;
  int64_t channels[2] = {-1, -1};
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  for (size_t k = 0; k < 2; ++k) {
    std::vector<int64_t> dims;  // -1 for a symbolic dim
    std::vector<std::string> symbols;
    ONNXTensorElementDataType input_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    if (!TryShapeInferInput(ctx, k, &dims, &symbols, &input_type)) return nullptr;
    if (k == 0) type = input_type;
    if (dims.size() == 4 && dims[1] >= 0) channels[k] = dims[1];
  }
  if (!IsFloatOrHalf(type)) return nullptr;
  std::vector<int64_t> kernel_shape;
  const bool shaped = InferInts(ctx, "kernel_shape", &kernel_shape) && kernel_shape.size() == 2 &&
                      channels[0] >= 0 && channels[1] >= 0;
  Quietly([&] {
    if (!shaped) return ShapeInferOutputType(ctx, 0, type);
    ShapeInferOutput(ctx, 0, type, {channels[1], channels[0], kernel_shape[0], kernel_shape[1]});
  });
  return nullptr;
}

struct ConvWeightGradKernel : NodeKernel<ConvWeightGradKernel> {
  ConvWeightGradKernel(const OrtKernelInfo* info, bool cuda) : NodeKernel<ConvWeightGradKernel>(kName, info, cuda) {
    const std::string why = ReadIm2ColAttrs(info, &attrs);  // im2col_op.cc: the same four attributes
    if (!why.empty()) Fail(why);
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) graph = CudnnGraphApiAsked();
#endif
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    if (ctx.GetInputCount() != 2 || ctx.GetOutputCount() != 1) Fail("expected inputs x, dy and one output dw");
    Ort::ConstValue x = ctx.GetInput(0), dy = ctx.GetInput(1);
    auto x_info = x.GetTensorTypeAndShapeInfo();
    auto dy_info = dy.GetTensorTypeAndShapeInfo();
    const auto type = x_info.GetElementType();
    if (!IsFloatOrHalf(type) || dy_info.GetElementType() != type) {
      Fail("x and dy must both be float32 or both float16, got ONNX element types " +
           std::to_string(static_cast<int>(type)) + " and " + std::to_string(static_cast<int>(dy_info.GetElementType())));
    }
    const auto xs = x_info.GetShape(), dys = dy_info.GetShape();
    if (xs.size() != 4 || dys.size() != 4) {
      Fail("x and dy must be 4-D, got shapes " + ShapeText(xs) + " and " + ShapeText(dys));
    }
    ConvGradArgs args;
    args.a = attrs;
    args.n = xs[0], args.cin = xs[1], args.h = xs[2], args.w = xs[3];
    args.cout = dys[1];
    const std::string why = Im2ColOutputSize(attrs, args.h, args.w, &args.ho, &args.wo);
    if (!why.empty()) Fail(why);
    if (dys[0] != args.n || dys[2] != args.ho || dys[3] != args.wo) {
      Fail("dy has shape " + ShapeText(dys) + ", x " + ShapeText(xs) + " and the attributes give [" +
           std::to_string(args.n) + ", Cout, " + std::to_string(args.ho) + ", " + std::to_string(args.wo) + "]");
    }
    args.half = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    args.graph = graph;
    args.x = x.GetTensorRawData();
    args.dy = dy.GetTensorRawData();
    args.dw = ctx.GetOutput(0, {args.cout, args.cin, attrs.kh, attrs.kw}).GetTensorMutableRawData();
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return ConvWeightGradCuda(args, ctx.GetGPUComputeStream());
#endif
    ConvWeightGradCpu(args, ThreadPoolRunner(ctx));
  }

  Im2ColAttrs attrs;
  bool graph = false;  // cuDNN's graph API (CudnnGraphApiAsked)
};

struct ConvWeightGradCustomOp : OpBase<ConvWeightGradCustomOp, ConvWeightGradKernel> {
  explicit ConvWeightGradCustomOp(bool cuda) : OpBase(cuda) {
    OrtCustomOp::InferOutputShapeFn = InferConvWeightGrad;
  }
  const char* GetName() const { return kName; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

ONNXCAMPO_REGISTER_OPS(conv_grad, ConvWeightGradCustomOp);

}  // namespace

}  // namespace onnxcampo
