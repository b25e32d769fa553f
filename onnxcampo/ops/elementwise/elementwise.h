// FusedElementwise (ai.onnxcampo): a register program run per output element over broadcast
// inputs (onnxcampo/ops/elementwise/__init__.py specifies it; docs/ops.md describes the kernels).
//
// This header is shared by the CPU kernel (elementwise.cc, g++) and the CUDA kernel
// (elementwise.cu, nvcc): the instruction semantics below are one __host__ __device__ code, so
// both kernels run the same float32 operations in the same order. Free of ONNX Runtime types.
//
// Arithmetic is float32, one rounding per operation: the library is built with
// -ffp-contract=off (host) and -fmad=false (device), so no product is fused into a sum.
// float16 <-> float32 conversions are exact / round to nearest even, inf, NaN and subnormals
// included: in software on the host, with cuda_fp16.h's intrinsics on the device.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "parallel.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define ONNXCAMPO_HD __host__ __device__ __forceinline__
#else
#define ONNXCAMPO_HD inline
#endif

namespace onnxcampo {
namespace ew {

// The limits of onnxcampo/ops/elementwise/__init__.py.
constexpr int kMaxInputs = 16;
constexpr int kMaxOutputs = 8;
constexpr int kMaxRegisters = 32;
constexpr int kMaxInstructions = 128;
constexpr int kMaxDims = 8;  // dimensions left after collapsing (Prepare)

enum Opcode : uint8_t {
  kLoad = 0, kConst = 1, kStore = 2,
  kAdd = 3, kSub = 4, kMul = 5, kDiv = 6, kPow = 7, kMax = 8, kMin = 9,
  kNeg = 10, kAbs = 11, kExp = 12, kLog = 13, kSqrt = 14, kRecip = 15, kTanh = 16, kErf = 17, kSigmoid = 18,
  kRelu = 19, kRoundF16 = 20, kCopy = 21,
  // comparisons: 1.0f where true, else 0.0f (false when an operand is NaN, as ONNX's; what
// Cast(Greater(a, b), to=float) gives)
  kGreater = 22, kLess = 23, kGreaterEqual = 24, kLessEqual = 25, kEqual = 26,
  kOpcodeCount = 27,
};

// Whether `op` reads two registers (a, b).
ONNXCAMPO_HD bool IsBinaryOp(int64_t op) { return (op >= kAdd && op <= kMin) || (op >= kGreater && op <= kEqual); }

// One instruction: r[dst] = f(r[a], r[b]). LOAD: `a` is the input; CONST: `a` indexes
// Program::constants (compacted: the node's constants that CONSTs read, in order of first
// use); STORE: `dst` is the output, `a` the register. Unused fields are 0.
struct Instr {
  uint8_t op, dst, a, b;
};

// A checked program (CheckProgram), by value: it travels as part of the CUDA kernel parameter.
struct Program {
  Instr code[kMaxInstructions] = {};
  float constants[kMaxInstructions] = {};
  int32_t count = 0;      // instructions
  int32_t registers = 0;  // registers used: r[0 .. registers-1]
};

// Where an input's element i lies.
enum InputKind : uint8_t {
  kFull = 0,     // contiguous and of the output's shape: element i
  kScalar = 1,   // one element broadcast everywhere: element 0
  kStrided = 2,  // sum over d of coordinate_d(i) * stride[d] (0 on broadcast dimensions)
};

// One call's tensors after broadcasting and collapsing (Prepare). `dim` is the collapsed
// output shape (outermost first; the output is contiguous), `stride[k]` input k's strides in
// elements over it. `half` bit k: input k (resp. output k) holds float16, else float32.
struct Layout {
  const void* in[kMaxInputs] = {};
  void* out[kMaxOutputs] = {};
  int64_t stride[kMaxInputs][kMaxDims] = {};
  int64_t dim[kMaxDims] = {};
  int64_t n = 0;  // output elements
  int32_t rank = 0, inputs = 0, outputs = 0;
  uint32_t in_half = 0, out_half = 0;
  uint8_t kind[kMaxInputs] = {};
  uint8_t any_strided = 0;  // some input is kStrided
};

// ---- float16 <-> float32 -------------------------------------------------------------------

// A float32's bits as a uint32, and back.
#if defined(__CUDA_ARCH__)
ONNXCAMPO_HD uint32_t FloatBits(float f) { return __float_as_uint(f); }
ONNXCAMPO_HD float BitsFloat(uint32_t u) { return __uint_as_float(u); }
#else
// memcpy: the portable bit cast before C++20's std::bit_cast (compiled to one register move).
template <typename To, typename From>
ONNXCAMPO_HD To BitCast(From from) {
  static_assert(sizeof(To) == sizeof(From), "a bit cast keeps the size");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}
ONNXCAMPO_HD uint32_t FloatBits(float f) { return BitCast<uint32_t>(f); }
ONNXCAMPO_HD float BitsFloat(uint32_t u) { return BitCast<float>(u); }
#endif

// Exact: every float16 is a float32. Host: branch-free (the block loops vectorise); a
// subnormal is renormalised by one exact float32 subtraction.
ONNXCAMPO_HD float HalfBitsToFloat(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t bits = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent and mantissa, float32 places
  const uint32_t exponent = bits & 0x0f800000u;
  const uint32_t normal = bits + 0x38000000u;                      // rebias 15 -> 127
  const uint32_t special = normal + 0x38000000u;                    // inf, NaN: exponent 255
  const float tiny = BitsFloat(normal + 0x00800000u) - BitsFloat(0x38800000u);  // subnormal, zero: exact
  const uint32_t magnitude = exponent == 0x0f800000u ? special : (exponent == 0 ? FloatBits(tiny) : normal);
  return BitsFloat(sign | magnitude);
#endif
}

// Round to nearest, ties to even; beyond the largest float16 (65504, ties at 65520) to inf;
// NaN stays NaN (quiet). Host: branch-free; a subnormal result is rounded by one float32
// addition (the default rounding mode, which ONNX Runtime keeps).
ONNXCAMPO_HD uint16_t FloatToHalfBits(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t x = FloatBits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  // normal float16: rebias the exponent, add half an ulp less one plus the kept lowest bit
  // (ties to even), drop 13 bits; a carry moves into the exponent, up to inf at 65520
  const uint32_t normal = (abs + 0xc8000fffu + ((abs >> 13) & 1u)) >> 13;
  // subnormal float16 (abs < 2^-14): adding 0.5 aligns the value's 2^-24 units to the bottom of
  // the float32 mantissa, rounded to nearest even by the addition itself
  const uint32_t subnormal = FloatBits(BitsFloat(abs) + 0.5f) - 0x3f000000u;
  const uint32_t finite = abs < 0x38800000u ? subnormal : normal;
  const uint32_t magnitude = abs >= 0x47800000u ? (abs > 0x7f800000u ? 0x7e00u : 0x7c00u) : finite;
  return static_cast<uint16_t>(sign | magnitude);
#endif
}

ONNXCAMPO_HD float RoundF16(float x) { return HalfBitsToFloat(FloatToHalfBits(x)); }

// Element i of a float32 or float16 (half) buffer as float32, and a float32 stored into one:
// the CPU reference kernels' loads and stores (conv_grad_cpu.cc, conv_nhwc_cpu.cc, norm_cpu.cc, xent_cpu.cc).
inline float LoadAsFloat(const void* p, int64_t i, bool half) {
  return half ? HalfBitsToFloat(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}
inline void StoreFloat(void* p, int64_t i, float v, bool half) {
  if (half) {
    static_cast<uint16_t*>(p)[i] = FloatToHalfBits(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

// ---- the instructions ----------------------------------------------------------------------

ONNXCAMPO_HD bool IsNan(float x) { return x != x; }

// numpy's maximum/minimum: NaN if either is NaN.
ONNXCAMPO_HD float Max(float x, float y) { return (x >= y || IsNan(x)) ? x : y; }
ONNXCAMPO_HD float Min(float x, float y) { return (x <= y || IsNan(x)) ? x : y; }

ONNXCAMPO_HD float Binary(uint8_t op, float x, float y) {
  switch (op) {
    case kAdd: return x + y;
    case kSub: return x - y;
    case kMul: return x * y;
    case kDiv: return x / y;
    case kPow: return powf(x, y);
    case kMax: return Max(x, y);
    case kGreater: return x > y ? 1.0f : 0.0f;
    case kLess: return x < y ? 1.0f : 0.0f;
    case kGreaterEqual: return x >= y ? 1.0f : 0.0f;
    case kLessEqual: return x <= y ? 1.0f : 0.0f;
    case kEqual: return x == y ? 1.0f : 0.0f;
    default: return Min(x, y);  // kMin
  }
}

ONNXCAMPO_HD float Unary(uint8_t op, float x) {
  switch (op) {
    case kNeg: return -x;
    case kAbs: return fabsf(x);
    case kExp: return expf(x);
    case kLog: return logf(x);
    case kSqrt: return sqrtf(x);
    case kRecip: return 1.0f / x;
    case kTanh: return tanhf(x);
    case kErf: return erff(x);
    case kSigmoid: return 1.0f / (1.0f + expf(-x));
    case kRelu: return x < 0.0f ? 0.0f : x;  // NaN is not < 0: it stays
    case kRoundF16: return RoundF16(x);
    default: return x;  // kCopy
  }
}

// Runs the program on W elements at once ("lanes"; the first `lanes` are real): r is the
// register file, r[k][j] register k of lane j. load(input, dst) fills dst[0 .. W-1] with
// input `input` as float32 (lanes past `lanes` may hold anything finite); store(output, src)
// writes src's first `lanes` values. Every lane runs the same operations as a one-element
// call would, so the results do not depend on W or on how elements are grouped.
template <int W, typename Load, typename Store>
ONNXCAMPO_HD void Execute(const Program& p, float (*r)[W], Load& load, Store& store) {
  for (int k = 0; k < p.count; ++k) {
    const Instr in = p.code[k];
    float* d = r[in.dst];
    const float* a = r[in.a];
    const float* b = r[in.b];
    switch (in.op) {
      case kLoad:
        load(in.a, d);
        break;
      case kConst: {
        const float c = p.constants[in.a];
        for (int j = 0; j < W; ++j) d[j] = c;
        break;
      }
      case kStore:
        store(in.dst, a);
        break;
      // One loop per opcode, the opcode fixed inside: the compiler vectorises the host loops.
      case kAdd: for (int j = 0; j < W; ++j) d[j] = a[j] + b[j]; break;
      case kSub: for (int j = 0; j < W; ++j) d[j] = a[j] - b[j]; break;
      case kMul: for (int j = 0; j < W; ++j) d[j] = a[j] * b[j]; break;
      case kDiv: for (int j = 0; j < W; ++j) d[j] = a[j] / b[j]; break;
      case kPow: for (int j = 0; j < W; ++j) d[j] = Binary(kPow, a[j], b[j]); break;
      case kMax: for (int j = 0; j < W; ++j) d[j] = Max(a[j], b[j]); break;
      case kMin: for (int j = 0; j < W; ++j) d[j] = Min(a[j], b[j]); break;
      case kGreater: for (int j = 0; j < W; ++j) d[j] = a[j] > b[j] ? 1.0f : 0.0f; break;
      case kLess: for (int j = 0; j < W; ++j) d[j] = a[j] < b[j] ? 1.0f : 0.0f; break;
      case kGreaterEqual: for (int j = 0; j < W; ++j) d[j] = a[j] >= b[j] ? 1.0f : 0.0f; break;
      case kLessEqual: for (int j = 0; j < W; ++j) d[j] = a[j] <= b[j] ? 1.0f : 0.0f; break;
      case kEqual: for (int j = 0; j < W; ++j) d[j] = a[j] == b[j] ? 1.0f : 0.0f; break;
      case kNeg: for (int j = 0; j < W; ++j) d[j] = -a[j]; break;
      case kAbs: for (int j = 0; j < W; ++j) d[j] = fabsf(a[j]); break;
      case kExp: for (int j = 0; j < W; ++j) d[j] = Unary(kExp, a[j]); break;
      case kLog: for (int j = 0; j < W; ++j) d[j] = Unary(kLog, a[j]); break;
      case kSqrt: for (int j = 0; j < W; ++j) d[j] = sqrtf(a[j]); break;
      case kRecip: for (int j = 0; j < W; ++j) d[j] = 1.0f / a[j]; break;
      case kTanh: for (int j = 0; j < W; ++j) d[j] = Unary(kTanh, a[j]); break;
      case kErf: for (int j = 0; j < W; ++j) d[j] = Unary(kErf, a[j]); break;
      case kSigmoid: for (int j = 0; j < W; ++j) d[j] = Unary(kSigmoid, a[j]); break;
      case kRelu: for (int j = 0; j < W; ++j) d[j] = Unary(kRelu, a[j]); break;
      case kRoundF16: for (int j = 0; j < W; ++j) d[j] = RoundF16(a[j]); break;
      default: for (int j = 0; j < W; ++j) d[j] = a[j]; break;  // kCopy (d may be a)
    }
  }
}

// ---- host side (elementwise.cc) ------------------------------------------------------------

// The node's attributes as ONNX holds them. CheckProgram returns "" when the program is one
// the kernels run (the rules and messages of elementwise.check), else what is wrong, and
// fills `out` (compacted constants, narrowed fields).
std::string CheckProgram(const std::vector<int64_t>& program, int64_t registers, const std::vector<float>& constants,
                         size_t inputs, const std::vector<int64_t>& output_types, Program* out);

// The output shape (numpy broadcasting of `shapes`) and the layout of a call over it:
// size-1 dimensions dropped, adjacent dimensions merged where every input allows it. Returns ""
// or why not (shapes that do not broadcast, more than kMaxDims dimensions left). Pointers are
// left for the caller.
std::string Prepare(const std::vector<std::vector<int64_t>>& shapes, std::vector<int64_t>* out_shape, Layout* layout);

// The output elements cut into chunks that `run` spreads over threads.
void FusedElementwiseCpu(const Program& program, const Layout& layout, const ParallelRunner& run);

#ifdef ONNXCAMPO_WITH_CUDA
// The interpreter kernel (the generated kernels' fallback, elementwise_jit.h): one launch on
// `stream` (a cudaStream_t), none for an empty output; no allocation, no sync.
void FusedElementwiseCuda(const Program& program, const Layout& layout, void* stream);
#endif

}  // namespace ew
}  // namespace onnxcampo
