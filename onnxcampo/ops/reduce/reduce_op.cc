// The ONNX Runtime op ai.onnxcampo::BlockReduceSum (reduce.h has the arithmetic):
//
//   BlockReduceSum[sizes = [P, Q, R], output_type = 1 | 10, output_shape](x) -> y
//
// x: float32 or float16, any shape of P*Q*R elements, read as a contiguous [P, Q, R] array;
// y: the sum over axes 0 and 2, Q elements of `output_type` (1 float32, the default; 10
// float16) shaped `output_shape` (default [Q]). Accumulation in float32, one rounding at the end.
//
// Registered for the CPU and (built with CUDA) the CUDA provider (ONNXCAMPO_REGISTER_OPS
// below); ORT learns y's type and shape from the attributes (InferBlockReduceSum).
//
// CUDA workspace: a call whose plan splits the reduction takes partials * Q float32 values from
// the session's device allocator (KernelContext_GetScratchBuffer, ORT's arena, ordered on the
// compute stream like the scratch buffers of ORT's own kernels) and hands them back after the
// launches; with the arena nothing reaches cudaMalloc once it has grown, also while a CUDA graph
// is captured. Where ORT gives no buffer, the call runs unsplit (one kernel, less parallel).
#include <string>
#include <vector>

#include "op_util.h"
#include "reduce.h"

namespace onnxcampo {

#ifdef ONNXCAMPO_WITH_CUDA
// BlockReduceSumCuda on the context's compute stream, its workspace (if the plan splits) a
// scratch buffer of the allocator `memory` names (where x lives); unsplit where ORT gives none.
// Also run by FusedElementwise's column sums (elementwise/elementwise_op.cc).
void BlockReduceSumOnStream(OrtKernelContext* ctx, const OrtMemoryInfo* memory, const BlockReduceArgs& args);
#endif

namespace {

constexpr char kName[] = "BlockReduceSum";

// The type y is written in: output_type, or float32 for a float16 y when x was planned in float16
// (`input_type`) and arrives as float32 (ORT's CPU provider running the node in fp32).
int64_t WrittenType(int64_t declared, ONNXTensorElementDataType actual, int64_t output_type) {
  const bool in_float32 = declared == kHalfType && actual == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  return in_float32 && output_type == kHalfType ? kFloatType : output_type;
}

// sizes, output_type and output_shape checked as the kernel and the shape inference read them;
// returns "" or what is wrong.
std::string CheckAttributes(const std::vector<int64_t>& sizes, int64_t output_type, const std::vector<int64_t>& shape) {
  if (sizes.size() != 3) return "attribute 'sizes' must hold 3 ints [P, Q, R], got " + std::to_string(sizes.size());
  for (int64_t s : sizes) {
    if (s < 0) return "attribute 'sizes' must be >= 0, got " + ShapeText(sizes);
  }
  return OutputAttributesError("output_type", output_type, "output_shape", shape, sizes[1],
                               "Q is " + std::to_string(sizes[1]));
}

struct BlockReduceSumKernel : NodeKernel<BlockReduceSumKernel> {
  BlockReduceSumKernel(const OrtKernelInfo* info, bool cuda) : NodeKernel<BlockReduceSumKernel>(kName, info, cuda) {
    Ort::ConstKernelInfo kernel_info(info);
    bool found = false;
    const std::vector<int64_t> sizes = IntsAttribute(info, "sizes", &found);
    if (!found) Fail("attribute 'sizes' (ints [P, Q, R]) is missing");
    output_type = IntAttribute(info, "output_type", kFloatType);  // absent: float32
    shape = IntsAttribute(info, "output_shape", &found);
    if (!found && sizes.size() == 3) shape = {sizes[1]};
    const std::string error = CheckAttributes(sizes, output_type, shape);
    if (!error.empty()) Fail(error);
    P = sizes[0], Q = sizes[1], R = sizes[2];
    const int64_t declared = IntAttribute(info, "input_type", 0);  // absent: no fp32 run
    const auto actual = kernel_info.GetInputTypeInfo(0).GetTensorTypeAndShapeInfo().GetElementType();
    output_type = WrittenType(declared, actual, output_type);
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    Ort::ConstValue input = ctx.GetInput(0);
    auto info = input.GetTensorTypeAndShapeInfo();
    const auto type = info.GetElementType();
    if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
      Fail("x must be float32 or float16");
    }
    const int64_t count = static_cast<int64_t>(info.GetElementCount());
    if (count != P * Q * R) {
      Fail("x " + ShapeText(info.GetShape()) + " holds " + std::to_string(count) + " elements, sizes " +
                    ShapeText({P, Q, R}) + " " + std::to_string(P * Q * R));
    }
    Ort::UnownedValue output = ctx.GetOutput(0, shape);
    if (output.GetTensorTypeAndShapeInfo().GetElementType() != output_type) {
      Fail("y has element type " + std::to_string(output.GetTensorTypeAndShapeInfo().GetElementType()) +
                    ", output_type says " + std::to_string(output_type));
    }
    BlockReduceArgs args;
    args.x = input.GetTensorRawData();
    args.x_half = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
    args.y = output.GetTensorMutableRawData();
    args.y_half = output_type == kHalfType;
    args.P = P, args.Q = Q, args.R = R;
#ifdef ONNXCAMPO_WITH_CUDA
    if (cuda) return ComputeCuda(ctx, input, args);
#endif
    BlockReduceSumCpu(args, ThreadPoolRunner(ctx));
  }

#ifdef ONNXCAMPO_WITH_CUDA
  void ComputeCuda(Ort::KernelContext& ctx, Ort::ConstValue& input, const BlockReduceArgs& args) const {
    BlockReduceSumOnStream(ctx.GetOrtKernelContext(), input.GetTensorMemoryInfo(), args);
  }
#endif

  int64_t P = 0, Q = 0, R = 0;
  int64_t output_type = kFloatType;
  std::vector<int64_t> shape;
};

// y's element type from output_type and its shape from output_shape (or [Q]). With `input_type`
// (the type x was planned in) float16 and x arriving as float32, ORT's CPU provider runs the
// node in fp32 (its InsertCastTransformer casts around an fp16 node whose neighbours have no
// fp16 CPU kernels, and makes the node's fp16 tensors fp32): a float16 y is then written as
// float32, the float32 sum itself (ORT casts it where a reader needs float16). Attributes that
// the kernel would refuse leave y as ORT's own inference left it (x's type, no shape); the
// kernel's creation then says what is wrong. ORT ignores the returned status; nothing throws.
OrtStatusPtr ORT_API_CALL InferBlockReduceSum(const OrtCustomOp*, OrtShapeInferContext* ctx) noexcept {
  const OrtApi& api = Ort::GetApi();
  Quietly([&] {  // nothing may unwind into ORT
    std::vector<int64_t> sizes, shape;
    int64_t output_type = kFloatType, declared = 0;
    if (!InferInts(ctx, "sizes", &sizes) || sizes.size() != 3) return;
    if (!InferInt(ctx, "output_type", &output_type)) output_type = kFloatType;
    if (!InferInts(ctx, "output_shape", &shape)) shape = {sizes[1]};
    if (!CheckAttributes(sizes, output_type, shape).empty()) return;
    if (InferInt(ctx, "input_type", &declared)) {
      OrtTensorTypeAndShapeInfo* x = nullptr;  // owned by the context
      ONNXTensorElementDataType actual = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
      Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(ctx, 0, &x));
      Ort::ThrowOnError(api.GetTensorElementType(x, &actual));
      output_type = WrittenType(declared, actual, output_type);
    }
    ShapeInferOutput(ctx, 0, static_cast<ONNXTensorElementDataType>(output_type), shape);
  });
  return nullptr;
}

// One input of any type (float16 or float32, checked by the kernel) and one output whose type
// the inference function sets.
using BlockReduceSumOp = UntypedUnaryOp<kName, BlockReduceSumKernel, InferBlockReduceSum>;

ONNXCAMPO_REGISTER_OPS(reduce, BlockReduceSumOp);

}  // namespace

#ifdef ONNXCAMPO_WITH_CUDA
void BlockReduceSumOnStream(OrtKernelContext* ctx, const OrtMemoryInfo* memory, const BlockReduceArgs& args) {
  void* stream = Ort::KernelContext(ctx).GetGPUComputeStream();
  const BlockReducePlan plan = PlanBlockReduceCuda(args, true);
  if (plan.workspace_bytes == 0) return BlockReduceSumCuda(args, plan, nullptr, stream);
  ScratchBuffer workspace(ctx, memory, plan.workspace_bytes);
  if (workspace.get() == nullptr) return BlockReduceSumCuda(args, PlanBlockReduceCuda(args, false), nullptr, stream);
  BlockReduceSumCuda(args, plan, workspace.get(), stream);
}
#endif

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
