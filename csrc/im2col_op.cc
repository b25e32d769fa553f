// The ai.onnxcampo::Im2Col custom op (CPU and CUDA): attributes, checks, output type and shape
// for ORT's graph, and the kernels of im2col_cpu.cc / im2col.cu. Registered by ops.cc.
//
//   Im2Col[kernel_shape, strides, dilations, pads](x [N, C, H, W]) -> columns [C*kh*kw, N*Ho*Wo]
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <functional>
#include <string>
#include <vector>

#include "im2col.h"

namespace onnxcampo {
namespace {

constexpr const char* kName = "Im2Col";

// The ints attribute `name`; *present = false (and {}) when the node does not have it.
std::vector<int64_t> KernelInts(const OrtKernelInfo* info, const char* name, bool* present) {
  const OrtApi& api = Ort::GetApi();
  size_t size = 0;
  OrtStatus* status = api.KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  if (status != nullptr) {
    api.ReleaseStatus(status);
    *present = false;
    return {};
  }
  std::vector<int64_t> values(size);
  if (size > 0) Ort::ThrowOnError(api.KernelInfoGetAttributeArray_int64(info, name, values.data(), &size));
  *present = true;
  return values;
}

// The same during ORT's shape inference (no exception escapes: the caller is C).
bool InferInts(const OrtShapeInferContext* ctx, const char* name, std::vector<int64_t>* values) {
  const OrtApi& api = Ort::GetApi();
  const OrtOpAttr* attr = nullptr;
  if (OrtStatus* status = api.ShapeInferContext_GetAttribute(ctx, name, &attr)) {
    api.ReleaseStatus(status);
    return false;
  }
  if (attr == nullptr) return false;
  size_t bytes = 0;
  if (OrtStatus* status = api.ReadOpAttr(attr, ORT_OP_ATTR_INTS, nullptr, 0, &bytes)) api.ReleaseStatus(status);
  values->assign(bytes / sizeof(int64_t), 0);
  if (bytes == 0) return true;
  if (OrtStatus* status = api.ReadOpAttr(attr, ORT_OP_ATTR_INTS, values->data(), bytes, &bytes)) {
    api.ReleaseStatus(status);
    return false;
  }
  return true;
}

std::vector<int64_t> Or(std::vector<int64_t> value, bool present, std::vector<int64_t> fallback) {
  return present ? value : fallback;
}

// Output type and shape for ORT's graph: the element type of x; [C*kh*kw, N*Ho*Wo] when x's
// four dims and the attributes are known and valid, else no shape (kernel creation and Compute
// report what is wrong; ORT ignores this function's status). Only numbers are set: an invented
// symbol could make ORT share buffers between outputs of different sizes.
OrtStatusPtr InferIm2Col(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  const OrtApi& api = Ort::GetApi();
  OrtTensorTypeAndShapeInfo* input = nullptr;  // owned by the context (Ort::ShapeInferContext does not free it)
  OrtTensorTypeAndShapeInfo* output = nullptr;
  auto release = [&] {
    if (output != nullptr) api.ReleaseTensorTypeAndShapeInfo(output);
    return nullptr;
  };
  auto ok = [&](OrtStatus* status) {
    if (status == nullptr) return true;
    api.ReleaseStatus(status);
    return false;
  };
  size_t count = 0;
  if (!ok(api.ShapeInferContext_GetInputCount(ctx, &count)) || count != 1 ||
      !ok(api.ShapeInferContext_GetInputTypeShape(ctx, 0, &input)) || input == nullptr) {
    return release();
  }
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  size_t rank = 0;
  if (!ok(api.GetTensorElementType(input, &type)) || !ok(api.GetDimensionsCount(input, &rank)) || rank != 4 ||
      (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)) {
    return release();
  }
  int64_t dims[4] = {0, 0, 0, 0};
  const char* symbols[4] = {nullptr, nullptr, nullptr, nullptr};
  if (!ok(api.GetDimensions(input, dims, 4)) || !ok(api.GetSymbolicDimensions(input, symbols, 4))) return release();
  for (int k = 0; k < 4; ++k) {
    if (dims[k] < 0 || (symbols[k] != nullptr && symbols[k][0] != '\0')) return release();
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
    return release();
  }
  const int64_t shape[2] = {dims[1] * a.kh * a.kw, dims[0] * ho * wo};
  if (ok(api.CreateTensorTypeAndShapeInfo(&output)) && ok(api.SetTensorElementType(output, type)) &&
      ok(api.SetDimensions(output, shape, 2))) {
    ok(api.ShapeInferContext_SetOutputTypeShape(ctx, 0, output));
  }
  return release();
}

struct Im2ColKernel {
  Im2ColKernel(const OrtKernelInfo* info, bool cuda) : cuda(cuda) {
    try {
      node = Ort::ConstKernelInfo(info).GetNodeName();
    } catch (const std::exception&) {
      node.clear();
    }
    bool have_kernel = false, have_strides = false, have_dilations = false, have_pads = false;
    const auto kernel_shape = KernelInts(info, "kernel_shape", &have_kernel);
    const auto strides = KernelInts(info, "strides", &have_strides);
    const auto dilations = KernelInts(info, "dilations", &have_dilations);
    const auto pads = KernelInts(info, "pads", &have_pads);
    const std::string why = Im2ColCheck(kernel_shape, Or(strides, have_strides, {1, 1}),
                                        Or(dilations, have_dilations, {1, 1}), Or(pads, have_pads, {0, 0, 0, 0}),
                                        have_kernel, &attrs);
    if (!why.empty()) Fail(why);
  }

  [[noreturn]] void Fail(const std::string& message) const {
    throw Ort::Exception(std::string(kName) + (node.empty() ? "" : " node '" + node + "'") + ": " + message,
                         ORT_INVALID_ARGUMENT);
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      Compute(context);
      return nullptr;
    } catch (const Ort::Exception& e) {
      return Ort::Status(e.what(), e.GetOrtErrorCode()).release();
    } catch (const std::exception& e) {
      return Ort::Status(e.what(), ORT_RUNTIME_EXCEPTION).release();
    }
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
    Im2ColCpu(args, Runner(ctx));
  }

  // Tasks on the session's intra-op pool (one task runs here, without the pool).
  static ParallelRunner Runner(Ort::KernelContext& ctx) {
    struct Job {
      const std::function<void(size_t)>* task;
    };
    return [&ctx](size_t count, const std::function<void(size_t)>& task) {
      if (count <= 1) {
        for (size_t i = 0; i < count; ++i) task(i);
        return;
      }
      Job job{&task};
      ctx.ParallelFor([](void* data, size_t i) { (*static_cast<Job*>(data)->task)(i); }, count, 0, &job);
    };
  }

  bool cuda;
  std::string node;
  Im2ColAttrs attrs;
};

// One input and one output of undefined type: ORT's custom-op type inference gives the output
// the input's type; InferIm2Col adds the shape.
struct Im2ColCustomOp : Ort::CustomOpBase<Im2ColCustomOp, Im2ColKernel, /*WithStatus=*/true> {
  explicit Im2ColCustomOp(bool cuda) : cuda_(cuda) { OrtCustomOp::InferOutputShapeFn = InferIm2Col; }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    try {
      *kernel = new Im2ColKernel(info, cuda_);
      return nullptr;
    } catch (const Ort::Exception& e) {
      return Ort::Status(e.what(), e.GetOrtErrorCode()).release();
    } catch (const std::exception& e) {
      return Ort::Status(e.what(), ORT_INVALID_ARGUMENT).release();
    }
  }
  const char* GetName() const { return kName; }
  const char* GetExecutionProviderType() const { return cuda_ ? "CUDAExecutionProvider" : "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }

 private:
  bool cuda_;
};

}  // namespace

const OrtCustomOp* Im2ColOp(bool cuda) {
  static const Im2ColCustomOp cpu(false);
#ifdef ONNXCAMPO_WITH_CUDA
  static const Im2ColCustomOp gpu(true);
  if (cuda) return &gpu;
#else
  (void)cuda;
#endif
  return &cpu;
}

}  // namespace onnxcampo
