// The ONNX Runtime op ai.onnxcampo::NchwToNhwc (to_nhwc.h has the arithmetic):
//
//   NchwToNhwc[to = 1 | 10, channels](x) -> y
//
// x: float32 or float16 [N, C, S...] (rank >= 3); y: `to`'s type (1 float32, 10 float16),
// [N, S..., channels], channels >= C (default C) with zeros in the channels past C. Registered for
// the CPU and (built with CUDA) the CUDA provider (ONNXCAMPO_REGISTER_OPS below); ORT
// learns y's type and shape from the attributes and x's shape (InferNchwToNhwc).
#include <string>
#include <vector>

#include "op_util.h"
#include "to_nhwc.h"

namespace onnxcampo {
namespace {

constexpr char kName[] = "NchwToNhwc";
constexpr int64_t kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr int64_t kHalf = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;

// "" or what is wrong with `to` and `channels` (-1: absent, C then) for an input of `c` channels
// (-1: not known yet).
std::string CheckAttributes(int64_t to, int64_t channels, int64_t c) {
  if (to != kFloat && to != kHalf) return "attribute 'to' must be 1 (float32) or 10 (float16), got " + std::to_string(to);
  if (channels != -1 && channels < 1) return "attribute 'channels' must be >= 1, got " + std::to_string(channels);
  if (channels != -1 && c >= 0 && channels < c) {
    return "attribute 'channels' (" + std::to_string(channels) + ") is below x's " + std::to_string(c) + " channels";
  }
  return "";
}

struct NchwToNhwcKernel : NodeKernel<NchwToNhwcKernel> {
  NchwToNhwcKernel(const OrtKernelInfo* info, bool cuda) : NodeKernel<NchwToNhwcKernel>(kName, info, cuda) {
    to = IntAttribute(info, "to", -1);
    channels = IntAttribute(info, "channels", -1);
    const std::string error = CheckAttributes(to, channels, -1);
    if (!error.empty()) Fail(error);
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue x = ctx.GetInput(0);
    auto info = x.GetTensorTypeAndShapeInfo();
    const auto type = info.GetElementType();
    if (!IsFloatOrHalf(type)) Fail("x must be float32 or float16");
    const std::vector<int64_t> shape = info.GetShape();
    if (shape.size() < 3) Fail("x must be [N, C, spatial...] (rank >= 3), got " + ShapeText(shape));
    const std::string error = CheckAttributes(to, channels, shape[1]);
    if (!error.empty()) Fail(error);
    ToNhwcArgs g;
    g.x = x.GetTensorRawData();
    g.x_half = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    g.y_half = to == kHalf;
    g.n = shape[0], g.c = shape[1], g.s = 1;
    for (size_t d = 2; d < shape.size(); ++d) g.s *= shape[d];
    g.channels = channels == -1 ? g.c : channels;
    std::vector<int64_t> out{shape[0]};
    out.insert(out.end(), shape.begin() + 2, shape.end());
    out.push_back(g.channels);
    g.y = ctx.GetOutput(0, out).GetTensorMutableRawData();
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return ToNhwcCuda(g, ctx.GetGPUComputeStream());
#endif
    ToNhwcCpu(g, ThreadPoolRunner(ctx));
  }

  int64_t to = kHalf, channels = -1;
};

// y: `to`'s type, [N, S..., channels] from x's dims (symbols kept; C must be known when
// `channels` is absent). Attributes the kernel would refuse leave y as ORT's own inference left
// it; the kernel's creation then says what is wrong. ORT ignores the returned status.
OrtStatusPtr ORT_API_CALL InferNchwToNhwc(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  const OrtApi& api = Ort::GetApi();
  Quietly([&] {  // nothing may unwind into ORT
    int64_t to = -1, channels = -1;
    if (!InferInt(ctx, "to", &to)) return;
    InferInt(ctx, "channels", &channels);
    OrtTensorTypeAndShapeInfo* x = nullptr;  // owned by the context
    Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(ctx, 0, &x));
    size_t rank = 0;
    Ort::ThrowOnError(api.GetDimensionsCount(x, &rank));
    if (rank < 3) return;
    std::vector<int64_t> dims(rank);
    std::vector<const char*> names(rank, nullptr);
    Ort::ThrowOnError(api.GetDimensions(x, dims.data(), rank));
    Ort::ThrowOnError(api.GetSymbolicDimensions(x, names.data(), rank));
    if (!CheckAttributes(to, channels, dims[1]).empty() || (channels == -1 && dims[1] < 0)) return;
    std::vector<int64_t> shape{dims[0]};
    std::vector<const char*> symbols{names[0] != nullptr ? names[0] : ""};
    for (size_t d = 2; d < rank; ++d) {
      shape.push_back(dims[d]);
      symbols.push_back(names[d] != nullptr ? names[d] : "");
    }
    shape.push_back(channels == -1 ? dims[1] : channels);
    symbols.push_back("");
    ShapeInferOutput(ctx, 0, static_cast<ONNXTensorElementDataType>(to), shape, symbols);
  });
  return nullptr;
}

// One input of either float type (checked by the kernel), one output whose type the inference
// function sets.
using NchwToNhwcOp = UntypedUnaryOp<kName, NchwToNhwcKernel, InferNchwToNhwc>;

ONNXCAMPO_REGISTER_OPS(to_nhwc, NchwToNhwcOp);

}  // namespace
}  // namespace onnxcampo
