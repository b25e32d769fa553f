// The ai.onnxcampo channels-last max pooling ops (max_pool.h): attributes, checks, output types and
// shapes for ORT's graph, and the kernels (max_pool_cpu.cc, max_pool.cu). Registered with ONNXCAMPO_REGISTER_OPS.
//
// Types: x / dy are undefined inputs (one op per name and provider, as ConvNhwc), argmax is
// uint8. ORT's custom-op type inference then gives y / dx the type of the op's one undefined
// input and argmax uint8 (its only allowed type) when the model loads; InferMaxPool adds the
// shapes. It sets y's or dx's only: an OrtShapeInferContext does not tell how many outputs the
// node lists, and ORT's inference context does not check the index (onnxruntime 1.21 ... 1.32,
// graph.cc InferenceContextImpl::getOutputType), so writing output 1 of a node that lists only y
// would write past its output list. argmax's shape is y's, known at run time.
#include <string>
#include <vector>

#include "max_pool.h"
#include "op_util.h"

namespace onnxcampo {
namespace {

constexpr const char* kForwardName = "MaxPoolNhwc";
constexpr const char* kGradName = "MaxPoolNhwcGrad";

std::string TypeText(ONNXTensorElementDataType type) { return std::to_string(static_cast<int>(type)); }

// The dims of input k when it is a 4-D tensor ({} otherwise; -1 for an unknown or symbolic dim),
// its element type, and the symbols of its symbolic dims ("" for the others).
std::vector<int64_t> InferDims(OrtShapeInferContext* ctx, size_t k, ONNXTensorElementDataType* type,
                               std::vector<std::string>* symbols) {
  std::vector<int64_t> dims;
  if (!TryShapeInferInput(ctx, k, &dims, symbols, type) || dims.size() != 4) return {};
  return dims;
}

// Reads kernel_shape, strides and pads as shape inference sees them; false when they are invalid.
bool InferAttrs(const OrtShapeInferContext* ctx, MaxPoolAttrs* a) {
  std::vector<int64_t> kernel, strides, pads;
  const bool have_kernel = InferInts(ctx, "kernel_shape", &kernel);
  const bool have_strides = InferInts(ctx, "strides", &strides);
  const bool have_pads = InferInts(ctx, "pads", &pads);
  return MaxPoolCheck(kernel, have_kernel, strides, have_strides, pads, have_pads, a).empty();
}

// Output 0: x's (dy's) element type and [N, Ho, Wo, C] (forward) or [N, H, W, C] (gradient) when
// the attributes are valid and every output dim is known or symbolic (N and C keep their
// symbols). Otherwise nothing is set: ORT's own custom-op inference has given the type already,
// a -1 would be read as a size, and an info without dims as a scalar's shape.
template <bool kGrad>
OrtStatusPtr InferMaxPool(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  if (ShapeInferInputCount(ctx) != (kGrad ? 2u : 1u)) return nullptr;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<std::string> symbols;
  const std::vector<int64_t> in = InferDims(ctx, 0, &type, &symbols);
  if (!IsFloatOrHalf(type)) return nullptr;
  std::vector<int64_t> shape;
  MaxPoolAttrs a;
  const bool batch = in.size() == 4 && (in[0] >= 0 || !symbols[0].empty());
  const bool channels = in.size() == 4 && (in[3] >= 0 || !symbols[3].empty());
  if (batch && channels && InferAttrs(ctx, &a)) {
    std::vector<int64_t> spatial;
    int64_t ho = -1, wo = -1;
    if (kGrad) {
      if (InferInts(ctx, "input_spatial", &spatial) && spatial.size() == 2 && spatial[0] >= 1 && spatial[1] >= 1) {
        shape = {in[0], spatial[0], spatial[1], in[3]};
      }
    } else if (in[1] >= 0 && in[2] >= 0 && MaxPoolOutputSize(a, in[1], in[2], &ho, &wo).empty()) {
      shape = {in[0], ho, wo, in[3]};
    }
  }
  if (shape.empty()) return nullptr;
  const std::vector<const char*> names{symbols[0].c_str(), "", "", symbols[3].c_str()};
  Quietly([&] { ShapeInferOutput(ctx, 0, type, shape, names); });
  return nullptr;
}

// What both kernels read at creation: the pooling attributes (and input_spatial for the gradient).
template <typename Impl>
struct MaxPoolKernelBase : NodeKernel<Impl> {
  using NodeKernel<Impl>::Fail;

  MaxPoolKernelBase(const OrtKernelInfo* info, bool cuda, const char* name, bool grad)
      : NodeKernel<Impl>(name, info, cuda) {
    bool have_kernel = false, have_strides = false, have_pads = false, found = false;
    const auto kernel = IntsAttribute(info, "kernel_shape", &have_kernel);
    const auto strides = IntsAttribute(info, "strides", &have_strides);
    const auto pads = IntsAttribute(info, "pads", &have_pads);
    const std::string why = MaxPoolCheck(kernel, have_kernel, strides, have_strides, pads, have_pads, &attrs);
    if (!why.empty()) Fail(why);
    const auto dilations = IntsAttribute(info, "dilations", &found);
    for (int64_t d : dilations) {
      if (d != 1) Fail("dilations are not supported (the op pools dense windows); got " + ShapeText(dilations));
    }
    if (IntAttribute(info, "ceil_mode", 0) != 0) Fail("ceil_mode=1 is not supported (Ho, Wo round down)");
    if (grad) {
      spatial = IntsAttribute(info, "input_spatial", &found);
      if (!found || spatial.size() != 2 || spatial[0] < 1 || spatial[1] < 1) {
        Fail("input_spatial must be 2 positive ints (the input's H, W)");
      }
    }
  }

  // Ho, Wo of `g`'s H, W.
  void Size(MaxPoolShape* g) const {
    const std::string why = MaxPoolOutputSize(attrs, g->h, g->w, &g->ho, &g->wo);
    if (!why.empty()) Fail(why);
  }

  MaxPoolAttrs attrs;
  std::vector<int64_t> spatial;
};

struct MaxPoolNhwcKernel : MaxPoolKernelBase<MaxPoolNhwcKernel> {
  MaxPoolNhwcKernel(const OrtKernelInfo* info, bool cuda) : MaxPoolKernelBase(info, cuda, kForwardName, false) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const size_t outputs = ctx.GetOutputCount();
    if (ctx.GetInputCount() != 1 || outputs < 1 || outputs > 2) Fail("expected one input x and outputs y[, argmax]");
    Ort::ConstValue x = ctx.GetInput(0);
    auto info = x.GetTensorTypeAndShapeInfo();
    const auto type = info.GetElementType();
    if (!IsFloatOrHalf(type)) Fail("x must be float32 or float16, got ONNX element type " + TypeText(type));
    const auto shape = info.GetShape();
    if (shape.size() != 4) Fail("x must be 4-D [N, H, W, C], got shape " + ShapeText(shape));
    MaxPoolArgs g;
    g.a = attrs;
    g.half = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    g.n = shape[0], g.h = shape[1], g.w = shape[2], g.c = shape[3];
    Size(&g);
    const std::vector<int64_t> out_shape{g.n, g.ho, g.wo, g.c};
    g.x = x.GetTensorRawData();
    g.y = ctx.GetOutput(0, out_shape).GetTensorMutableRawData();
    if (outputs == 2) {  // listed; an empty name leaves it absent (a null value)
      Ort::UnownedValue argmax = ctx.GetOutput(1, out_shape);
      if (static_cast<OrtValue*>(argmax) != nullptr) g.argmax = argmax.GetTensorMutableData<uint8_t>();
    }
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return MaxPoolNhwcCuda(g, ctx.GetGPUComputeStream());
#endif
    MaxPoolNhwcCpu(g, ThreadPoolRunner(ctx));
  }
};

struct MaxPoolNhwcGradKernel : MaxPoolKernelBase<MaxPoolNhwcGradKernel> {
  MaxPoolNhwcGradKernel(const OrtKernelInfo* info, bool cuda) : MaxPoolKernelBase(info, cuda, kGradName, true) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    if (ctx.GetInputCount() != 2 || ctx.GetOutputCount() != 1) Fail("expected inputs (dy, argmax) and one output dx");
    Ort::ConstValue dy = ctx.GetInput(0), argmax = ctx.GetInput(1);
    auto dy_info = dy.GetTensorTypeAndShapeInfo(), argmax_info = argmax.GetTensorTypeAndShapeInfo();
    const auto type = dy_info.GetElementType();
    if (!IsFloatOrHalf(type)) Fail("dy must be float32 or float16, got ONNX element type " + TypeText(type));
    if (argmax_info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) {
      Fail("argmax must be uint8, got ONNX element type " + TypeText(argmax_info.GetElementType()));
    }
    const auto shape = dy_info.GetShape(), argmax_shape = argmax_info.GetShape();
    if (shape.size() != 4) Fail("dy must be 4-D [N, Ho, Wo, C], got shape " + ShapeText(shape));
    if (argmax_shape != shape) {
      Fail("argmax has shape " + ShapeText(argmax_shape) + ", dy " + ShapeText(shape) + ": they must agree");
    }
    MaxPoolGradArgs g;
    g.a = attrs;
    g.half = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    g.n = shape[0], g.h = spatial[0], g.w = spatial[1], g.c = shape[3];
    Size(&g);
    if (shape[1] != g.ho || shape[2] != g.wo) {
      Fail("dy has shape " + ShapeText(shape) + "; input_spatial " + ShapeText(spatial) + " and the attributes give [" +
           std::to_string(g.n) + ", " + std::to_string(g.ho) + ", " + std::to_string(g.wo) + ", C]");
    }
    g.dy = dy.GetTensorRawData();
    g.argmax = argmax.GetTensorData<uint8_t>();
    g.dx = ctx.GetOutput(0, {g.n, g.h, g.w, g.c}).GetTensorMutableRawData();
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return MaxPoolNhwcGradCuda(g, ctx.GetGPUComputeStream());
#endif
    MaxPoolNhwcGradCpu(g, ThreadPoolRunner(ctx));
  }
};

// MaxPoolNhwc(x) -> (y, argmax): argmax optional (ORT passes a null value where it is absent).
struct MaxPoolNhwcCustomOp : TypedOp<MaxPoolNhwcCustomOp, MaxPoolNhwcKernel> {
  static constexpr ONNXTensorElementDataType kInputTypes[] = {kAnyType};
  static constexpr ONNXTensorElementDataType kOutputTypes[] = {kAnyType, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8};
  explicit MaxPoolNhwcCustomOp(bool cuda) : TypedOp(cuda, InferMaxPool<false>) {}
  const char* GetName() const { return kForwardName; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t index) const {
    return index == 1 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
};

// MaxPoolNhwcGrad(dy, argmax) -> dx.
struct MaxPoolNhwcGradCustomOp : TypedOp<MaxPoolNhwcGradCustomOp, MaxPoolNhwcGradKernel> {
  static constexpr ONNXTensorElementDataType kInputTypes[] = {kAnyType, ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8};
  static constexpr ONNXTensorElementDataType kOutputTypes[] = {kAnyType};
  explicit MaxPoolNhwcGradCustomOp(bool cuda) : TypedOp(cuda, InferMaxPool<true>) {}
  const char* GetName() const { return kGradName; }
};

ONNXCAMPO_REGISTER_OPS(max_pool, MaxPoolNhwcCustomOp, MaxPoolNhwcGradCustomOp);

}  // namespace

}  // namespace onnxcampo
