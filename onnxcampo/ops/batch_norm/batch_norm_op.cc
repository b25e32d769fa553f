// The ONNX Runtime ops ai.onnxcampo::BatchNormStats and BatchNormGradSums (batch_norm.h has the
// arithmetic):
//
//   BatchNormStats[sizes = [P, Q, R], output_shape](x) -> (sum, centered)
//   BatchNormGradSums[sizes = [P, Q, R], output_shape](dy, c, invstd) -> (sum_dy, sum_dy_xhat)
//
// x, dy, c: float32 or float16, P*Q*R elements each (any shape), read as contiguous [P, Q, R]
// arrays; invstd: Q float32 values. The outputs: Q float32 values each, shaped `output_shape`
// (default [Q]). Registered for the CPU and (built with CUDA) the CUDA provider; ORT learns the
// outputs' type and shape from the attributes (InferChannelSums).
//
// CUDA workspace: a call whose plan splits the channels' rows takes its float32 partial states from
// the session's device allocator (KernelContext_GetScratchBuffer, as BlockReduceSum does); where
// ORT gives none, the call runs unsplit.
#include <string>
#include <vector>

#include "batch_norm.h"
#include "op_util.h"

namespace onnxcampo {
namespace {

constexpr char kStatsName[] = "BatchNormStats";
constexpr char kGradName[] = "BatchNormGradSums";

// sizes and output_shape as the kernels read them; "" or what is wrong.
std::string CheckAttributes(const std::vector<int64_t>& sizes, const std::vector<int64_t>& shape) {
  if (sizes.size() != 3) return "attribute 'sizes' must hold 3 ints [P, Q, R], got " + std::to_string(sizes.size());
  for (int64_t s : sizes) {
    if (s < 0) return "attribute 'sizes' must be >= 0, got " + ShapeText(sizes);
  }
  if (ElementCount(shape) != sizes[1]) {
    return "attribute 'output_shape' " + ShapeText(shape) + " must hold Q = " + std::to_string(sizes[1]) + " elements";
  }
  return "";
}

template <bool kGrad>
struct ChannelSumsKernel : NodeKernel<ChannelSumsKernel<kGrad>> {
  using Base = NodeKernel<ChannelSumsKernel<kGrad>>;
  using Base::Fail;

  ChannelSumsKernel(const OrtKernelInfo* info, bool cuda) : Base(kGrad ? kGradName : kStatsName, info, cuda) {
    bool found = false;
    const std::vector<int64_t> sizes = IntsAttribute(info, "sizes", &found);
    if (!found) Fail("attribute 'sizes' (ints [P, Q, R]) is missing");
    shape = IntsAttribute(info, "output_shape", &found);
    if (!found && sizes.size() == 3) shape = {sizes[1]};
    const std::string error = CheckAttributes(sizes, shape);
    if (!error.empty()) Fail(error);
    P = sizes[0], Q = sizes[1], R = sizes[2];
  }

  // Input `index`, float32 or float16 (`half` set) or float32 only (`half` null), of `count` elements.
  const void* Input(Ort::KernelContext& ctx, size_t index, const char* name, int64_t count, bool* half) const {
    Ort::ConstValue value = ctx.GetInput(index);
    auto info = value.GetTensorTypeAndShapeInfo();
    const auto type = info.GetElementType();
    if (half != nullptr ? !IsFloatOrHalf(type) : type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      Fail(std::string(name) + (half != nullptr ? " must be float32 or float16" : " must be float32"));
    }
    if (static_cast<int64_t>(info.GetElementCount()) != count) {
      Fail(std::string(name) + " " + ShapeText(info.GetShape()) + " must hold " + std::to_string(count) +
           " elements (sizes " + ShapeText({P, Q, R}) + ")");
    }
    if (half != nullptr) *half = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    return value.GetTensorRawData();
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    ChannelSumsArgs a;
    a.P = P, a.Q = Q, a.R = R;
    a.a = Input(ctx, 0, kGrad ? "dy" : "x", P * Q * R, &a.a_half);
    if (kGrad) {
      a.b = Input(ctx, 1, "c", P * Q * R, &a.b_half);
      a.scale = static_cast<const float*>(Input(ctx, 2, "invstd", Q, nullptr));
    }
    a.out0 = ctx.GetOutput(0, shape).GetTensorMutableData<float>();
    a.out1 = ctx.GetOutput(1, shape).GetTensorMutableData<float>();
#ifdef ONNXCAMPO_WITH_CUDA
    if (this->cuda) return ComputeCuda(ctx, a);
#endif
    if (kGrad) {
      BatchNormGradSumsCpu(a, ThreadPoolRunner(ctx));
    } else {
      BatchNormStatsCpu(a, ThreadPoolRunner(ctx));
    }
  }

#ifdef ONNXCAMPO_WITH_CUDA
  void ComputeCuda(Ort::KernelContext& ctx, const ChannelSumsArgs& a) const {
    void* stream = ctx.GetGPUComputeStream();
    const size_t bytes = ChannelSumsWorkspaceBytes(a);
    void* workspace = nullptr;
    std::unique_ptr<ScratchBuffer> buffer;
    if (bytes > 0) {
      buffer = std::make_unique<ScratchBuffer>(ctx.GetOrtKernelContext(), ctx.GetInput(0).GetTensorMemoryInfo(), bytes);
      workspace = buffer->get();  // null: ORT gives none, the call runs unsplit
    }
    if (kGrad) {
      BatchNormGradSumsCuda(a, workspace, stream);
    } else {
      BatchNormStatsCuda(a, workspace, stream);
    }
  }
#endif

  int64_t P = 0, Q = 0, R = 0;
  std::vector<int64_t> shape;
};

// Both outputs float32, shaped output_shape (or [Q]); attributes the kernel would refuse leave
// them to ORT (the kernel's creation then says what is wrong). Nothing unwinds into ORT.
OrtStatusPtr ORT_API_CALL InferChannelSums(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  Quietly([&] {
    std::vector<int64_t> sizes, shape;
    if (!InferInts(ctx, "sizes", &sizes) || sizes.size() != 3) return;
    if (!InferInts(ctx, "output_shape", &shape)) shape = {sizes[1]};
    if (!CheckAttributes(sizes, shape).empty()) return;
    ShapeInferOutput(ctx, 0, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, shape);
    ShapeInferOutput(ctx, 1, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, shape);
  });
  return nullptr;
}

struct BatchNormStatsOp : TypedOp<BatchNormStatsOp, ChannelSumsKernel<false>> {
  static constexpr ONNXTensorElementDataType kInputTypes[] = {kAnyType};
  static constexpr ONNXTensorElementDataType kOutputTypes[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                                                              ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
  explicit BatchNormStatsOp(bool cuda) : TypedOp(cuda, InferChannelSums) {}
  const char* GetName() const { return kStatsName; }
};

struct BatchNormGradSumsOp : TypedOp<BatchNormGradSumsOp, ChannelSumsKernel<true>> {
  static constexpr ONNXTensorElementDataType kInputTypes[] = {kAnyType, kAnyType, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
  static constexpr ONNXTensorElementDataType kOutputTypes[] = {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                                                              ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
  explicit BatchNormGradSumsOp(bool cuda) : TypedOp(cuda, InferChannelSums) {}
  const char* GetName() const { return kGradName; }
};

ONNXCAMPO_REGISTER_OPS(batch_norm, BatchNormStatsOp, BatchNormGradSumsOp);

}  // namespace

}  // namespace onnxcampo
