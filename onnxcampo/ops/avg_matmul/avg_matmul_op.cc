// The ONNX Runtime ops of the 8-bit matmuls (avg_matmul.h has the arithmetic; docs/avg-matmul.md):
//
//   AvgMatMulInteger(A, B[, a_zero_point, b_zero_point]) -> Y   (uint8 x uint8 -> float32, the
//       tree-averaging 16-bit accumulation of the averaging-networks seed)
//   ExactMatMulInteger(A, B[, a_zero_point, b_zero_point]) -> Y (the same with exact 32-bit
//       accumulation: the baseline the averaging kernel is measured against)
//
// CPU only.
#include <string>
#include <vector>

#include "avg_matmul.h"
#include "op_util.h"

namespace onnxcampo {
namespace {

// ---- 8-bit matmuls: A (uint8, M x K), B (uint8, K x N), optional uint8 zero points (a scalar,
// or one per row of A / column of B) -> Y (float32, M x N). CPU only.
template <Accumulation kMode>
constexpr const char* kMatMulU8Name = kMode == Accumulation::kTreeAverage ? "AvgMatMulInteger" : "ExactMatMulInteger";

template <Accumulation kMode>
struct MatMulU8Kernel {
  MatMulU8Kernel(const OrtKernelInfo*, bool) : name(kMatMulU8Name<kMode>) {}

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
struct MatMulU8Op : OpBase<MatMulU8Op<kMode>, MatMulU8Kernel<kMode>> {
  using OpBase<MatMulU8Op<kMode>, MatMulU8Kernel<kMode>>::OpBase;
  const char* GetName() const { return kMatMulU8Name<kMode>; }
  size_t GetInputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index < 2 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

ONNXCAMPO_REGISTER_CPU_OPS(avg_matmul, MatMulU8Op<Accumulation::kTreeAverage>, MatMulU8Op<Accumulation::kExact32>);

}  // namespace onnxcampo
