// FusedElementwise's interpreter kernel on CUDA, the fallback of the generated kernels
// (elementwise_jit.h; measured 3-7x slower than they): one launch per call (none for an empty
// output) on ORT's compute stream. The program, its constants, the pointers, element types and strides travel by value
// in one kernel parameter (Params, __grid_constant__, about 2.4 KB: read from the constant bank,
// no device copy, no allocation, no host-device synchronisation), so the op can be captured in a
// CUDA graph.
//
// Grid-stride loop over groups of kW consecutive elements: a thread runs the program on its
// group's kW lanes at once (the instructions of elementwise.h's Execute, with its Binary and
// Unary: the CPU kernel's operations), so each instruction is decoded once per kW elements.
// The register file lives in shared memory, laid out [register][lane][thread] so that a warp's
// accesses fall in distinct banks; the program indexes it at run time, which a per-thread array
// would turn into local-memory traffic (measured on the H200: 250-650 GB/s, slower than the
// unfused ops). A block holds registers x kW x kThreads floats (8 KB for 4 registers). Inputs are read by kind
// (elementwise.h): kFull and kScalar with no index arithmetic (a group of a kFull input whose
// pointer is aligned is one 16-byte float32 or 8-byte float16 load; outputs likewise), kStrided
// from the group's coordinates in the collapsed shape. A kernel without strided inputs does not
// compute coordinates at all. 32-bit indices when the output has fewer than 2^31 elements.
//
// Built with -fmad=false (no FMA contraction); division and square root are IEEE-rounded
// (nvcc's defaults -prec-div=true -prec-sqrt=true; the library does not use --use_fast_math).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "cuda_util.h"
#include "elementwise.h"

namespace onnxcampo {
namespace ew {
namespace {

constexpr int kThreads = 128;
constexpr int kBlocksPerSm = 16;  // the grid-stride loop's blocks; shared memory bounds how many run at once
constexpr int kW = 4;             // elements per thread and step

struct Params {
  Program program;
  Layout layout;
  uint32_t in_aligned = 0, out_aligned = 0;  // bit k: the pointer allows kW-element vector access
};
static_assert(sizeof(Params) <= 4096, "FusedElementwise kernel parameter exceeds 4 KB");

int MaxBlocks() { return MultiprocessorCount() * kBlocksPerSm; }

template <typename Index, bool kStrided>
__global__ void __launch_bounds__(kThreads) FusedElementwiseKernel(const __grid_constant__ Params p) {
  const Layout& t = p.layout;
  const Index n = static_cast<Index>(t.n);
  const Index groups = (n + kW - 1) / kW;
  extern __shared__ float file[];  // [register][lane][thread]
  auto reg = [&](int k, int j) -> float& { return file[(k * kW + j) * kThreads + threadIdx.x]; };
  for (Index g = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x; g < groups;
       g += static_cast<Index>(gridDim.x) * kThreads) {
    const Index first = g * kW;
    const int lanes = n - first < static_cast<Index>(kW) ? static_cast<int>(n - first) : kW;
    // Coordinates of the group's elements in the collapsed shape (kStrided only); the loops
    // over dimensions are unrolled so that the coordinates stay in registers.
    Index coord[kW][kMaxDims];
    if (kStrided) {
      Index rest = first;
#pragma unroll
      for (int d = kMaxDims - 1; d >= 0; --d) {
        if (d < t.rank) {
          const Index size = static_cast<Index>(t.dim[d]);
          coord[0][d] = rest % size;
          rest /= size;
        } else {
          coord[0][d] = 0;
        }
      }
#pragma unroll
      for (int j = 1; j < kW; ++j) {
        bool carry = true;
#pragma unroll
        for (int d = kMaxDims - 1; d >= 0; --d) {
          Index c = coord[j - 1][d];
          if (carry && d < t.rank) {
            ++c;
            carry = c == static_cast<Index>(t.dim[d]);
            if (carry) c = 0;
          }
          coord[j][d] = c;
        }
      }
    }
    auto load = [&](int k, float* dst) {
      const bool half = t.in_half >> k & 1;
      const uint8_t kind = t.kind[k];
      if (kind == kScalar) {
        const float v = half ? HalfBitsToFloat(*static_cast<const uint16_t*>(t.in[k])) : *static_cast<const float*>(t.in[k]);
#pragma unroll
        for (int j = 0; j < kW; ++j) dst[j] = v;
      } else if (kind == kFull || !kStrided) {
        if (lanes == kW && (p.in_aligned >> k & 1)) {
          if (half) {
            const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(t.in[k]) + first);
            dst[0] = HalfBitsToFloat(static_cast<uint16_t>(raw.x & 0xffffu));
            dst[1] = HalfBitsToFloat(static_cast<uint16_t>(raw.x >> 16));
            dst[2] = HalfBitsToFloat(static_cast<uint16_t>(raw.y & 0xffffu));
            dst[3] = HalfBitsToFloat(static_cast<uint16_t>(raw.y >> 16));
          } else {
            const float4 v = *reinterpret_cast<const float4*>(static_cast<const float*>(t.in[k]) + first);
            dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
          }
        } else {
#pragma unroll
          for (int j = 0; j < kW; ++j) {
            if (j < lanes) {
              dst[j] = half ? HalfBitsToFloat(static_cast<const uint16_t*>(t.in[k])[first + j])
                            : static_cast<const float*>(t.in[k])[first + j];
            } else {
              dst[j] = 0.0f;
            }
          }
        }
      } else {  // kStrided
#pragma unroll
        for (int j = 0; j < kW; ++j) {
          if (j < lanes) {
            Index offset = 0;
#pragma unroll
            for (int d = 0; d < kMaxDims; ++d) {
              if (d < t.rank) offset += coord[j][d] * static_cast<Index>(t.stride[k][d]);
            }
            dst[j] = half ? HalfBitsToFloat(static_cast<const uint16_t*>(t.in[k])[offset])
                          : static_cast<const float*>(t.in[k])[offset];
          } else {
            dst[j] = 0.0f;
          }
        }
      }
    };
    auto store = [&](int k, const float* src) {
      const bool half = t.out_half >> k & 1;
      if (lanes == kW && (p.out_aligned >> k & 1)) {
        if (half) {
          uint2 raw;
          raw.x = static_cast<uint32_t>(FloatToHalfBits(src[0])) | static_cast<uint32_t>(FloatToHalfBits(src[1])) << 16;
          raw.y = static_cast<uint32_t>(FloatToHalfBits(src[2])) | static_cast<uint32_t>(FloatToHalfBits(src[3])) << 16;
          *reinterpret_cast<uint2*>(static_cast<uint16_t*>(t.out[k]) + first) = raw;
        } else {
          *reinterpret_cast<float4*>(static_cast<float*>(t.out[k]) + first) = make_float4(src[0], src[1], src[2], src[3]);
        }
        return;
      }
#pragma unroll
      for (int j = 0; j < kW; ++j) {
        if (j < lanes) {
          if (half) {
            static_cast<uint16_t*>(t.out[k])[first + j] = FloatToHalfBits(src[j]);
          } else {
            static_cast<float*>(t.out[k])[first + j] = src[j];
          }
        }
      }
    };
    const Program& prog = p.program;
    for (int k = 0; k < prog.count; ++k) {
      const Instr in = prog.code[k];
      float v[kW];
      switch (in.op) {
        case kLoad:
          load(in.a, v);
          break;
        case kConst:
#pragma unroll
          for (int j = 0; j < kW; ++j) v[j] = prog.constants[in.a];
          break;
        case kStore: {
#pragma unroll
          for (int j = 0; j < kW; ++j) v[j] = reg(in.a, j);
          store(in.dst, v);
          continue;
        }
        case kAdd: case kSub: case kMul: case kDiv: case kPow: case kMax: case kMin:
        case kGreater: case kLess: case kGreaterEqual: case kLessEqual: case kEqual:
#pragma unroll
          for (int j = 0; j < kW; ++j) v[j] = Binary(in.op, reg(in.a, j), reg(in.b, j));
          break;
        default:
#pragma unroll
          for (int j = 0; j < kW; ++j) v[j] = Unary(in.op, reg(in.a, j));
          break;
      }
#pragma unroll
      for (int j = 0; j < kW; ++j) reg(in.dst, j) = v[j];  // operands were read first: dst may be a or b
    }
  }
}

bool Aligned(const void* pointer, bool half) {
  return reinterpret_cast<uintptr_t>(pointer) % (half ? 2 * kW : 4 * kW) == 0;
}

// The register file's bytes; above 48 KB a kernel must opt in, once per kernel.
size_t FileBytes(int registers) { return static_cast<size_t>(registers) * kW * kThreads * sizeof(float); }

template <typename Index, bool kStrided>
void LaunchOne(const Params& params, int blocks, cudaStream_t stream) {
  static const bool opted_in = [] {
    return cudaFuncSetAttribute(FusedElementwiseKernel<Index, kStrided>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                static_cast<int>(FileBytes(kMaxRegisters))) == cudaSuccess;
  }();
  const size_t bytes = FileBytes(std::max(1, params.program.registers));
  if (!opted_in && bytes > 48 * 1024) {
    throw std::runtime_error("FusedElementwise: the device refuses " + std::to_string(bytes) +
                             " bytes of shared memory for the register file");
  }
  FusedElementwiseKernel<Index, kStrided><<<blocks, kThreads, bytes, stream>>>(params);
}

template <typename Index>
void Launch(const Params& params, int blocks, cudaStream_t stream) {
  if (params.layout.any_strided) {
    LaunchOne<Index, true>(params, blocks, stream);
  } else {
    LaunchOne<Index, false>(params, blocks, stream);
  }
}

}  // namespace

void FusedElementwiseCuda(const Program& program, const Layout& layout, void* stream_handle) {
  if (layout.n == 0) return;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  Params params;
  params.program = program;
  params.layout = layout;
  for (int k = 0; k < layout.inputs; ++k) {
    if (Aligned(layout.in[k], layout.in_half >> k & 1)) params.in_aligned |= 1u << k;
  }
  for (int k = 0; k < layout.outputs; ++k) {
    if (Aligned(layout.out[k], layout.out_half >> k & 1)) params.out_aligned |= 1u << k;
  }
  const int64_t groups = (layout.n + kW - 1) / kW;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((groups + kThreads - 1) / kThreads, MaxBlocks())));
  if (layout.n < (int64_t{1} << 31)) {
    Launch<uint32_t>(params, blocks, stream);
  } else {
    Launch<int64_t>(params, blocks, stream);
  }
  CudaCheck(cudaGetLastError(), "FusedElementwise launch");
}

}  // namespace ew
}  // namespace onnxcampo
