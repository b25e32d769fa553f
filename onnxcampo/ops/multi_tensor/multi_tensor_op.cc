// The ONNX Runtime ops of a training step's tensor lists (multi_tensor.h has the arithmetic):
//
//   UnscaleCheckFinite(inv_scale, g_1..g_n) -> (found_inf, u_1..u_n)
//   CheckFinite(g_1..g_n) -> found_inf  (UnscaleCheckFinite's check alone, for an update that unscales)
//   MultiTensorSGD[momentum](lr, found_inf, w_1..w_n, g_1..g_n[, v_1..v_n]) -> (w'_1..w'_n[, v'_1..v'_n])
//       (velocities present: momentum SGD, whatever the attribute; absent: plain SGD)
//       unscale=1: (lr, found_inf, inv_scale, w.., g.., v..), g_i scaled, used as float32(g_i) * inv_scale
//   MultiTensorAdamW[beta1, beta2, eps, weight_decay](lr, step, found_inf, w.., g.., m.., v..)
//       -> (step', w'.., m'.., v'..)
//   MultiTensorCast(x_1..x_n) -> (y_1..y_n)  (float32 -> float16, each y_i = Cast(x_i, to=FLOAT16):
//       a training step's weight Casts in one call)
//
// ORT's custom-op schemas allow one variadic input (the last), so each op lists its scalars
// first and all tensors as one heterogeneous variadic input; the kernel splits that list.
#include <string>
#include <vector>

#include "multi_tensor.h"
#include "op_util.h"

namespace onnxcampo {
namespace {

// Inputs and outputs of one call, with the checks every op needs.
class Io {
 public:
  Io(OrtKernelContext* context, const char* op) : ctx_(context), op_(op) {}

  size_t InputCount() const { return ctx_.GetInputCount(); }
  size_t OutputCount() const { return ctx_.GetOutputCount(); }

  const float* FloatScalar(size_t index, const char* what) const {
    Ort::ConstValue value = ctx_.GetInput(index);
    auto info = value.GetTensorTypeAndShapeInfo();
    if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || info.GetElementCount() != 1) {
      Fail(op_, std::string(what) + " must be a float32 scalar");
    }
    return value.GetTensorData<float>();
  }

  Flag FlagScalar(size_t index) const {
    Ort::ConstValue value = ctx_.GetInput(index);
    auto info = value.GetTensorTypeAndShapeInfo();
    const auto type = info.GetElementType();
    if ((type != ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) ||
        info.GetElementCount() != 1) {
      Fail(op_, "found_inf must be a bool or float32 scalar");
    }
    return Flag{value.GetTensorRawData(), type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT};
  }

  // Gradients at inputs first..first+n-1; `like` (if given) are the fp32 tensors whose
  // shapes the gradients must have.
  Grads Gradients(size_t first, size_t n, std::vector<std::vector<int64_t>>* shapes) const {
    Grads grads;
    for (size_t k = 0; k < n; ++k) {
      Ort::ConstValue value = ctx_.GetInput(first + k);
      auto info = value.GetTensorTypeAndShapeInfo();
      const auto type = info.GetElementType();
      if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
        Fail(op_, "gradient " + std::to_string(k + 1) + " must be float32 or float16");
      }
      grads.data.push_back(value.GetTensorRawData());
      grads.half.push_back(type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16);
      grads.size.push_back(static_cast<int64_t>(info.GetElementCount()));
      if (shapes != nullptr) shapes->push_back(info.GetShape());
    }
    return grads;
  }

  // fp32 tensors at inputs first..first+n-1, each shaped like `shapes[k]`.
  std::vector<const float*> Floats(size_t first, size_t n, const std::vector<std::vector<int64_t>>& shapes,
                                   const char* what) const {
    std::vector<const float*> data;
    for (size_t k = 0; k < n; ++k) {
      Ort::ConstValue value = ctx_.GetInput(first + k);
      auto info = value.GetTensorTypeAndShapeInfo();
      if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
        Fail(op_, std::string(what) + " " + std::to_string(k + 1) + " must be float32");
      }
      if (info.GetShape() != shapes[k]) {
        Fail(op_, std::string(what) + " " + std::to_string(k + 1) + " and its gradient differ in shape");
      }
      data.push_back(value.GetTensorData<float>());
    }
    return data;
  }

  std::vector<float*> Outputs(size_t first, const std::vector<std::vector<int64_t>>& shapes) {
    std::vector<float*> data;
    for (size_t k = 0; k < shapes.size(); ++k) {
      data.push_back(ctx_.GetOutput(first + k, shapes[k]).GetTensorMutableData<float>());
    }
    return data;
  }

  template <typename T>
  T* ScalarOutput(size_t index) { return ctx_.GetOutput(index, std::vector<int64_t>{}).GetTensorMutableData<T>(); }

  void* Stream() const { return ctx_.GetGPUComputeStream(); }
  ParallelRunner Runner() { return ThreadPoolRunner(ctx_); }
  const char* op() const { return op_; }

 private:
  Ort::KernelContext ctx_;
  const char* op_;
};

// Turns exceptions into an OrtStatus: nothing may unwind through ONNX Runtime's C API.
template <typename Impl>
struct Kernel {
  explicit Kernel(bool cuda) : cuda(cuda) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return StatusOf([&] { static_cast<Impl*>(this)->Compute(context); }, "", ORT_RUNTIME_EXCEPTION);
  }
  bool cuda;
};

// UnscaleCheckFinite (kUnscale) and CheckFinite, its check alone: an update with unscale=1 reads
// g_i and inv_scale itself, so the u_i (float32, a pass over every gradient written and read
// back) are not made.
template <bool kUnscale>
struct CheckFiniteKernel : Kernel<CheckFiniteKernel<kUnscale>> {
  static constexpr const char* kName = kUnscale ? "UnscaleCheckFinite" : "CheckFinite";
  static constexpr size_t kScalarInputs = kUnscale ? 1 : 0;  // inv_scale
  static constexpr size_t kScalarOutputs = 1;                 // found_inf
  static constexpr bool kTensorOutputs = kUnscale;            // u_1..u_n
  static constexpr ONNXTensorElementDataType kScalarOutput = ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
  CheckFiniteKernel(const OrtKernelInfo*, bool cuda) : Kernel<CheckFiniteKernel>(cuda) {}

  void Compute(OrtKernelContext* context) {
    Io io(context, kName);
    UnscaleArgs args;
    if (kUnscale) args.inv_scale = io.FloatScalar(0, "inv_scale");
    std::vector<std::vector<int64_t>> shapes;
    args.grads = io.Gradients(kScalarInputs, io.InputCount() - kScalarInputs, kUnscale ? &shapes : nullptr);
    args.found_inf = io.ScalarOutput<bool>(0);
    if (kUnscale) args.out = io.Outputs(1, shapes);
#ifdef ONNXCAMPO_WITH_CUDA
    if (this->cuda) return UnscaleCheckFiniteCuda(args, io.Stream());
#endif
    UnscaleCheckFiniteCpu(args, io.Runner());
  }
};

using UnscaleCheckFinite = CheckFiniteKernel<true>;
using CheckFinite = CheckFiniteKernel<false>;

// unscale=1 puts inv_scale first among the tensor inputs (the variadic list).
size_t UnscaleInputs(const OrtKernelInfo* info, const char* op) {
  const int64_t unscale = IntAttribute(info, "unscale", 0);
  if (unscale != 0 && unscale != 1) Fail(op, "unscale must be 0 or 1");
  return static_cast<size_t>(unscale);
}

struct MultiTensorSGD : Kernel<MultiTensorSGD> {
  static constexpr const char* kName = "MultiTensorSGD";
  static constexpr size_t kScalarInputs = 2;  // lr, found_inf
  static constexpr size_t kScalarOutputs = 0;
  static constexpr bool kTensorOutputs = true;
  static constexpr ONNXTensorElementDataType kScalarOutput = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  MultiTensorSGD(const OrtKernelInfo* info, bool cuda)
      : Kernel(cuda), momentum(FloatAttribute(info, "momentum", 0.0f)), unscale(UnscaleInputs(info, kName)) {}

  void Compute(OrtKernelContext* context) {
    Io io(context, kName);
    // Plain SGD: (w.., g..) -> (w'..); with velocities: (w.., g.., v..) -> (w'.., v'..).
    const size_t first = kScalarInputs + unscale;  // w_1
    if (io.InputCount() < first) Fail(kName, "expected inputs (lr, found_inf, inv_scale, ...) with unscale=1");
    const size_t tensors = io.InputCount() - first;
    const size_t outputs = io.OutputCount();
    size_t lists = 0;
    if (tensors == 2 * outputs) lists = 2;
    if (outputs % 2 == 0 && 2 * tensors == 3 * outputs) lists = 3;
    if (lists == 0) {
      Fail(kName, "expected inputs (lr, found_inf" + std::string(unscale ? ", inv_scale" : "") +
                      ", w_1..w_n, g_1..g_n[, v_1..v_n]) and outputs (w'_1..w'_n[, v'_1..v'_n]), got " +
                      std::to_string(tensors) + " tensor inputs and " + std::to_string(outputs) + " outputs");
    }
    const size_t n = tensors / lists;
    SgdArgs args;
    args.lr = io.FloatScalar(0, "lr");
    args.found_inf = io.FlagScalar(1);
    if (unscale) args.inv_scale = io.FloatScalar(kScalarInputs, "inv_scale");
    args.momentum = momentum;
    std::vector<std::vector<int64_t>> shapes;
    args.grads = io.Gradients(first + n, n, &shapes);
    args.w = io.Floats(first, n, shapes, "weight");
    if (lists == 3) args.v = io.Floats(first + 2 * n, n, shapes, "velocity");
    args.w_out = io.Outputs(0, shapes);
    if (lists == 3) args.v_out = io.Outputs(n, shapes);
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return MultiTensorSgdCuda(args, io.Stream());
#endif
    MultiTensorSgdCpu(args, io.Runner());
  }
  float momentum;
  size_t unscale;  // 1: inv_scale is input kScalarInputs
};

struct MultiTensorAdamW : Kernel<MultiTensorAdamW> {
  static constexpr const char* kName = "MultiTensorAdamW";
  static constexpr size_t kScalarInputs = 3;  // lr, step, found_inf
  static constexpr size_t kScalarOutputs = 1;  // step'
  static constexpr bool kTensorOutputs = true;
  static constexpr ONNXTensorElementDataType kScalarOutput = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  MultiTensorAdamW(const OrtKernelInfo* info, bool cuda)
      : Kernel(cuda),
        beta1(FloatAttribute(info, "beta1", 0.9f)),
        beta2(FloatAttribute(info, "beta2", 0.999f)),
        eps(FloatAttribute(info, "eps", 1e-8f)),
        weight_decay(FloatAttribute(info, "weight_decay", 0.01f)),
        unscale(UnscaleInputs(info, kName)) {}

  void Compute(OrtKernelContext* context) {
    Io io(context, kName);
    const size_t first = kScalarInputs + unscale;  // w_1
    const size_t tensors = io.InputCount() < first ? 1 : io.InputCount() - first;
    if (tensors % 4 != 0 || io.OutputCount() != 1 + 3 * (tensors / 4)) {
      Fail(kName, "expected inputs (lr, step, found_inf" + std::string(unscale ? ", inv_scale" : "") +
                      ", w.., g.., m.., v..) and outputs (step', w'.., m'.., v'..), got " +
                      std::to_string(tensors) + " tensor inputs and " + std::to_string(io.OutputCount()) + " outputs");
    }
    const size_t n = tensors / 4;
    AdamWArgs args;
    args.lr = io.FloatScalar(0, "lr");
    args.step = io.FloatScalar(1, "step");
    args.found_inf = io.FlagScalar(2);
    if (unscale) args.inv_scale = io.FloatScalar(kScalarInputs, "inv_scale");
    args.beta1 = beta1;
    args.beta2 = beta2;
    args.eps = eps;
    args.weight_decay = weight_decay;
    std::vector<std::vector<int64_t>> shapes;
    args.grads = io.Gradients(first + n, n, &shapes);
    args.w = io.Floats(first, n, shapes, "weight");
    args.m = io.Floats(first + 2 * n, n, shapes, "first moment");
    args.v = io.Floats(first + 3 * n, n, shapes, "second moment");
    args.step_out = io.ScalarOutput<float>(0);
    args.w_out = io.Outputs(1, shapes);
    args.m_out = io.Outputs(1 + n, shapes);
    args.v_out = io.Outputs(1 + 2 * n, shapes);
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return MultiTensorAdamWCuda(args, io.Stream());
#endif
    MultiTensorAdamWCpu(args, io.Runner());
  }
  float beta1, beta2, eps, weight_decay;
  size_t unscale;  // 1: inv_scale is input kScalarInputs
};

// The schema ORT derives: scalar inputs (float, except found_inf: bool or float), then one
// variadic heterogeneous input (the tensors); kScalarOutputs scalar outputs of kScalarOutput's
// type, then (kTensorOutputs) one variadic float32 output (the tensors).
template <typename K>
struct Op : OpBase<Op<K>, K> {
  using OpBase<Op<K>, K>::OpBase;
  const char* GetName() const { return K::kName; }

  size_t GetInputTypeCount() const { return K::kScalarInputs + 1; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    const bool is_flag = std::string(K::kName) != "UnscaleCheckFinite" && index == K::kScalarInputs - 1;
    if (index == K::kScalarInputs || is_flag) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == K::kScalarInputs ? INPUT_OUTPUT_VARIADIC : INPUT_OUTPUT_REQUIRED;
  }
  bool GetVariadicInputHomogeneity() const { return false; }

  size_t GetOutputTypeCount() const { return K::kScalarOutputs + (K::kTensorOutputs ? 1 : 0); }
  ONNXTensorElementDataType GetOutputType(size_t index) const {
    return index < K::kScalarOutputs ? K::kScalarOutput : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t index) const {
    return index == K::kScalarOutputs ? INPUT_OUTPUT_VARIADIC : INPUT_OUTPUT_REQUIRED;
  }
  bool GetVariadicOutputHomogeneity() const { return true; }
};

struct MultiTensorCast : Kernel<MultiTensorCast> {
  static constexpr const char* kName = "MultiTensorCast";
  MultiTensorCast(const OrtKernelInfo*, bool cuda) : Kernel(cuda) {}

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    const size_t n = ctx.GetInputCount();
    if (ctx.GetOutputCount() != n) {
      Fail(kName, "expected as many outputs as inputs, got " + std::to_string(n) + " inputs and " +
                      std::to_string(ctx.GetOutputCount()) + " outputs");
    }
    CastArgs args;
    for (size_t k = 0; k < n; ++k) {
      Ort::ConstValue value = ctx.GetInput(k);
      auto info = value.GetTensorTypeAndShapeInfo();
      if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
        Fail(kName, "input " + std::to_string(k + 1) + " must be float32");
      }
      args.in.push_back(value.GetTensorData<float>());
      args.size.push_back(static_cast<int64_t>(info.GetElementCount()));
      args.out.push_back(
          static_cast<uint16_t*>(ctx.GetOutput(k, info.GetShape()).GetTensorMutableRawData()));
    }
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return MultiTensorCastCuda(args, ctx.GetGPUComputeStream());
#endif
    MultiTensorCastCpu(args, ThreadPoolRunner(ctx));
  }
};

// Output k: float16, input k's shape (dims and symbols): what the Casts it replaces told the
// nodes after them (without it ORT would know no rank downstream of a cast weight).
OrtStatusPtr ORT_API_CALL InferMultiTensorCast(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  const OrtApi& api = Ort::GetApi();
  try {
    size_t inputs = 0;
    Ort::ThrowOnError(api.ShapeInferContext_GetInputCount(ctx, &inputs));
    for (size_t k = 0; k < inputs; ++k) {
      std::vector<int64_t> dims;
      std::vector<std::string> names;
      ONNXTensorElementDataType type;
      ShapeInferInput(ctx, k, &dims, &names, &type);
      std::vector<const char*> symbols(dims.size());
      for (size_t d = 0; d < dims.size(); ++d) symbols[d] = names[d].c_str();
      ShapeInferOutput(ctx, k, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, dims, symbols);
    }
  } catch (...) {  // nothing may unwind into ORT
  }
  return nullptr;
}

// float32 tensors in, as many float16 tensors out (both variadic and homogeneous);
// InferMultiTensorCast gives each output its input's shape.
struct MultiTensorCastOp : VariadicOp<MultiTensorCastOp, MultiTensorCast, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                                      ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> {
  explicit MultiTensorCastOp(bool cuda) : VariadicOp(cuda, InferMultiTensorCast) {}
  const char* GetName() const { return MultiTensorCast::kName; }
};

}  // namespace

ONNXCAMPO_REGISTER_OPS(multi_tensor, Op<UnscaleCheckFinite>, Op<CheckFinite>, Op<MultiTensorSGD>, Op<MultiTensorAdamW>,
                       MultiTensorCastOp);

}  // namespace onnxcampo
