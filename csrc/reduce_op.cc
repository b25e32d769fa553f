// The ONNX Runtime op ai.onnxcampo::BlockReduceSum (reduce.h has the arithmetic):
//
//   BlockReduceSum[sizes = [P, Q, R], output_type = 1 | 10, output_shape](x) -> y
//
// x: float32 or float16, any shape of P*Q*R elements, read as a contiguous [P, Q, R] array;
// y: the sum over axes 0 and 2, Q elements of `output_type` (1 float32, the default; 10
// float16) shaped `output_shape` (default [Q]). Accumulation in float32, one rounding at the end.
//
// Registered for the CPU and (built with CUDA) the CUDA provider by AddBlockReduceSumOps, which
// ops.cc calls; ORT learns y's type and shape from the attributes (InferBlockReduceSum).
//
// CUDA workspace: a call whose plan splits the reduction takes partials * Q float32 values from
// the session's device allocator (KernelContext_GetScratchBuffer, ORT's arena, ordered on the
// compute stream like the scratch buffers of ORT's own kernels) and hands them back after the
// launches; with the arena nothing reaches cudaMalloc once it has grown, also while a CUDA graph
// is captured. Where ORT gives no buffer, the call runs unsplit (one kernel, less parallel).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <functional>
#include <string>
#include <vector>

#include "reduce.h"

namespace onnxcampo {
namespace {

constexpr const char* kName = "BlockReduceSum";
constexpr int64_t kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr int64_t kHalf = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;

[[noreturn]] void Fail(const std::string& who, const std::string& message) {
  throw Ort::Exception(who + ": " + message, ORT_INVALID_ARGUMENT);
}

std::vector<int64_t> Ints(const OrtKernelInfo* info, const char* name, bool* found) {
  const OrtApi& api = Ort::GetApi();
  size_t size = 0;
  OrtStatus* status = api.KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  std::vector<int64_t> values(size);
  if (status == nullptr && size > 0) status = api.KernelInfoGetAttributeArray_int64(info, name, values.data(), &size);
  *found = status == nullptr;
  if (status != nullptr) api.ReleaseStatus(status);
  return *found ? values : std::vector<int64_t>{};
}

std::string ShapeText(const std::vector<int64_t>& dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

// The type y is written in: output_type, or float32 for a float16 y when x was planned in float16
// (`input_type`) and arrives as float32 (ORT's CPU provider running the node in fp32).
int64_t WrittenType(int64_t declared, ONNXTensorElementDataType actual, int64_t output_type) {
  const bool in_float32 = declared == kHalf && actual == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  return in_float32 && output_type == kHalf ? kFloat : output_type;
}

// sizes, output_type and output_shape checked as the kernel and the shape inference read them;
// returns "" or what is wrong.
std::string CheckAttributes(const std::vector<int64_t>& sizes, int64_t output_type, const std::vector<int64_t>& shape) {
  if (sizes.size() != 3) return "attribute 'sizes' must hold 3 ints [P, Q, R], got " + std::to_string(sizes.size());
  for (int64_t s : sizes) {
    if (s < 0) return "attribute 'sizes' must be >= 0, got " + ShapeText(sizes);
  }
  if (output_type != kFloat && output_type != kHalf) {
    return "attribute 'output_type' must be 1 (float32) or 10 (float16), got " + std::to_string(output_type);
  }
  int64_t count = 1;
  for (int64_t d : shape) {
    if (d < 0) return "attribute 'output_shape' must be >= 0, got " + ShapeText(shape);
    count *= d;
  }
  if (count != sizes[1]) {
    return "attribute 'output_shape' " + ShapeText(shape) + " holds " + std::to_string(count) + " elements, Q is " +
           std::to_string(sizes[1]);
  }
  return "";
}

struct BlockReduceSumKernel {
  BlockReduceSumKernel(const OrtKernelInfo* info, bool cuda) : cuda(cuda) {
    Ort::ConstKernelInfo kernel_info(info);
    std::string node;
    try {
      node = kernel_info.GetNodeName();
    } catch (const Ort::Exception&) {
    }
    who = std::string(kName) + (node.empty() ? "" : " node '" + node + "'");
    bool found = false;
    const std::vector<int64_t> sizes = Ints(info, "sizes", &found);
    if (!found) Fail(who, "attribute 'sizes' (ints [P, Q, R]) is missing");
    output_type = kFloat;
    OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_int64(info, "output_type", &output_type);
    if (status != nullptr) {  // absent: float32
      Ort::GetApi().ReleaseStatus(status);
      output_type = kFloat;
    }
    shape = Ints(info, "output_shape", &found);
    if (!found && sizes.size() == 3) shape = {sizes[1]};
    const std::string error = CheckAttributes(sizes, output_type, shape);
    if (!error.empty()) Fail(who, error);
    P = sizes[0], Q = sizes[1], R = sizes[2];
    int64_t declared = 0;
    status = Ort::GetApi().KernelInfoGetAttribute_int64(info, "input_type", &declared);
    if (status != nullptr) {  // absent: no fp32 run
      Ort::GetApi().ReleaseStatus(status);
      declared = 0;
    }
    const auto actual = kernel_info.GetInputTypeInfo(0).GetTensorTypeAndShapeInfo().GetElementType();
    output_type = WrittenType(declared, actual, output_type);
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    try {
      Compute(context);
      return nullptr;
    } catch (const Ort::Exception& e) {
      return Ort::Status(e.what(), e.GetOrtErrorCode()).release();
    } catch (const std::exception& e) {
      return Ort::Status((who + ": " + e.what()).c_str(), ORT_RUNTIME_EXCEPTION).release();
    }
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue input = ctx.GetInput(0);
    auto info = input.GetTensorTypeAndShapeInfo();
    const auto type = info.GetElementType();
    if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
      Fail(who, "x must be float32 or float16");
    }
    const int64_t count = static_cast<int64_t>(info.GetElementCount());
    if (count != P * Q * R) {
      Fail(who, "x " + ShapeText(info.GetShape()) + " holds " + std::to_string(count) + " elements, sizes " +
                    ShapeText({P, Q, R}) + " " + std::to_string(P * Q * R));
    }
    Ort::UnownedValue output = ctx.GetOutput(0, shape);
    if (output.GetTensorTypeAndShapeInfo().GetElementType() != output_type) {
      Fail(who, "y has element type " + std::to_string(output.GetTensorTypeAndShapeInfo().GetElementType()) +
                    ", output_type says " + std::to_string(output_type));
    }
    BlockReduceArgs args;
    args.x = input.GetTensorRawData();
    args.x_half = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    args.y = output.GetTensorMutableRawData();
    args.y_half = output_type == kHalf;
    args.P = P, args.Q = Q, args.R = R;
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return ComputeCuda(ctx, input, args);
#endif
    BlockReduceSumCpu(args, [&ctx](size_t n, const std::function<void(size_t)>& task) {
      if (n <= 1) {
        for (size_t i = 0; i < n; ++i) task(i);
        return;
      }
      struct Job {
        const std::function<void(size_t)>* task;
      } job{&task};
      ctx.ParallelFor([](void* data, size_t i) { (*static_cast<Job*>(data)->task)(i); }, n, 0, &job);
    });
  }

#ifdef ONNXCAMPO_WITH_CUDA
  void ComputeCuda(Ort::KernelContext& ctx, Ort::ConstValue& input, const BlockReduceArgs& args) const {
    void* stream = ctx.GetGPUComputeStream();
    BlockReducePlan plan = PlanBlockReduceCuda(args, true);
    if (plan.workspace_bytes == 0) return BlockReduceSumCuda(args, plan, nullptr, stream);
    const OrtApi& api = Ort::GetApi();
    Ort::ConstMemoryInfo memory = input.GetTensorMemoryInfo();  // the device allocator x lives in
    OrtAllocator* allocator = nullptr;
    void* workspace = nullptr;
    OrtStatus* status = api.KernelContext_GetAllocator(ctx.GetOrtKernelContext(), memory, &allocator);
    if (status == nullptr) status = api.KernelContext_GetScratchBuffer(ctx.GetOrtKernelContext(), memory, plan.workspace_bytes, &workspace);
    if (status != nullptr || allocator == nullptr || workspace == nullptr) {  // no buffer: unsplit
      if (status != nullptr) api.ReleaseStatus(status);
      if (allocator != nullptr) api.ReleaseAllocator(allocator);
      return BlockReduceSumCuda(args, PlanBlockReduceCuda(args, false), nullptr, stream);
    }
    try {
      BlockReduceSumCuda(args, plan, workspace, stream);
    } catch (...) {
      allocator->Free(allocator, workspace);
      api.ReleaseAllocator(allocator);
      throw;
    }
    // Freed once the launches are queued: the arena hands the buffer out again to work queued
    // after them on the stream (what ORT's own kernels do with their scratch buffers).
    allocator->Free(allocator, workspace);
    api.ReleaseAllocator(allocator);
  }
#endif

  int64_t P = 0, Q = 0, R = 0;
  int64_t output_type = kFloat;
  std::vector<int64_t> shape;
  std::string who;
  bool cuda;
};

bool InferInts(OrtShapeInferContext* ctx, const char* name, std::vector<int64_t>* values) {
  const OrtApi& api = Ort::GetApi();
  const OrtOpAttr* attr = nullptr;
  OrtStatus* status = api.ShapeInferContext_GetAttribute(ctx, name, &attr);
  if (status != nullptr || attr == nullptr) {
    if (status != nullptr) api.ReleaseStatus(status);
    return false;
  }
  size_t bytes = 0;
  status = api.ReadOpAttr(attr, ORT_OP_ATTR_INTS, nullptr, 0, &bytes);  // asks for the size
  if (status != nullptr) api.ReleaseStatus(status);
  values->assign(bytes / sizeof(int64_t), 0);
  if (values->empty()) return true;
  status = api.ReadOpAttr(attr, ORT_OP_ATTR_INTS, values->data(), bytes, &bytes);
  if (status != nullptr) {
    api.ReleaseStatus(status);
    return false;
  }
  return true;
}

bool InferInt(OrtShapeInferContext* ctx, const char* name, int64_t* value) {
  const OrtApi& api = Ort::GetApi();
  const OrtOpAttr* attr = nullptr;
  OrtStatus* status = api.ShapeInferContext_GetAttribute(ctx, name, &attr);
  if (status != nullptr || attr == nullptr) {
    if (status != nullptr) api.ReleaseStatus(status);
    return false;
  }
  size_t bytes = 0;
  status = api.ReadOpAttr(attr, ORT_OP_ATTR_INT, value, sizeof(*value), &bytes);
  if (status != nullptr) {
    api.ReleaseStatus(status);
    return false;
  }
  return true;
}

// y's element type from output_type and its shape from output_shape (or [Q]). With `input_type`
// (the type x was planned in) float16 and x arriving as float32, ORT's CPU provider runs the
// node in fp32 (its InsertCastTransformer casts around an fp16 node whose neighbours have no
// fp16 CPU kernels, and makes the node's fp16 tensors fp32): a float16 y is then written as
// float32, the float32 sum itself (ORT casts it where a reader needs float16). Attributes that
// the kernel would refuse leave y as ORT's own inference left it (x's type, no shape); the
// kernel's creation then says what is wrong. ORT ignores the returned status; nothing throws.
OrtStatusPtr ORT_API_CALL InferBlockReduceSum(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  const OrtApi& api = Ort::GetApi();
  OrtTensorTypeAndShapeInfo* out = nullptr;
  try {
    std::vector<int64_t> sizes, shape;
    int64_t output_type = kFloat, declared = 0;
    if (!InferInts(ctx, "sizes", &sizes) || sizes.size() != 3) return nullptr;
    if (!InferInt(ctx, "output_type", &output_type)) output_type = kFloat;
    if (!InferInts(ctx, "output_shape", &shape)) shape = {sizes[1]};
    if (!CheckAttributes(sizes, output_type, shape).empty()) return nullptr;
    if (InferInt(ctx, "input_type", &declared)) {
      OrtTensorTypeAndShapeInfo* x = nullptr;  // owned by the context
      ONNXTensorElementDataType actual = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(ctx, 0, &x));
      Ort::ThrowOnError(api.GetTensorElementType(x, &actual));
      output_type = WrittenType(declared, actual, output_type);
    }
    Ort::ThrowOnError(api.CreateTensorTypeAndShapeInfo(&out));
    Ort::ThrowOnError(api.SetTensorElementType(out, static_cast<ONNXTensorElementDataType>(output_type)));
    Ort::ThrowOnError(api.SetDimensions(out, shape.data(), shape.size()));
    Ort::ThrowOnError(api.ShapeInferContext_SetOutputTypeShape(ctx, 0, out));
  } catch (...) {  // nothing may unwind into ORT
  }
  if (out != nullptr) api.ReleaseTensorTypeAndShapeInfo(out);
  return nullptr;
}

// One input of any type (float16 or float32, checked by the kernel) and one output whose type
// the inference function sets.
struct BlockReduceSumOp : Ort::CustomOpBase<BlockReduceSumOp, BlockReduceSumKernel, /*WithStatus=*/true> {
  explicit BlockReduceSumOp(bool cuda) : cuda_(cuda) { OrtCustomOp::InferOutputShapeFn = InferBlockReduceSum; }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    try {
      *kernel = new BlockReduceSumKernel(info, cuda_);
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

// Called once by ops.cc's Library: the ops live as long as the process.
void AddBlockReduceSumOps(Ort::CustomOpDomain& domain) {
  static BlockReduceSumOp cpu{false};
  domain.Add(&cpu);
#ifdef ONNXCAMPO_WITH_CUDA
  static BlockReduceSumOp cuda{true};
  domain.Add(&cuda);
#endif
}

}  // namespace onnxcampo

// The CUDA launch plan of a call, for the tests (tests/ops/test_block_reduce.py): fills out[0..15]
// with kind, vec, tx, ty, blocks_x, chunks, rows, lanes, items, p_chunks, p_len, r_chunks, r_len,
// blocks, partials, workspace_bytes; returns 16 (the count written).
extern "C" __attribute__((visibility("default"))) int OnnxcampoBlockReducePlan(int64_t P, int64_t Q, int64_t R, int x_half,
                                                                                  int x_align, int sms, int workspace,
                                                                                  int64_t* out) {
  const onnxcampo::BlockReducePlan p =
      onnxcampo::PlanBlockReduce(P, Q, R, x_half != 0, x_align, sms, workspace != 0);
  const int64_t values[] = {p.kind,  p.vec,      p.tx,    p.ty,     p.blocks_x, p.chunks,   p.rows,
                            p.lanes, p.items,    p.p_chunks, p.p_len, p.r_chunks, p.r_len, p.blocks,
                            p.partials, static_cast<int64_t>(p.workspace_bytes)};
  for (int i = 0; i < 16; ++i) out[i] = values[i];
  return 16;
}
