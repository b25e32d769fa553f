// The ai.onnxcampo::Im2Col custom op (CPU and CUDA): attributes, checks, output type and shape
// for ORT's graph, and the kernels of im2col_cpu.cc / im2col.cu. Registered with ONNXCAMPO_REGISTER_OPS.
//
//   Im2Col[kernel_shape, strides, dilations, pads](x [N, C, H, W]) -> columns [C*kh*kw, N*Ho*Wo]
#include <string>
#include <vector>

#include "im2col.h"
#include "op_util.h"

namespace onnxcampo {
namespace {

constexpr char kName[] = "Im2Col";

std::vector<int64_t> Or(std::vector<int64_t> value, bool present, std::vector<int64_t> fallback) {
  return present ? value : fallback;
}

// Output type and shape for ORT's graph: the element type of x; [C*kh*kw, N*Ho*Wo] when x's
// four dims and the attributes are known and valid, else no shape (kernel creation and Compute
// report what is wrong; ORT ignores this function's status). Only numbers are set: an invented
// symbol could make ORT share buffers between outputs of different sizes.
OrtStatusPtr InferIm2Col(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  std::vector<int64_t> dims;  // -1 for a symbolic dim
  std::vector<std::string> symbols;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  if (ShapeInferInputCount(ctx) != 1 || !TryShapeInferInput(ctx, 0, &dims, &symbols, &type) || dims.size() != 4 ||
      !IsFloatOrHalf(type)) {
    return nullptr;
  }
  for (int64_t d : dims) {
    if (d < 0) return nullptr;
  }
  std::vector<int64_t> kernel_shape, strides, dilations, pads;
  const bool have_kernel = InferInts(ctx, "kernel_shape", &kernel_shape);
  const bool have_strides = InferInts(ctx, "strides", &strides);
  const bool have_dilations = InferInts(ctx, "dilations", &dilations);
  const bool have_pads = InferInts(ctx, "pads", &pads);
  Im2ColAttrs a;
  int64_t ho = 0, wo = 0;
  if (!Im2ColCheck(kernel_shape, Or(strides, have_strides, {1, 1}), Or(dilations, have_dilations, {1, 1}),
                   Or(pads, have_pads, {0, 0, 0, 0}), have_kernel, &a).empty() ||
      !Im2ColOutputSize(a, dims[2], dims[3], &ho, &wo).empty()) {
    return nullptr;
  }
  Quietly([&] { ShapeInferOutput(ctx, 0, type, {dims[1] * a.kh * a.kw, dims[0] * ho * wo}); });
  return nullptr;
}

struct Im2ColKernel : NodeKernel<Im2ColKernel> {
  Im2ColKernel(const OrtKernelInfo* info, bool cuda) : NodeKernel<Im2ColKernel>(kName, info, cuda) {
    const std::string why = ReadIm2ColAttrs(info, &attrs);
    if (!why.empty()) Fail(why);
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    if (ctx.GetInputCount() != 1 || ctx.GetOutputCount() != 1) Fail("expected one input x and one output columns");
    Ort::ConstValue x = ctx.GetInput(0);
    auto info = x.GetTensorTypeAndShapeInfo();
    const auto type = info.GetElementType();
    if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
      Fail("x must be float32 or float16, got ONNX element type " + std::to_string(static_cast<int>(type)));
    }
    const auto shape = info.GetShape();
    if (shape.size() != 4) Fail("x must be 4-D [N, C, H, W], got rank " + std::to_string(shape.size()));
    Im2ColArgs args;
    args.a = attrs;
    args.n = shape[0], args.c = shape[1], args.h = shape[2], args.w = shape[3];
    const std::string why = Im2ColOutputSize(attrs, args.h, args.w, &args.ho, &args.wo);
    if (!why.empty()) Fail(why);
    args.element_size = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? 2 : 4;
    args.x = x.GetTensorRawData();
    const std::vector<int64_t> out_shape{args.c * attrs.kh * attrs.kw, args.n * args.ho * args.wo};
    args.columns = ctx.GetOutput(0, out_shape).GetTensorMutableRawData();
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return Im2ColCuda(args, ctx.GetGPUComputeStream());
#endif
    Im2ColCpu(args, ThreadPoolRunner(ctx));
  }

  Im2ColAttrs attrs;
};

// One input and one output of undefined type: ORT's custom-op type inference gives the output
// the input's type; InferIm2Col adds the shape.
using Im2ColCustomOp = UntypedUnaryOp<kName, Im2ColKernel, InferIm2Col>;

ONNXCAMPO_REGISTER_OPS(im2col, Im2ColCustomOp);

}  // namespace

std::string ReadIm2ColAttrs(const OrtKernelInfo* info, Im2ColAttrs* out) {
  bool have_kernel = false, have_strides = false, have_dilations = false, have_pads = false;
  const auto kernel_shape = IntsAttribute(info, "kernel_shape", &have_kernel);
  const auto strides = IntsAttribute(info, "strides", &have_strides);
  const auto dilations = IntsAttribute(info, "dilations", &have_dilations);
  const auto pads = IntsAttribute(info, "pads", &have_pads);
  return Im2ColCheck(kernel_shape, Or(strides, have_strides, {1, 1}), Or(dilations, have_dilations, {1, 1}),
                     Or(pads, have_pads, {0, 0, 0, 0}), have_kernel, out);
}

}  // namespace onnxcampo
