// Helpers the ONNX Runtime op files (<unit>/<unit>_op.cc) share:
// attribute readers for kernel creation and shape inference, the errors a kernel raises, the
// wrapper that turns exceptions into an OrtStatus, and the registration boilerplate of an op
// class. Includes <onnxruntime_cxx_api.h> with ORT_API_MANUAL_INIT defined (the library does not
// link libonnxruntime: common/library.cc initialises the API from RegisterCustomOps).
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ints_text.h"
#include "parallel.h"

namespace onnxcampo {

constexpr const char* kCpuProvider = "CPUExecutionProvider";
constexpr const char* kCudaProvider = "CUDAExecutionProvider";

// Throws an ORT_INVALID_ARGUMENT Ort::Exception "<who>: <message>".
[[noreturn]] inline void Fail(const std::string& who, const std::string& message) {
  throw Ort::Exception(who + ": " + message, ORT_INVALID_ARGUMENT);
}

// "<op> node '<name>'", or "<op>" when the node has no name (or ORT cannot tell it).
inline std::string NodeWho(const char* op, const OrtKernelInfo* info) {
  std::string node;
  try {
    node = Ort::ConstKernelInfo(info).GetNodeName();
  } catch (const Ort::Exception&) {
  }
  return std::string(op) + (node.empty() ? "" : " node '" + node + "'");
}

// ---- attributes at kernel creation, read without throwing ----------------------------------

// An array attribute read with `read` (an OrtApi KernelInfoGetAttributeArray_*): `found` says
// whether the node has it ({} when not).
template <typename T, typename Read>
std::vector<T> ArrayAttribute(Read read, const OrtKernelInfo* info, const char* name, bool* found) {
  size_t size = 0;
  OrtStatus* status = read(info, name, nullptr, &size);
  std::vector<T> values(size);
  if (status == nullptr && size > 0) status = read(info, name, values.data(), &size);
  *found = status == nullptr;
  if (status != nullptr) Ort::GetApi().ReleaseStatus(status);
  return *found ? values : std::vector<T>{};
}

// A scalar attribute read with `read` (an OrtApi KernelInfoGetAttribute_*), `fallback` when the
// node does not have it.
template <typename T, typename Read>
T ScalarAttribute(Read read, const OrtKernelInfo* info, const char* name, T fallback) {
  T value = fallback;
  OrtStatus* status = read(info, name, &value);
  if (status != nullptr) {
    Ort::GetApi().ReleaseStatus(status);
    return fallback;
  }
  return value;
}

inline std::vector<int64_t> IntsAttribute(const OrtKernelInfo* info, const char* name, bool* found) {
  return ArrayAttribute<int64_t>(Ort::GetApi().KernelInfoGetAttributeArray_int64, info, name, found);
}

inline std::vector<float> FloatsAttribute(const OrtKernelInfo* info, const char* name, bool* found) {
  return ArrayAttribute<float>(Ort::GetApi().KernelInfoGetAttributeArray_float, info, name, found);
}

inline int64_t IntAttribute(const OrtKernelInfo* info, const char* name, int64_t fallback) {
  return ScalarAttribute<int64_t>(Ort::GetApi().KernelInfoGetAttribute_int64, info, name, fallback);
}

inline float FloatAttribute(const OrtKernelInfo* info, const char* name, float fallback) {
  return ScalarAttribute<float>(Ort::GetApi().KernelInfoGetAttribute_float, info, name, fallback);
}

// ---- attributes in shape inference, read with the C API (statuses released; no throw) -------

// True when `status` is null (success); a status is released.
inline bool Succeeded(OrtStatus* status) {
  if (status == nullptr) return true;
  Ort::GetApi().ReleaseStatus(status);
  return false;
}

// The attribute `name` of the node, or null when it has none.
inline const OrtOpAttr* InferAttribute(const OrtShapeInferContext* ctx, const char* name) {
  const OrtOpAttr* attr = nullptr;
  if (!Succeeded(Ort::GetApi().ShapeInferContext_GetAttribute(ctx, name, &attr))) return nullptr;
  return attr;
}

inline bool InferInts(const OrtShapeInferContext* ctx, const char* name, std::vector<int64_t>* values) {
  const OrtOpAttr* attr = InferAttribute(ctx, name);
  if (attr == nullptr) return false;
  size_t bytes = 0;
  Succeeded(Ort::GetApi().ReadOpAttr(attr, ORT_OP_ATTR_INTS, nullptr, 0, &bytes));  // asks for the size
  values->assign(bytes / sizeof(int64_t), 0);
  if (values->empty()) return true;
  return Succeeded(Ort::GetApi().ReadOpAttr(attr, ORT_OP_ATTR_INTS, values->data(), bytes, &bytes));
}

inline bool InferInt(const OrtShapeInferContext* ctx, const char* name, int64_t* value) {
  const OrtOpAttr* attr = InferAttribute(ctx, name);
  if (attr == nullptr) return false;
  size_t bytes = 0;
  return Succeeded(Ort::GetApi().ReadOpAttr(attr, ORT_OP_ATTR_INT, value, sizeof(*value), &bytes));
}

// The node's input count in shape inference (0 where ORT cannot tell).
inline size_t ShapeInferInputCount(OrtShapeInferContext* ctx) {
  size_t count = 0;
  return Succeeded(Ort::GetApi().ShapeInferContext_GetInputCount(ctx, &count)) ? count : 0;
}

// An input's shape in shape inference: dims[d] >= 0 a number, -1 with names[d] a symbol, -1
// with "" unknown.
inline void ShapeInferInput(OrtShapeInferContext* ctx, size_t index, std::vector<int64_t>* dims, std::vector<std::string>* names,
                     ONNXTensorElementDataType* type) {
  const OrtApi& api = Ort::GetApi();
  OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
  Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(ctx, index, &info));
  if (info == nullptr) throw Ort::Exception("shape inference: input without a type and shape", ORT_FAIL);
  Ort::ThrowOnError(api.GetTensorElementType(info, type));
  size_t rank = 0;
  Ort::ThrowOnError(api.GetDimensionsCount(info, &rank));
  dims->assign(rank, -1);
  std::vector<const char*> symbols(rank, nullptr);
  if (rank > 0) {
    Ort::ThrowOnError(api.GetDimensions(info, dims->data(), rank));
    Ort::ThrowOnError(api.GetSymbolicDimensions(info, symbols.data(), rank));
  }
  names->assign(rank, "");
  for (size_t d = 0; d < rank; ++d) {
    if (symbols[d] != nullptr && symbols[d][0] != '\0') {
      (*names)[d] = symbols[d];
      (*dims)[d] = -1;
    }
  }
}

// The dims of input `index` in shape inference (-1 for an unknown or symbolic dim).
inline std::vector<int64_t> ShapeInferInputDims(OrtShapeInferContext* ctx, size_t index) {
  std::vector<int64_t> dims;
  std::vector<std::string> names;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  ShapeInferInput(ctx, index, &dims, &names, &type);
  return dims;
}

// Declares output `index` of the node as `type` with, when given, `dims` (-1: unknown; null: the
// type alone, no shape) and `symbols` (a name per dimension, "" for none).
inline void SetInferredOutput(OrtShapeInferContext* ctx, size_t index, ONNXTensorElementDataType type,
                              const std::vector<int64_t>* dims, const std::vector<const char*>* symbols) {
  const OrtApi& api = Ort::GetApi();
  OrtTensorTypeAndShapeInfo* info = nullptr;
  Ort::ThrowOnError(api.CreateTensorTypeAndShapeInfo(&info));
  std::unique_ptr<OrtTensorTypeAndShapeInfo, void (*)(OrtTensorTypeAndShapeInfo*)> owned(
      info, [](OrtTensorTypeAndShapeInfo* p) { Ort::GetApi().ReleaseTensorTypeAndShapeInfo(p); });
  Ort::ThrowOnError(api.SetTensorElementType(info, type));
  if (dims != nullptr) Ort::ThrowOnError(api.SetDimensions(info, dims->data(), dims->size()));
  if (symbols != nullptr) {
    Ort::ThrowOnError(api.SetSymbolicDimensions(info, const_cast<const char**>(symbols->data()), symbols->size()));
  }
  Ort::ThrowOnError(api.ShapeInferContext_SetOutputTypeShape(ctx, index, info));
}

inline void ShapeInferOutput(OrtShapeInferContext* ctx, size_t index, ONNXTensorElementDataType type,
                             const std::vector<int64_t>& dims, const std::vector<const char*>& symbols) {
  SetInferredOutput(ctx, index, type, &dims, &symbols);
}

// The same with numbers (and -1) only, no symbols.
inline void ShapeInferOutput(OrtShapeInferContext* ctx, size_t index, ONNXTensorElementDataType type,
                             const std::vector<int64_t>& dims) {
  SetInferredOutput(ctx, index, type, &dims, nullptr);
}

// The type alone, no shape (an info without dims would read as a scalar's shape).
inline void ShapeInferOutputType(OrtShapeInferContext* ctx, size_t index, ONNXTensorElementDataType type) {
  SetInferredOutput(ctx, index, type, nullptr, nullptr);
}

// Runs `body` (shape inference calls) in a noexcept InferOutputShapeFn: false when it threw,
// nothing unwinding into ORT (the kernel says what is wrong).
template <typename Body>
bool Quietly(Body&& body) noexcept {
  try {
    body();
    return true;
  } catch (...) {
    return false;
  }
}

// ShapeInferInput in a noexcept InferOutputShapeFn: false where ORT cannot tell input `index`'s
// type and shape.
inline bool TryShapeInferInput(OrtShapeInferContext* ctx, size_t index, std::vector<int64_t>* dims,
                               std::vector<std::string>* names, ONNXTensorElementDataType* type) noexcept {
  return Quietly([&] { ShapeInferInput(ctx, index, dims, names, type); });
}

// The number of elements of a tensor of `shape` (1 for a scalar's []).
inline int64_t ElementCount(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  return count;
}

// ---- output_type: 1 (float32, the default) or 10 (float16) ---------------------------------

constexpr int64_t kFloatType = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr int64_t kHalfType = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;

inline bool IsOutputType(int64_t output_type) { return output_type == kFloatType || output_type == kHalfType; }

// "" or what is wrong with the type attribute `name` (1 or 10).
inline std::string OutputTypeError(const char* name, int64_t type) {
  if (IsOutputType(type)) return "";
  return "attribute '" + std::string(name) + "' must be 1 (float32) or 10 (float16), got " + std::to_string(type);
}

// "" or what is wrong with the attributes that type and shape an output: `type_name` (1 or 10)
// and `shape_name` (dims >= 0 holding `elements` elements; `elements_why`: what gives that
// number, for the message).
inline std::string OutputAttributesError(const char* type_name, int64_t type, const char* shape_name,
                                         const std::vector<int64_t>& shape, int64_t elements,
                                         const std::string& elements_why) {
  if (!IsOutputType(type)) return OutputTypeError(type_name, type);
  const std::string attribute = "attribute '" + std::string(shape_name) + "' ";
  for (int64_t d : shape) {
    if (d < 0) return attribute + "must be >= 0, got " + IntsText(shape);
  }
  const int64_t count = ElementCount(shape);
  if (count != elements) {
    return attribute + IntsText(shape) + " holds " + std::to_string(count) + " elements, " + elements_why;
  }
  return "";
}

// The node's output_type at kernel creation; an invalid one fails naming `who`.
inline int64_t OutputTypeAttribute(const OrtKernelInfo* info, const std::string& who) {
  const int64_t output_type = IntAttribute(info, "output_type", kFloatType);
  const std::string why = OutputTypeError("output_type", output_type);
  if (!why.empty()) Fail(who, why);
  return output_type;
}

// A gradient kernel's output_type (checked at creation: an invalid one fails naming `who`) and
// output_shape (has_shape: the node has it).
struct OutputAttributes {
  OutputAttributes(const OrtKernelInfo* info, const std::string& who)
      : type(OutputTypeAttribute(info, who)), shape(IntsAttribute(info, "output_shape", &has_shape)) {}
  bool half() const { return type == kHalfType; }
  // output_shape, or `fallback` where the node has none.
  std::vector<int64_t> ShapeOr(const std::vector<int64_t>& fallback) const { return has_shape ? shape : fallback; }

  int64_t type;
  bool has_shape = false;
  std::vector<int64_t> shape;
};

// The element type from output_type in shape inference (absent: float32); false when invalid.
inline bool InferOutputType(const OrtShapeInferContext* ctx, ONNXTensorElementDataType* type) {
  int64_t output_type = kFloatType;
  if (!InferInt(ctx, "output_type", &output_type)) output_type = kFloatType;
  if (!IsOutputType(output_type)) return false;
  *type = static_cast<ONNXTensorElementDataType>(output_type);
  return true;
}

// ---- small checks and texts -----------------------------------------------------------------

inline bool IsFloatOrHalf(ONNXTensorElementDataType type) {
  return type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
}

// "[2, 3]".
inline std::string ShapeText(const std::vector<int64_t>& shape) { return IntsText(shape); }

// Runs tasks on the session's intra-op thread pool (ORT runs them on the calling thread when
// the session has one thread); a single task runs here without touching the pool. `ctx` must
// outlive the runner.
inline ParallelRunner ThreadPoolRunner(Ort::KernelContext& ctx) {
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

// A buffer of `bytes` from the session's allocator for `memory` (ORT's arena on the device:
// KernelContext_GetScratchBuffer, ordered on the compute stream like the scratch buffers of ORT's
// own kernels), handed back when this goes out of scope: with the arena, to work queued after
// the launches that use it, so it may go once they are queued. get() is null where ORT gives
// none (the caller then does without). Nothing reaches cudaMalloc once the arena has grown, also
// while a CUDA graph is captured.
class ScratchBuffer {
 public:
  ScratchBuffer(OrtKernelContext* ctx, const OrtMemoryInfo* memory, size_t bytes) {
    const OrtApi& api = Ort::GetApi();
    OrtStatus* status = api.KernelContext_GetAllocator(ctx, memory, &allocator_);
    if (status == nullptr) status = api.KernelContext_GetScratchBuffer(ctx, memory, bytes, &data_);
    if (status != nullptr) {
      api.ReleaseStatus(status);
      Release();
    }
  }
  ~ScratchBuffer() { Release(); }
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  void* get() const { return allocator_ != nullptr ? data_ : nullptr; }

 private:
  void Release() {
    if (allocator_ != nullptr && data_ != nullptr) allocator_->Free(allocator_, data_);
    if (allocator_ != nullptr) Ort::GetApi().ReleaseAllocator(allocator_);
    allocator_ = nullptr;
    data_ = nullptr;
  }
  OrtAllocator* allocator_ = nullptr;
  void* data_ = nullptr;
};

// ---- exceptions to statuses: nothing may unwind through ONNX Runtime's C API ----------------

// Runs `body`; an Ort::Exception becomes a status of its own code and message, any other
// std::exception one of `code` whose message is "<who>: <what>" ("<what>" when who is empty).
template <typename Body>
OrtStatusPtr StatusOf(Body&& body, const std::string& who, OrtErrorCode code) {
  try {
    body();
    return nullptr;
  } catch (const Ort::Exception& e) {
    return Ort::Status(e.what(), e.GetOrtErrorCode()).release();
  } catch (const std::exception& e) {
    return Ort::Status((who.empty() ? std::string(e.what()) : who + ": " + e.what()).c_str(), code).release();
  }
}

// ---- kernel structs --------------------------------------------------------------------------

// What every kernel struct repeats: the node named for messages (`who`: "<op> node '<name>'"),
// the provider (`cuda`), Fail(message) naming the node, and the ComputeV2 ORT calls: Impl's
// Compute(OrtKernelContext*) with exceptions turned into a status (an Ort::Exception keeps its
// code and message; another one becomes ORT_RUNTIME_EXCEPTION "<who>: <what>").
template <typename Impl>
struct NodeKernel {
  NodeKernel(const char* op, const OrtKernelInfo* info, bool cuda) : who(NodeWho(op, info)), cuda(cuda) {}
  [[noreturn]] void Fail(const std::string& message) const { onnxcampo::Fail(who, message); }
  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return StatusOf([&] { static_cast<Impl*>(this)->Compute(context); }, who, ORT_RUNTIME_EXCEPTION);
  }

  std::string who;
  bool cuda;
};

// ---- op classes ----------------------------------------------------------------------------

// An op with a status-returning kernel `TKernel(info, cuda)`, registered for the CPU or the CUDA
// provider; a kernel whose creation throws makes an ORT_INVALID_ARGUMENT status (an
// Ort::Exception keeps its code); `infer`, when given, is its InferOutputShapeFn. TOp adds GetName
// and the input and output types.
template <typename TOp, typename TKernel>
struct OpBase : Ort::CustomOpBase<TOp, TKernel, /*WithStatus=*/true> {
  using InferFn = decltype(OrtCustomOp::InferOutputShapeFn);
  explicit OpBase(bool cuda, InferFn infer = nullptr) : cuda_(cuda) {
    if (infer != nullptr) OrtCustomOp::InferOutputShapeFn = infer;
  }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** kernel) const {
    return StatusOf([&] { *kernel = new TKernel(info, cuda_); }, "", ORT_INVALID_ARGUMENT);
  }
  const char* GetExecutionProviderType() const { return cuda_ ? kCudaProvider : kCpuProvider; }

 protected:
  bool cuda_;
};

// An op whose inputs' and outputs' element types TOp lists in `static constexpr
// ONNXTensorElementDataType kInputTypes[], kOutputTypes[]` (UNDEFINED: any, checked by the kernel),
// constructed as OpBase. TOp adds GetName.
template <typename TOp, typename TKernel>
struct TypedOp : OpBase<TOp, TKernel> {
  using OpBase<TOp, TKernel>::OpBase;
  size_t GetInputTypeCount() const { return sizeof(TOp::kInputTypes) / sizeof(TOp::kInputTypes[0]); }
  ONNXTensorElementDataType GetInputType(size_t index) const { return TOp::kInputTypes[index]; }
  size_t GetOutputTypeCount() const { return sizeof(TOp::kOutputTypes) / sizeof(TOp::kOutputTypes[0]); }
  ONNXTensorElementDataType GetOutputType(size_t index) const { return TOp::kOutputTypes[index]; }
};

constexpr ONNXTensorElementDataType kAnyType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;

// The op's registration for the CPU or the CUDA provider, each made once and kept for the process
// (the CUDA one only in a build with the CUDA kernels).
template <typename TOp>
const OrtCustomOp* Registered(bool cuda) {
  static const TOp cpu(false);
#ifdef ONNXCAMPO_WITH_CUDA
  static const TOp gpu(true);
  if (cuda) return &gpu;
#endif
  (void)cuda;
  return &cpu;
}

// The op `kName`: one input and one output of undefined type (the kernel checks the input's; ORT's
// custom-op type inference, or `infer` when given, gives the output's). A whole op class:
// `using Im2ColCustomOp = UntypedUnaryOp<kName, Im2ColKernel, InferIm2Col>;` (kName a
// `constexpr char[]`).
template <const char* kName, typename TKernel, decltype(OrtCustomOp::InferOutputShapeFn) infer = nullptr>
struct UntypedUnaryOp : OpBase<UntypedUnaryOp<kName, TKernel, infer>, TKernel> {
  explicit UntypedUnaryOp(bool cuda) : OpBase<UntypedUnaryOp, TKernel>(cuda, infer) {}
  const char* GetName() const { return kName; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

// One variadic input and one variadic output: lists of tensors of kInputType / kOutputType alone
// (homogeneous), or of any types each (kAnyType: heterogeneous; the kernel checks the inputs' and
// the op's InferOutputShapeFn gives the outputs' types, as ORT's own type inference gives up).
template <typename TOp, typename TKernel, ONNXTensorElementDataType kInputType, ONNXTensorElementDataType kOutputType>
struct VariadicOp : OpBase<TOp, TKernel> {
  using OpBase<TOp, TKernel>::OpBase;
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return kInputType; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const { return INPUT_OUTPUT_VARIADIC; }
  bool GetVariadicInputHomogeneity() const { return kInputType != kAnyType; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return kOutputType; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t) const { return INPUT_OUTPUT_VARIADIC; }
  bool GetVariadicOutputHomogeneity() const { return kOutputType != kAnyType; }
};

// ---- the registry: each unit's <unit>_op.cc names its op classes once ----------------------

// Adds a unit's ops to the domain for the CPU provider (cuda false) or the CUDA provider (cuda
// true, called only in a build with the CUDA kernels).
using AddOpsFn = void (*)(Ort::CustomOpDomain& domain, bool cuda);

struct OpsUnit {
  const char* name;
  AddOpsFn add;
};

// Every unit linked into the library (common/library.cc adds them to the domain).
std::vector<OpsUnit>& OpsUnits();

struct OpsRegistrar {
  OpsRegistrar(const char* name, AddOpsFn add) { OpsUnits().push_back({name, add}); }
};

// Op classes `TOp(bool cuda)` registered for the CPU and (built with CUDA) the CUDA provider.
template <typename... TOps>
void AddOps(Ort::CustomOpDomain& domain, bool cuda) {
  (domain.Add(Registered<TOps>(cuda)), ...);
}

// Op classes with CPU kernels only.
template <typename... TOps>
void AddCpuOps(Ort::CustomOpDomain& domain, bool cuda) {
  if (!cuda) (domain.Add(Registered<TOps>(false)), ...);
}

}  // namespace onnxcampo

// At namespace scope of a unit's <unit>_op.cc, after its op classes: the unit's ops join the
// domain when the library loads. ONNXCAMPO_REGISTER_OPS(to_nhwc, NchwToNhwcOp);
#define ONNXCAMPO_REGISTER_OPS(unit, ...) \
  static const ::onnxcampo::OpsRegistrar onnxcampo_ops_unit_##unit(#unit, &::onnxcampo::AddOps<__VA_ARGS__>)
#define ONNXCAMPO_REGISTER_CPU_OPS(unit, ...) \
  static const ::onnxcampo::OpsRegistrar onnxcampo_ops_unit_##unit(#unit, &::onnxcampo::AddCpuOps<__VA_ARGS__>)
