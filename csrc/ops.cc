// The onnxcampo custom-op library: domain ai.onnxcampo, CPU kernels always, CUDA kernels when
// built with ONNXCAMPO_WITH_CUDA. The library does not link libonnxruntime: the runtime hands
// its API to RegisterCustomOps (ORT_API_MANUAL_INIT).
//
//   UnscaleCheckFinite(inv_scale, g_1..g_n) -> (found_inf, u_1..u_n)
//   CheckFinite(g_1..g_n) -> found_inf  (UnscaleCheckFinite's check alone, for an update that unscales)
//   MultiTensorSGD[momentum](lr, found_inf, w_1..w_n, g_1..g_n[, v_1..v_n]) -> (w'_1..w'_n[, v'_1..v'_n])
//       (velocities present: momentum SGD, whatever the attribute; absent: plain SGD)
//       unscale=1: (lr, found_inf, inv_scale, w.., g.., v..), g_i scaled, used as float32(g_i) * inv_scale
//   MultiTensorAdamW[beta1, beta2, eps, weight_decay](lr, step, found_inf, w.., g.., m.., v..)
//       -> (step', w'.., m'.., v'..)
//   AvgMatMulInteger(A, B[, a_zero_point, b_zero_point]) -> Y   (uint8 x uint8 -> float32, the
//       tree-averaging 16-bit accumulation of the averaging-networks seed; docs/avg-matmul.md)
//   ExactMatMulInteger(A, B[, a_zero_point, b_zero_point]) -> Y (the same with exact 32-bit
//       accumulation: the baseline the averaging kernel is measured against)
//   FusedElementwise[program, registers, constants, output_types, input_types](x_1..x_n) -> (y_1..y_m)
//       (a register program per element of the inputs' broadcast shape: float16/float32 in and
//       out; onnxcampo/ops/elementwise.py; the element types of its heterogeneous variadic
//       output come from `output_types` through the op's shape-inference function)
//   Im2Col[kernel_shape, strides, dilations, pads](x) -> columns  (a Conv's column matrix; im2col_op.cc)
//   BlockReduceSum[sizes, output_type, output_shape](x) -> y   (x as [P, Q, R], summed over P and
//       R in float32: reduce_op.cc, reduce.h)
//   ScatterNDAdd(data, indices, updates) -> output  (ONNX ScatterND, reduction "add"; scatter_op.cc)
//   MultiTensorCast(x_1..x_n) -> (y_1..y_n)  (float32 -> float16, each y_i = Cast(x_i, to=FLOAT16):
//       a training step's weight Casts in one call)
//   SoftmaxCrossEntropy(x, labels) -> (picked, lse), SoftmaxCrossEntropyGrad(x, lse, labels, scale)
//       -> dx  (the cross-entropy loss over the last axis and its gradient, one pass each:
//       xent_op.cc, xent.h)
//   LayerNormGrad(dy, xhat, invstd, gamma[, acc]) -> dx  (a layer normalization's input gradient,
//       one pass over the rows: norm_op.cc, norm.h)
//   SoftmaxGrad[cols, scale](dy, y) -> dx  (a softmax's input gradient over rows of cols: norm_op.cc)
//   MaxPoolNhwc[kernel_shape, strides, pads](x) -> (y[, argmax]), MaxPoolNhwcGrad[..., input_spatial](dy,
//       argmax) -> dx  (a channels-last max pooling and its gradient: max_pool_op.cc, max_pool.h)
//   NchwToNhwc[to, channels](x) -> y  (a channels-first tensor channels-last, cast and its channels
//       zero-padded, in one pass: to_nhwc_op.cc, to_nhwc.h)
//
// ORT's custom-op schemas allow one variadic input (the last), so each op lists its scalars
// first and all tensors as one heterogeneous variadic input; the kernel splits that list.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "avg_matmul.h"
#include "conv_grad.h"
#include "conv_nhwc.h"
#include "elementwise.h"
#include "elementwise_jit.h"
#include "im2col.h"
#include "kernels.h"
#include "max_pool.h"
#include "op_util.h"
#include "reduce.h"
#include "scatter.h"
#include "norm.h"
#include "xent.h"

namespace onnxcampo {

void AddBlockReduceSumOps(Ort::CustomOpDomain& domain);  // reduce_op.cc
void AddNchwToNhwcOps(Ort::CustomOpDomain& domain);  // to_nhwc_op.cc
#ifdef ONNXCAMPO_WITH_CUDA
void BlockReduceSumOnStream(OrtKernelContext* ctx, const OrtMemoryInfo* memory, const BlockReduceArgs& args);  // reduce_op.cc
#endif

namespace {

constexpr const char* kDomain = "ai.onnxcampo";

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

struct UnscaleCheckFinite : Kernel<UnscaleCheckFinite> {
  static constexpr const char* kName = "UnscaleCheckFinite";
  static constexpr size_t kScalarInputs = 1;  // inv_scale
  static constexpr size_t kScalarOutputs = 1;  // found_inf
  static constexpr bool kTensorOutputs = true;
  static constexpr ONNXTensorElementDataType kScalarOutput = ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
  UnscaleCheckFinite(const OrtKernelInfo*, bool cuda) : Kernel(cuda) {}

  void Compute(OrtKernelContext* context) {
    Io io(context, kName);
    UnscaleArgs args;
    args.inv_scale = io.FloatScalar(0, "inv_scale");
    std::vector<std::vector<int64_t>> shapes;
    args.grads = io.Gradients(1, io.InputCount() - 1, &shapes);
    args.found_inf = io.ScalarOutput<bool>(0);
    args.out = io.Outputs(1, shapes);
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return UnscaleCheckFiniteCuda(args, io.Stream());
#endif
    UnscaleCheckFiniteCpu(args, io.Runner());
  }
};

// UnscaleCheckFinite without its outputs u_i: an update with unscale=1 reads g_i and inv_scale
// itself, so the u_i (float32, a pass over every gradient written and read back) are not made.
struct CheckFinite : Kernel<CheckFinite> {
  static constexpr const char* kName = "CheckFinite";
  static constexpr size_t kScalarInputs = 0;
  static constexpr size_t kScalarOutputs = 1;  // found_inf
  static constexpr bool kTensorOutputs = false;
  static constexpr ONNXTensorElementDataType kScalarOutput = ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
  CheckFinite(const OrtKernelInfo*, bool cuda) : Kernel(cuda) {}

  void Compute(OrtKernelContext* context) {
    Io io(context, kName);
    UnscaleArgs args;
    args.grads = io.Gradients(0, io.InputCount(), nullptr);
    args.found_inf = io.ScalarOutput<bool>(0);
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return UnscaleCheckFiniteCuda(args, io.Stream());
#endif
    UnscaleCheckFiniteCpu(args, io.Runner());
  }
};

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

// ---- 8-bit matmuls: A (uint8, M x K), B (uint8, K x N), optional uint8 zero points (a scalar,
// or one per row of A / column of B) -> Y (float32, M x N). CPU only.
template <Accumulation kMode>
struct MatMulU8Kernel {
  explicit MatMulU8Kernel(const char* name) : name(name) {}

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return StatusOf([&] { Compute(context); }, name, ORT_INVALID_ARGUMENT);
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    MatMulU8Args args;
    std::vector<int64_t> a_shape, b_shape;
    args.A = Matrix(ctx, 0, "A", &a_shape);
    args.B = Matrix(ctx, 1, "B", &b_shape);
    if (a_shape[1] != b_shape[0]) {
      Fail(name, "A is " + std::to_string(a_shape[0]) + " x " + std::to_string(a_shape[1]) + " but B is " +
                     std::to_string(b_shape[0]) + " x " + std::to_string(b_shape[1]));
    }
    args.M = a_shape[0];
    args.K = a_shape[1];
    args.N = b_shape[1];
    args.za = ZeroPoint(ctx, 2, "a_zero_point", args.M, "row of A", &args.za_count);
    args.zb = ZeroPoint(ctx, 3, "b_zero_point", args.N, "column of B", &args.zb_count);
    args.Y = ctx.GetOutput(0, std::vector<int64_t>{args.M, args.N}).GetTensorMutableData<float>();
    MatMulU8(args, kMode, ThreadPoolRunner(ctx));
  }

  const uint8_t* Matrix(Ort::KernelContext& ctx, size_t index, const char* what, std::vector<int64_t>* shape) const {
    Ort::ConstValue value = ctx.GetInput(index);
    auto info = value.GetTensorTypeAndShapeInfo();
    *shape = info.GetShape();
    if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 || shape->size() != 2) {
      Fail(name, std::string(what) + " must be a 2-D uint8 tensor");
    }
    return value.GetTensorData<uint8_t>();
  }

  const uint8_t* ZeroPoint(Ort::KernelContext& ctx, size_t index, const char* what, int64_t per, const char* per_what,
                           int64_t* count) const {
    *count = 0;
    if (ctx.GetInputCount() <= index) return nullptr;
    Ort::ConstValue value = ctx.GetInput(index);
    if (!value) return nullptr;  // optional input left empty
    auto info = value.GetTensorTypeAndShapeInfo();
    const auto shape = info.GetShape();
    const int64_t n = static_cast<int64_t>(info.GetElementCount());
    if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 || shape.size() > 1 ||
        (shape.size() == 1 && n != 1 && n != per)) {
      Fail(name, std::string(what) + " must be a uint8 scalar or a 1-D tensor of 1 or " + std::to_string(per) +
                     " values (one per " + per_what + ")");
    }
    *count = n == 1 ? 1 : n;
    return value.GetTensorData<uint8_t>();
  }

  const char* name;
};

template <Accumulation kMode>
struct MatMulU8Op : Ort::CustomOpBase<MatMulU8Op<kMode>, MatMulU8Kernel<kMode>, /*WithStatus=*/true> {
  explicit MatMulU8Op(const char* name) : name_(name) {}
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo*, void** kernel) const {
    *kernel = new MatMulU8Kernel<kMode>(name_);
    return nullptr;
  }
  const char* GetName() const { return name_; }
  const char* GetExecutionProviderType() const { return kCpuProvider; }
  size_t GetInputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index < 2 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }

 private:
  const char* name_;
};

// ---- FusedElementwise (elementwise.h) -------------------------------------------------------

constexpr const char* kFusedElementwise = "FusedElementwise";

// The program is checked when ORT creates the kernel (session creation), with the rules and
// messages of onnxcampo.ops.elementwise.check; each call broadcasts its inputs' shapes.
// `input_types` (optional) names the element types the program was written for. ORT's CPU
// provider runs an fp16 node it has no fp16 neighbours for in fp32 (its InsertCastTransformer:
// Casts to fp32 before the node, back to fp16 after, the node's fp16 inputs and outputs made
// fp32). A node whose fp16 inputs all arrive as fp32 (and no fp32 input as fp16) is run so: its
// fp16 outputs are written as fp32 (the values the program rounded to fp16, which the Casts
// after it keep exactly).
bool RunsInFloat32(const std::vector<int64_t>& declared, const std::vector<ONNXTensorElementDataType>& actual) {
  if (declared.empty() || declared.size() != actual.size()) return false;
  bool converted = false;
  for (size_t k = 0; k < actual.size(); ++k) {
    if (declared[k] == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 && actual[k] == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
      converted = true;
    } else if (declared[k] != actual[k]) {
      return false;
    }
  }
  return converted;
}

// The element type output k is written in: `output_types`, or fp32 for an fp16 output of a node
// run in fp32 (RunsInFloat32).
ONNXTensorElementDataType OutputType(const std::vector<int64_t>& output_types, size_t k, bool in_float32) {
  const auto type = static_cast<ONNXTensorElementDataType>(output_types[k]);
  return in_float32 && type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : type;
}

#ifdef ONNXCAMPO_WITH_CUDA
// Which CUDA kernel runs FusedElementwise, read when ORT creates the kernel (so sessions made
// under different settings in one process can be compared): the generated one
// (elementwise_jit.h) unless $ONNXCAMPO_EW_KERNEL is "interpreter" (elementwise.cu).
enum class EwKernel { kGenerated, kInterpreter };
EwKernel ChosenEwKernel() {
  const char* value = std::getenv("ONNXCAMPO_EW_KERNEL");
  return value != nullptr && std::string(value) == "interpreter" ? EwKernel::kInterpreter : EwKernel::kGenerated;
}

// Says once per process, on stderr, that the slower interpreter kernel runs and why.
void WarnInterpreter(const std::string& why) {
  static std::once_flag once;
  std::call_once(once, [&] {
    std::fprintf(stderr, "onnxcampo_ops: FusedElementwise runs its interpreter kernel (slower): %s\n", why.c_str());
  });
}
#endif

// `column_sums` [k, Q], `column_sums_type` and `column_sums_shape` checked as the kernel and the
// shape inference read them (outputs: the node's elementwise outputs); "" or what is wrong.
std::string CheckColumnSums(const std::vector<int64_t>& sums, int64_t type, const std::vector<int64_t>& shape,
                            size_t outputs) {
  if (sums.size() != 2) return "attribute 'column_sums' must hold 2 ints [output, columns], got " + IntsText(sums);
  if (sums[0] < 0 || sums[0] >= static_cast<int64_t>(outputs)) {
    return "column_sums sums output " + std::to_string(sums[0]) + ", the node has " + std::to_string(outputs) +
           " elementwise outputs";
  }
  if (sums[1] < 1) return "column_sums' columns must be >= 1, got " + std::to_string(sums[1]);
  if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
    return "attribute 'column_sums_type' must be 1 (float32) or 10 (float16), got " + std::to_string(type);
  }
  int64_t count = 1;
  for (int64_t d : shape) {
    if (d < 0) return "attribute 'column_sums_shape' must be >= 0, got " + IntsText(shape);
    count *= d;
  }
  if (count != sums[1]) {
    return "attribute 'column_sums_shape' " + IntsText(shape) + " holds " + std::to_string(count) + " elements, " +
           std::to_string(sums[1]) + " columns are summed";
  }
  return "";
}

struct FusedElementwise {
  FusedElementwise(const OrtKernelInfo* info, bool cuda) : cuda(cuda) {
    Ort::ConstKernelInfo kernel_info(info);
    who = NodeWho(kFusedElementwise, info);
    bool found = false;
    const std::vector<int64_t> code = IntsAttribute(info, "program", &found);
    if (!found) Fail(who, "attribute 'program' (ints) is missing");
    int64_t register_count = 0;
    OrtStatus* status = Ort::GetApi().KernelInfoGetAttribute_int64(info, "registers", &register_count);
    if (status != nullptr) {
      Ort::GetApi().ReleaseStatus(status);
      Fail(who, "attribute 'registers' (int) is missing");
    }
    const std::vector<float> constants = FloatsAttribute(info, "constants", &found);  // absent: none
    output_types = IntsAttribute(info, "output_types", &found);
    if (!found) Fail(who, "attribute 'output_types' (ints) is missing");
    const size_t inputs = kernel_info.GetInputCount();
    const size_t outputs = kernel_info.GetOutputCount();
    const std::string error = ew::CheckProgram(code, register_count, constants, inputs, output_types, &program);
    if (!error.empty()) Fail(who, error);
    const std::vector<int64_t> sums = IntsAttribute(info, "column_sums", &found);
    if (found) {
      sum_type = IntAttribute(info, "column_sums_type", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
      sum_shape = IntsAttribute(info, "column_sums_shape", &found);
      if (!found && sums.size() == 2) sum_shape = {sums[1]};
      const std::string sums_error = CheckColumnSums(sums, sum_type, sum_shape, output_types.size());
      if (!sums_error.empty()) Fail(who, sums_error);
      sum_output = static_cast<int>(sums[0]);
      sum_columns = sums[1];
    }
    if (output_types.size() + (sum_output >= 0 ? 1 : 0) != outputs) {
      Fail(who, "output_types has " + std::to_string(output_types.size()) + " entries" +
                    (sum_output >= 0 ? " and column_sums one output" : "") + ", the node " + std::to_string(outputs) +
                    " outputs");
    }
    input_types = IntsAttribute(info, "input_types", &found);  // absent: no check, no fp32 run
    if (found && input_types.size() != inputs) {
      Fail(who, "input_types has " + std::to_string(input_types.size()) + " entries, the node " +
                    std::to_string(inputs) + " inputs");
    }
    std::vector<ONNXTensorElementDataType> actual;
    for (size_t k = 0; k < inputs; ++k) {
      const auto type = kernel_info.GetInputTypeInfo(k).GetTensorTypeAndShapeInfo().GetElementType();
      if (!IsFloatOrHalf(type)) Fail(who, "input " + std::to_string(k) + " must be float32 or float16");
      actual.push_back(type);
    }
    in_float32 = RunsInFloat32(input_types, actual);
    if (!input_types.empty() && !in_float32) {
      for (size_t k = 0; k < inputs; ++k) {
        if (actual[k] != static_cast<ONNXTensorElementDataType>(input_types[k])) {
          Fail(who, "input " + std::to_string(k) + " has element type " + std::to_string(actual[k]) +
                        ", input_types says " + std::to_string(input_types[k]));
        }
      }
    }
    for (size_t k = 0; k < output_types.size(); ++k) {
      const auto type = kernel_info.GetOutputTypeInfo(k).GetTensorTypeAndShapeInfo().GetElementType();
      if (type != OutputType(output_types, k, in_float32)) {
        Fail(who, "output " + std::to_string(k) + " is declared of element type " + std::to_string(type) +
                      ", output_types says " + std::to_string(output_types[k]));
      }
    }
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* context) {
    return StatusOf([&] { Compute(context); }, who, ORT_RUNTIME_EXCEPTION);
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    ew::Layout layout;
    const size_t inputs = ctx.GetInputCount();
    if (inputs < 1 || inputs > static_cast<size_t>(ew::kMaxInputs)) Fail(who, "1..16 inputs, got " + std::to_string(inputs));
    std::vector<std::vector<int64_t>> shapes;
    for (size_t k = 0; k < inputs; ++k) {
      Ort::ConstValue value = ctx.GetInput(k);
      auto info = value.GetTensorTypeAndShapeInfo();
      const auto type = info.GetElementType();
      if (!IsFloatOrHalf(type)) Fail(who, "input " + std::to_string(k) + " must be float32 or float16");
      shapes.push_back(info.GetShape());
      layout.in[k] = value.GetTensorRawData();
      if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) layout.in_half |= 1u << k;
    }
    std::vector<int64_t> shape;
    const std::string error = ew::Prepare(shapes, &shape, &layout);
    if (!error.empty()) Fail(who, error);
    layout.outputs = static_cast<int32_t>(output_types.size());
    for (size_t k = 0; k < output_types.size(); ++k) {
      Ort::UnownedValue value = ctx.GetOutput(k, shape);
      const auto type = value.GetTensorTypeAndShapeInfo().GetElementType();
      if (type != OutputType(output_types, k, in_float32)) {
        Fail(who, "output " + std::to_string(k) + " has element type " + std::to_string(type) + ", output_types says " +
                      std::to_string(output_types[k]));
      }
      layout.out[k] = value.GetTensorMutableRawData();
      if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) layout.out_half |= 1u << k;
    }
    if (sum_output >= 0) return ComputeWithSums(ctx, layout);
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) {
      RunCuda(ctx, layout, nullptr);
      return;
    }
#endif
    ew::FusedElementwiseCpu(program, layout, ThreadPoolRunner(ctx));
  }

  // The column sums of output sum_output as one more output. CUDA: a generated kernel adds them
  // as it stores (partial sums, JitSumGrid) and BlockReduceSum adds the partials up; where that
  // cannot run (no grid worth it, no scratch buffer, the interpreter), the stored output is
  // summed by BlockReduceSum after the kernel. CPU: the stored output is summed.
  void ComputeWithSums(Ort::KernelContext& ctx, const ew::Layout& layout) {
    const size_t m = output_types.size();
    Ort::UnownedValue value = ctx.GetOutput(m, sum_shape);
    const int64_t written = OutputType({sum_type}, 0, in_float32);
    if (value.GetTensorTypeAndShapeInfo().GetElementType() != written) {
      Fail(who, "output " + std::to_string(m) + " has element type " +
                    std::to_string(value.GetTensorTypeAndShapeInfo().GetElementType()) + ", column_sums_type says " +
                    std::to_string(sum_type));
    }
    if (layout.n % sum_columns != 0) {
      Fail(who, "column_sums: output " + std::to_string(sum_output) + " holds " + std::to_string(layout.n) +
                    " elements, not rows of " + std::to_string(sum_columns));
    }
    BlockReduceArgs args;
    args.x = layout.out[sum_output];
    args.x_half = layout.out_half >> sum_output & 1;
    args.y = value.GetTensorMutableRawData();
    args.y_half = written == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    args.P = layout.n / sum_columns, args.Q = sum_columns, args.R = 1;
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) {
      const OrtMemoryInfo* memory = value.GetTensorMemoryInfo();
      ew::JitSums sums;
      sums.output = sum_output;
      sums.columns = sum_columns;
      if (kernel == EwKernel::kGenerated && layout.n > 0 && ew::PlanJitSums(layout.n, sum_columns, ew::JitMaxBlocks(), &sums.grid)) {
        ScratchBuffer partials(ctx.GetOrtKernelContext(), memory, static_cast<size_t>(sums.grid.rows * sum_columns) * sizeof(float));
        sums.partials = static_cast<float*>(partials.get());
        if (sums.partials != nullptr && RunCuda(ctx, layout, &sums)) {
          BlockReduceArgs partial_args = args;
          partial_args.x = sums.partials;
          partial_args.x_half = false;
          partial_args.P = sums.grid.rows;
          return BlockReduceSumOnStream(ctx.GetOrtKernelContext(), memory, partial_args);
        }
      }
      RunCuda(ctx, layout, nullptr);
      return BlockReduceSumOnStream(ctx.GetOrtKernelContext(), memory, args);
    }
#endif
    ew::FusedElementwiseCpu(program, layout, ThreadPoolRunner(ctx));
    BlockReduceSumCpu(args, ThreadPoolRunner(ctx));
  }

#ifdef ONNXCAMPO_WITH_CUDA
  // The generated kernel (with `sums`, also the partial sums; false when it cannot run: nothing
  // ran) or, without sums, the interpreter where the generated kernel cannot run.
  bool RunCuda(Ort::KernelContext& ctx, const ew::Layout& layout, const ew::JitSums* sums) {
    std::string why;
    if (kernel == EwKernel::kGenerated && jit.Launch(program, layout, ctx.GetGPUComputeStream(), &why, sums)) return true;
    if (!why.empty()) WarnInterpreter(why);
    if (sums != nullptr) return false;
    ew::FusedElementwiseCuda(program, layout, ctx.GetGPUComputeStream());
    return true;
  }
#endif

  ew::Program program;
#ifdef ONNXCAMPO_WITH_CUDA
  EwKernel kernel = ChosenEwKernel();
  ew::JitKernel jit;
#endif
  std::vector<int64_t> output_types;
  std::vector<int64_t> input_types;
  int sum_output = -1;  // column_sums: the output summed, its columns, the sums' type and shape
  int64_t sum_columns = 0;
  int64_t sum_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  std::vector<int64_t> sum_shape;
  bool in_float32 = false;
  std::string who;
  bool cuda;
};

// An input's shape in shape inference: dims[d] >= 0 a number, -1 with names[d] a symbol, -1
// with "" unknown.
void ShapeInferInput(OrtShapeInferContext* ctx, size_t index, std::vector<int64_t>* dims, std::vector<std::string>* names,
                     ONNXTensorElementDataType* type) {
  const OrtApi& api = Ort::GetApi();
  OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
  Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(ctx, index, &info));
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

// Declares output `index` of the node as `type` with `dims` (-1: unknown) and `symbols` (a name
// per dimension, "" for none).
void ShapeInferOutput(OrtShapeInferContext* ctx, size_t index, ONNXTensorElementDataType type,
                      const std::vector<int64_t>& dims, const std::vector<const char*>& symbols) {
  const OrtApi& api = Ort::GetApi();
  OrtTensorTypeAndShapeInfo* info = nullptr;
  Ort::ThrowOnError(api.CreateTensorTypeAndShapeInfo(&info));
  std::unique_ptr<OrtTensorTypeAndShapeInfo, void (*)(OrtTensorTypeAndShapeInfo*)> owned(
      info, [](OrtTensorTypeAndShapeInfo* p) { Ort::GetApi().ReleaseTensorTypeAndShapeInfo(p); });
  Ort::ThrowOnError(api.SetTensorElementType(info, type));
  Ort::ThrowOnError(api.SetDimensions(info, dims.data(), dims.size()));
  Ort::ThrowOnError(api.SetSymbolicDimensions(info, const_cast<const char**>(symbols.data()), symbols.size()));
  Ort::ThrowOnError(api.ShapeInferContext_SetOutputTypeShape(ctx, index, info));
}

// ORT's type and shape inference for the node: element types from `output_types`, every
// output of the numpy broadcast of the input shapes. A dimension is a number where some input
// has a number other than 1, an input's symbol where the others have 1 or the same symbol, and
// a fresh symbol (onnxcampo_ew_<n>) where it cannot be known (distinct symbols, unknown
// dimensions). ORT shows an input without shape information as a scalar (rank 0), and this
// function cannot tell them apart. ORT ignores the status this function returns (custom_ops.cc):
// it reports nothing; the kernel checks the attributes when it is created. Only outputs
// 0 .. len(output_types)-1 are set: ORT does not tell the node's output count here, the kernel
// checks that it matches (ORT 1.32 refuses an index beyond the outputs; 1.21 does not check).
OrtStatusPtr ORT_API_CALL InferFusedElementwise(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  const OrtApi& api = Ort::GetApi();
  try {
    std::vector<int64_t> types;
    if (!InferInts(ctx, "output_types", &types) || types.empty() || types.size() > ew::kMaxOutputs) return nullptr;
    size_t inputs = 0;
    Ort::ThrowOnError(api.ShapeInferContext_GetInputCount(ctx, &inputs));
    std::vector<std::vector<int64_t>> dims(inputs);
    std::vector<std::vector<std::string>> names(inputs);
    std::vector<ONNXTensorElementDataType> actual(inputs);
    size_t rank = 0;
    for (size_t k = 0; k < inputs; ++k) {
      ShapeInferInput(ctx, k, &dims[k], &names[k], &actual[k]);
      rank = std::max(rank, dims[k].size());
    }
    std::vector<int64_t> declared;
    InferInts(ctx, "input_types", &declared);
    const bool in_float32 = RunsInFloat32(declared, actual);
    static std::atomic<uint64_t> fresh{0};
    std::vector<int64_t> shape(rank, 1);
    std::vector<std::string> symbols(rank);
    for (size_t d = 0; d < rank; ++d) {
      int64_t number = 1;
      std::string symbol;
      bool unknown = false;
      for (size_t k = 0; k < inputs; ++k) {
        if (dims[k].size() + d < rank) continue;  // a missing leading dimension: 1
        const size_t e = d + dims[k].size() - rank;
        if (dims[k][e] >= 0) {
          if (dims[k][e] != 1) number = dims[k][e];  // (a clash of numbers fails when the kernel runs)
        } else if (names[k][e].empty()) {
          unknown = true;
        } else if (symbol.empty()) {
          symbol = names[k][e];
        } else if (symbol != names[k][e]) {
          unknown = true;
        }
      }
      if (number != 1) {
        shape[d] = number;
      } else if (unknown) {
        shape[d] = -1;
        symbols[d] = "onnxcampo_ew_" + std::to_string(fresh++);
      } else if (!symbol.empty()) {
        shape[d] = -1;
        symbols[d] = symbol;
      }
    }
    std::vector<const char*> symbol_pointers(rank);
    for (size_t d = 0; d < rank; ++d) symbol_pointers[d] = symbols[d].c_str();
    for (size_t k = 0; k < types.size(); ++k) {
      if (types[k] != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && types[k] != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) continue;
      ShapeInferOutput(ctx, k, OutputType(types, k, in_float32), shape, symbol_pointers);
    }
    std::vector<int64_t> sums, sum_shape;
    if (InferInts(ctx, "column_sums", &sums)) {  // one more output: the column sums
      int64_t sum_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
      InferInt(ctx, "column_sums_type", &sum_type);
      if (!InferInts(ctx, "column_sums_shape", &sum_shape) && sums.size() == 2) sum_shape = {sums[1]};
      if (CheckColumnSums(sums, sum_type, sum_shape, types.size()).empty()) {
        ShapeInferOutput(ctx, types.size(), OutputType({sum_type}, 0, in_float32), sum_shape,
                         std::vector<const char*>(sum_shape.size(), ""));
      }
    }
  } catch (...) {  // nothing may unwind into ORT
  }
  return nullptr;
}

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
struct MultiTensorCastOp : OpBase<MultiTensorCastOp, MultiTensorCast> {
  explicit MultiTensorCastOp(bool cuda) : OpBase(cuda) { OrtCustomOp::InferOutputShapeFn = InferMultiTensorCast; }
  const char* GetName() const { return MultiTensorCast::kName; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const { return INPUT_OUTPUT_VARIADIC; }
  bool GetVariadicInputHomogeneity() const { return true; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t) const { return INPUT_OUTPUT_VARIADIC; }
  bool GetVariadicOutputHomogeneity() const { return true; }
};

// One variadic heterogeneous input (float16/float32 tensors) and one variadic heterogeneous
// output: ORT's own type inference gives up on such outputs, InferFusedElementwise sets them.
struct FusedElementwiseOp : OpBase<FusedElementwiseOp, FusedElementwise> {
  explicit FusedElementwiseOp(bool cuda) : OpBase(cuda) { OrtCustomOp::InferOutputShapeFn = InferFusedElementwise; }
  const char* GetName() const { return kFusedElementwise; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const { return INPUT_OUTPUT_VARIADIC; }
  bool GetVariadicInputHomogeneity() const { return false; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t) const { return INPUT_OUTPUT_VARIADIC; }
  bool GetVariadicOutputHomogeneity() const { return false; }
};

struct Library {
  Op<UnscaleCheckFinite> unscale_cpu{false};
  Op<CheckFinite> check_cpu{false};
  Op<MultiTensorSGD> sgd_cpu{false};
  Op<MultiTensorAdamW> adamw_cpu{false};
  MatMulU8Op<Accumulation::kTreeAverage> avg_matmul_cpu{"AvgMatMulInteger"};
  MatMulU8Op<Accumulation::kExact32> exact_matmul_cpu{"ExactMatMulInteger"};
  FusedElementwiseOp fused_elementwise_cpu{false};
  MultiTensorCastOp cast_cpu{false};
#ifdef ONNXCAMPO_WITH_CUDA
  Op<UnscaleCheckFinite> unscale_cuda{true};
  Op<CheckFinite> check_cuda{true};
  Op<MultiTensorSGD> sgd_cuda{true};
  Op<MultiTensorAdamW> adamw_cuda{true};
  FusedElementwiseOp fused_elementwise_cuda{true};
  MultiTensorCastOp cast_cuda{true};
#endif
  Ort::CustomOpDomain domain{kDomain};

  Library() {
    for (const OrtCustomOp* op : ScatterNDAddCustomOps(false)) domain.Add(op);  // scatter_op.cc
#ifdef ONNXCAMPO_WITH_CUDA
    for (const OrtCustomOp* op : ScatterNDAddCustomOps(true)) domain.Add(op);
#endif
    for (const OrtCustomOp* op : SoftmaxCrossEntropyCustomOps(false)) domain.Add(op);  // xent_op.cc
#ifdef ONNXCAMPO_WITH_CUDA
    for (const OrtCustomOp* op : SoftmaxCrossEntropyCustomOps(true)) domain.Add(op);
#endif
    domain.Add(&unscale_cpu);
    domain.Add(&check_cpu);
    domain.Add(&sgd_cpu);
    domain.Add(&adamw_cpu);
    domain.Add(&avg_matmul_cpu);
    domain.Add(&exact_matmul_cpu);
    domain.Add(&fused_elementwise_cpu);
    domain.Add(&cast_cpu);
    domain.Add(Im2ColOp(false));
    domain.Add(ConvWeightGradOp(false));
    domain.Add(ConvNhwcOp(false));  // conv_nhwc_op.cc
    domain.Add(ConvNhwcDataGradOp(false));
    domain.Add(ConvNhwcWeightGradOp(false));
    domain.Add(MaxPoolNhwcOp(false));  // max_pool_op.cc
    domain.Add(MaxPoolNhwcGradOp(false));
    domain.Add(LayerNormGradOp(false));  // norm_op.cc
    domain.Add(SoftmaxGradOp(false));
#ifdef ONNXCAMPO_WITH_CUDA
    domain.Add(&unscale_cuda);
    domain.Add(&check_cuda);
    domain.Add(&sgd_cuda);
    domain.Add(&adamw_cuda);
    domain.Add(&fused_elementwise_cuda);
    domain.Add(&cast_cuda);
    domain.Add(Im2ColOp(true));
    domain.Add(ConvWeightGradOp(true));
    domain.Add(ConvNhwcOp(true));
    domain.Add(ConvNhwcDataGradOp(true));
    domain.Add(ConvNhwcWeightGradOp(true));
    domain.Add(MaxPoolNhwcOp(true));
    domain.Add(MaxPoolNhwcGradOp(true));
    domain.Add(LayerNormGradOp(true));
    domain.Add(SoftmaxGradOp(true));
#endif
    AddBlockReduceSumOps(domain);
    AddNchwToNhwcOps(domain);
  }
};

}  // namespace
}  // namespace onnxcampo

// The domain and its ops live as long as the process: every session that registers the
// library shares them.
extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // runtime older than the headers: the ops stay unknown, load fails clearly
  Ort::InitApi(api);
  static onnxcampo::Library* library = nullptr;
  static std::mutex lock;
  try {
    std::lock_guard<std::mutex> guard(lock);
    if (library == nullptr) library = new onnxcampo::Library();
    Ort::UnownedSessionOptions(options).Add(library->domain);
    return nullptr;
  } catch (const std::exception& e) {
    return Ort::Status(e).release();
  }
}

#define ONNXCAMPO_STR2(x) #x
#define ONNXCAMPO_STR(x) ONNXCAMPO_STR2(x)

// "cpu" or "cpu+cuda", the ORT API version of the headers, and the 8-bit matmul kernel this
// CPU runs ("avx2", "neon" or "scalar") (read by onnxcampo.ops).
extern "C" __attribute__((visibility("default"))) const char* OnnxcampoOpsBuildInfo() {
#ifdef ONNXCAMPO_WITH_CUDA
  static const std::string info = std::string("kernels=cpu+cuda ort_api=" ONNXCAMPO_STR(ORT_API_VERSION) " matmul_u8=") +
                                  onnxcampo::MatMulU8Isa();
#else
  static const std::string info = std::string("kernels=cpu ort_api=" ONNXCAMPO_STR(ORT_API_VERSION) " matmul_u8=") +
                                  onnxcampo::MatMulU8Isa();
#endif
  return info.c_str();
}

// What FusedElementwise's generated CUDA kernels did in this process (ew::JitStats), "" in a
// library without CUDA (read by onnxcampo.ops.jit.kernel_stats).
extern "C" __attribute__((visibility("default"))) const char* OnnxcampoFusedElementwiseStats() {
#ifdef ONNXCAMPO_WITH_CUDA
  static thread_local std::string text;
  text = onnxcampo::ew::JitStats();
  return text.c_str();
#else
  return "";
#endif
}

// The grid a generated FusedElementwise kernel that sums columns runs (ew::PlanJitSums), for the
// tests: returns 1 and fills out[0..2] with blocks, rows, combine when there is one, else 0.
extern "C" __attribute__((visibility("default"))) int OnnxcampoJitSumGrid(int64_t n, int64_t q, int max_blocks,
                                                                           int64_t* out) {
  onnxcampo::ew::JitSumGrid grid;
  if (!onnxcampo::ew::PlanJitSums(n, q, max_blocks, &grid)) return 0;
  out[0] = grid.blocks, out[1] = grid.rows, out[2] = grid.combine;
  return 1;
}

// The CUDA source FusedElementwise's generated kernel has for a node and one call's input shapes
// (elementwise_jit.h), for tests and scripts (onnxcampo.ops.jit): `shapes` holds the inputs'
// dimensions one after the other, `ranks[k]` how many are input k's, `input_types[k]` 1 or 10;
// `sum_output` >= 0: the kernel also sums that output's `sum_columns` columns (column_sums).
// Writes the source (NUL-terminated) into `buffer` when it fits and returns its length; a
// negative return -L says the program or shapes are refused and `buffer` holds why (L bytes).
extern "C" __attribute__((visibility("default"))) int64_t OnnxcampoFusedElementwiseSource(
    const int64_t* program, int64_t program_length, int64_t registers, const float* constants, int64_t constant_count,
    const int64_t* output_types, int64_t outputs, const int64_t* input_types, const int64_t* shapes,
    const int64_t* ranks, int64_t inputs, int32_t literal_shape, int32_t sum_output, int64_t sum_columns, char* buffer,
    int64_t size) {
  using namespace onnxcampo::ew;
  std::string text;
  bool refused = true;
  try {
    Program p;
    const std::vector<int64_t> types(output_types, output_types + outputs);
    text = CheckProgram(std::vector<int64_t>(program, program + program_length), registers,
                        std::vector<float>(constants, constants + constant_count), static_cast<size_t>(inputs), types, &p);
    if (text.empty()) {
      std::vector<std::vector<int64_t>> dims;
      for (int64_t k = 0, at = 0; k < inputs; at += ranks[k++]) dims.emplace_back(shapes + at, shapes + at + ranks[k]);
      std::vector<int64_t> shape;
      Layout layout;
      text = Prepare(dims, &shape, &layout);
      if (text.empty()) {
        layout.outputs = static_cast<int32_t>(outputs);
        for (int64_t k = 0; k < inputs; ++k) layout.in_half |= (input_types[k] == 10 ? 1u : 0u) << k;
        for (int64_t k = 0; k < outputs; ++k) layout.out_half |= (output_types[k] == 10 ? 1u : 0u) << k;
        JitOptions options;
        options.index64 = layout.n >= (int64_t{1} << 31);
        options.literal_shape = literal_shape != 0;
        options.sum_output = sum_output;
        options.sum_columns = sum_columns;
        text = GenerateSource(p, layout, options);
        refused = false;
      }
    }
  } catch (const std::exception& e) {
    text = e.what();
  }
  const int64_t length = static_cast<int64_t>(text.size());
  if (buffer != nullptr && size > length) std::memcpy(buffer, text.c_str(), text.size() + 1);
  return refused ? -length : length;
}
