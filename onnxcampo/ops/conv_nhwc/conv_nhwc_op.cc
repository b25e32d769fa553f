// The ai.onnxcampo NHWC convolution ops (conv_nhwc.h): attributes, checks, output type and shape
// for ORT's graph, and the kernels (conv_nhwc_cpu.cc; on CUDA cuDNN through conv_grad.cu).
// Registered with ONNXCAMPO_REGISTER_OPS.
#include <string>
#include <vector>

#include "conv_nhwc.h"
#include "op_util.h"

namespace onnxcampo {
namespace {

const char* NameOf(ConvKind kind) {
  return kind == ConvKind::kForward ? "ConvNhwc" : kind == ConvKind::kData ? "ConvNhwcDataGrad" : "ConvNhwcWeightGrad";
}

// The static dims of input k ({} when it is not 4-D; -1 for a symbolic or unknown dim).
std::vector<int64_t> InferDims(OrtShapeInferContext* ctx, size_t k, ONNXTensorElementDataType* type) {
  std::vector<int64_t> dims;
  std::vector<std::string> symbols;
  ONNXTensorElementDataType input_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  const bool known = TryShapeInferInput(ctx, k, &dims, &symbols, &input_type);
  if (type != nullptr) *type = input_type;
  if (!known || dims.size() != 4) return {};
  return dims;
}

template <ConvKind kKind>
OrtStatusPtr InferConvNhwc(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  if (ShapeInferInputCount(ctx) != 2) return nullptr;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  const std::vector<int64_t> first = InferDims(ctx, 0, &type), second = InferDims(ctx, 1, nullptr);
  if (!IsFloatOrHalf(type)) return nullptr;
  std::vector<int64_t> kernel, strides, dilations, pads, spatial;
  InferInts(ctx, "kernel_shape", &kernel);
  InferInts(ctx, "strides", &strides);
  InferInts(ctx, "dilations", &dilations);
  InferInts(ctx, "pads", &pads);
  InferInts(ctx, "input_spatial", &spatial);
  std::vector<int64_t> shape;  // {} : the type alone
  if (first.size() == 4 && second.size() == 4 && kernel.size() == 2) {
    if (kKind == ConvKind::kForward) {  // x [N, H, W, C], w [K, kh, kw, C / group]
      Im2ColAttrs a;
      if (Im2ColCheck(kernel, strides, dilations, pads, true, &a).empty()) {
        int64_t ho = -1, wo = -1;
        if (first[1] >= 0 && first[2] >= 0 && !Im2ColOutputSize(a, first[1], first[2], &ho, &wo).empty()) ho = wo = -1;
        shape = {first[0], ho, wo, second[0]};
      }
    } else if (kKind == ConvKind::kData) {  // dy [N, Ho, Wo, K], w [K, kh, kw, C]
      if (spatial.size() == 2) shape = {first[0], spatial[0], spatial[1], second[3]};
    } else {  // x [N, H, W, C], dy [N, Ho, Wo, K]
      shape = {second[3], kernel[0], kernel[1], first[3]};
    }
  }
  Quietly([&] {
    if (shape.empty()) return ShapeInferOutputType(ctx, 0, type);
    ShapeInferOutput(ctx, 0, type, shape);
  });
  return nullptr;
}

template <ConvKind kKind>
struct ConvNhwcKernel : NodeKernel<ConvNhwcKernel<kKind>> {
  using Base = NodeKernel<ConvNhwcKernel<kKind>>;
  using Base::cuda;
  using Base::Fail;
  using Base::who;

  ConvNhwcKernel(const OrtKernelInfo* info, bool cuda) : Base(NameOf(kKind), info, cuda) {
    const std::string why = ReadIm2ColAttrs(info, &attrs);  // im2col_op.cc: kernel_shape, strides, dilations, pads
    if (!why.empty()) Fail(why);
    group = IntAttribute(info, "group", 1);
    if (group < 1) Fail("group must be a positive int, got " + std::to_string(group));
    if (kKind != ConvKind::kForward && group != 1) {
      Fail("group must be 1: the gradient ops compute group-1 convolutions' gradients only (a grouped "
           "convolution's gradients stay NCHW)");
    }
    if (kKind == ConvKind::kData) {
      bool found = false;
      spatial = IntsAttribute(info, "input_spatial", &found);
      if (!found || spatial.size() != 2 || spatial[0] < 1 || spatial[1] < 1) {
        Fail("input_spatial must be 2 positive ints (the input's H, W)");
      }
    }
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) graph = CudnnGraphApiAsked();
#endif
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    if (ctx.GetInputCount() != 2 || ctx.GetOutputCount() != 1) Fail("expected two inputs and one output");
    Ort::ConstValue in0 = ctx.GetInput(0), in1 = ctx.GetInput(1);
    auto info0 = in0.GetTensorTypeAndShapeInfo(), info1 = in1.GetTensorTypeAndShapeInfo();
    const auto type = info0.GetElementType();
    if (!IsFloatOrHalf(type) || info1.GetElementType() != type) {
      Fail("both inputs must be float32 or both float16, got ONNX element types " + std::to_string(static_cast<int>(type)) +
           " and " + std::to_string(static_cast<int>(info1.GetElementType())));
    }
    const auto s0 = info0.GetShape(), s1 = info1.GetShape();
    if (s0.size() != 4 || s1.size() != 4) Fail("both inputs must be 4-D, got shapes " + ShapeText(s0) + " and " + ShapeText(s1));
    ConvCall g;
    g.kind = kKind, g.nhwc = true, g.krsc = true, g.a = attrs;
    g.half = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    g.graph = graph;
    std::vector<int64_t> out_shape;
    if (kKind == ConvKind::kForward) {  // x [N, H, W, Cin], w [Cout, kh, kw, Cin / group]
      g.n = s0[0], g.h = s0[1], g.w_ = s0[2], g.cin = s0[3], g.cout = s1[0], g.group = group;
      if (g.cin % group != 0 || g.cout % group != 0) {
        Fail("group " + std::to_string(group) + " must divide the input channels (" + std::to_string(g.cin) +
             ") and the output channels (" + std::to_string(g.cout) + ")");
      }
      if (s1[1] != attrs.kh || s1[2] != attrs.kw || s1[3] != g.cin / group) {
        Fail("w has shape " + ShapeText(s1) + "; x " + ShapeText(s0) + ", kernel_shape and group need [Cout, " +
             std::to_string(attrs.kh) + ", " + std::to_string(attrs.kw) + ", " + std::to_string(g.cin / group) + "]");
      }
      Size(&g);
      g.x = in0.GetTensorRawData(), g.w = in1.GetTensorRawData();
      out_shape = {g.n, g.ho, g.wo, g.cout};
    } else if (kKind == ConvKind::kData) {  // dy [N, Ho, Wo, Cout], w [Cout, kh, kw, Cin]
      g.n = s0[0], g.h = spatial[0], g.w_ = spatial[1], g.cout = s0[3], g.cin = s1[3];
      if (s1[0] != g.cout || s1[1] != attrs.kh || s1[2] != attrs.kw) {
        Fail("w has shape " + ShapeText(s1) + "; dy " + ShapeText(s0) + " and kernel_shape need [" +
             std::to_string(g.cout) + ", " + std::to_string(attrs.kh) + ", " + std::to_string(attrs.kw) + ", Cin]");
      }
      Size(&g);
      if (s0[1] != g.ho || s0[2] != g.wo) {
        Fail("dy has shape " + ShapeText(s0) + "; input_spatial and the attributes give [" + std::to_string(g.n) + ", " +
             std::to_string(g.ho) + ", " + std::to_string(g.wo) + ", Cout]");
      }
      g.dy = in0.GetTensorRawData(), g.w = in1.GetTensorRawData();
      out_shape = {g.n, g.h, g.w_, g.cin};
    } else {  // x [N, H, W, Cin], dy [N, Ho, Wo, Cout]
      g.n = s0[0], g.h = s0[1], g.w_ = s0[2], g.cin = s0[3], g.cout = s1[3];
      Size(&g);
      if (s1[0] != g.n || s1[1] != g.ho || s1[2] != g.wo) {
        Fail("dy has shape " + ShapeText(s1) + ", x " + ShapeText(s0) + " and the attributes give [" + std::to_string(g.n) +
             ", " + std::to_string(g.ho) + ", " + std::to_string(g.wo) + ", Cout]");
      }
      g.x = in0.GetTensorRawData(), g.dy = in1.GetTensorRawData();
      out_shape = {g.cout, attrs.kh, attrs.kw, g.cin};
    }
    g.out = ctx.GetOutput(0, out_shape).GetTensorMutableRawData();
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) {
      // cuDNN pads top/left on both sides: the call's Ho, Wo must be what that gives
      const int64_t ho = (g.h + 2 * attrs.pt - (attrs.kh - 1) * attrs.dh - 1) / attrs.sh + 1;
      const int64_t wo = (g.w_ + 2 * attrs.pl - (attrs.kw - 1) * attrs.dw - 1) / attrs.sw + 1;
      if (ho != g.ho || wo != g.wo) {
        Fail("pads [top, left, bottom, right] must give the output size that the top and left pads on both sides give "
             "(cuDNN pads symmetrically)");
      }
      return CudnnConvolution(g, ctx.GetGPUComputeStream());
    }
#endif
    ConvNhwcCpu(g, ThreadPoolRunner(ctx));
  }

  void Size(ConvCall* g) const {
    const std::string why = Im2ColOutputSize(attrs, g->h, g->w_, &g->ho, &g->wo);
    if (!why.empty()) Fail(why);
  }

  Im2ColAttrs attrs;
  int64_t group = 1;
  std::vector<int64_t> spatial;
  bool graph = false;  // cuDNN's graph API (CudnnGraphApiAsked)
};

template <ConvKind kKind>
struct ConvNhwcCustomOp : OpBase<ConvNhwcCustomOp<kKind>, ConvNhwcKernel<kKind>> {
  explicit ConvNhwcCustomOp(bool cuda) : OpBase<ConvNhwcCustomOp<kKind>, ConvNhwcKernel<kKind>>(cuda) {
    OrtCustomOp::InferOutputShapeFn = InferConvNhwc<kKind>;
  }
  const char* GetName() const { return NameOf(kKind); }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

ONNXCAMPO_REGISTER_OPS(conv_nhwc, ConvNhwcCustomOp<ConvKind::kForward>, ConvNhwcCustomOp<ConvKind::kData>,
                       ConvNhwcCustomOp<ConvKind::kFilter>);

}  // namespace

}  // namespace onnxcampo
