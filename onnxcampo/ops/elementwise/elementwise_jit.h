// FusedElementwise's generated kernels: a CUDA source written for one program and one call
// layout (elementwise_codegen.cc, plain C++: the CPU library carries it too, so tests read the
// sources without a GPU), compiled by NVRTC and launched on ORT's stream (elementwise_jit.cu).
//
// Why: the interpreter kernels (elementwise.cu) decode every instruction per element group and
// index their register file at run time; measured on the H200 they ran 0.5-0.65x the speed of
// ONNX Runtime's unfused ops. A generated kernel is the program as straight-line code: values
// live in hardware registers, constants are literals, an input broadcast to everything is read
// once per thread, the collapsed shape's sizes are literals (index arithmetic by constants).
//
// The generated code computes exactly what Execute (elementwise.h) computes: the same float32
// operations in the same order, the same libdevice functions (expf, logf, tanhf, erff, powf,
// IEEE division and square root, no FMA contraction: --fmad=false) and the same float16
// conversions (cvt.f32.f16 and cvt.rn.f16.f32, what cuda_fp16.h's intrinsics are).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "elementwise.h"

namespace onnxcampo {
namespace ew {

// What a generated source is specialised for besides the program and the layout's kinds,
// element types and rank: 64-bit element indices (an output of 2^31 elements or more), and
// whether the collapsed shape's sizes and the strided inputs' strides are written into the
// source as literals (else the kernel reads them from its parameter).
struct JitOptions {
  bool index64 = false;
  bool literal_shape = true;
  // Column sums (FusedElementwise's `column_sums`): output `sum_output`, read as a row-major
  // [n / sum_columns, sum_columns] array, is also summed per column, each thread adding the
  // values it stores (as stored: rounded to the output's type) into float32 partial sums it
  // writes to Params::sums once at the end (JitSumGrid says where). -1: none.
  int sum_output = -1;
  int64_t sum_columns = 0;
};

// The generated kernel's name and threads per block.
constexpr const char* kJitKernelName = "onnxcampo_fused_elementwise";
constexpr int kJitThreads = 256;
constexpr int kJitLanes = 4;  // consecutive elements a thread computes per step

// The grid of a generated kernel that sums columns. A thread of the grid-stride loop keeps the
// same Q columns from step to step when the grid's stride (blocks * kJitThreads * kJitLanes
// elements) is a multiple of Q, so its kJitLanes partial sums stay in registers. At the end
// each thread writes them: with `combine` (Q divides a block's kJitThreads * kJitLanes elements)
// the block first adds the threads holding the same columns (through shared memory, in a fixed
// order) and writes one row of Q sums; else every thread writes its own, the element index it
// started at giving the place. Either way Params::sums receives a row-major float32 [rows, Q]
// array whose column sums are the output's (BlockReduceSum adds them up).
struct JitSumGrid {
  int blocks = 0;
  int64_t rows = 0;
  bool combine = false;
};

// The grid for n output elements summed over Q columns, near the usual one (`max_blocks`
// resident blocks, fewer when n is small). False when there is none worth running: Q not a
// multiple of kJitLanes or not dividing n, or partial sums that would take as many bytes as a
// float16 copy of the output they sum (the caller sums the stored output instead).
bool PlanJitSums(int64_t n, int64_t Q, int max_blocks, JitSumGrid* grid);

// The CUDA source of one kernel for `program` over calls of `layout`'s form (pointers and, with
// literal_shape, nothing else of the layout may change between the calls it serves).
std::string GenerateSource(const Program& program, const Layout& layout, const JitOptions& options);

// The generated kernel's one parameter, by value (__grid_constant__): the same fields, types
// and order as the `Params` struct the source declares (GenerateSource writes it).
struct JitParams {
  const void* in[kMaxInputs];
  void* out[kMaxOutputs];
  int64_t stride[kMaxInputs][kMaxDims];
  int64_t dim[kMaxDims];
  int64_t n;
  uint32_t in_aligned;   // bit k: input k's pointer allows a kJitLanes-element vector load
  uint32_t out_aligned;  // bit k: output k's likewise
  float* sums;           // JitOptions::sum_output >= 0: the partial sums [rows, Q] (JitSumGrid)
};

#ifdef ONNXCAMPO_WITH_CUDA
// A node's generated kernels. Launch runs one call on `stream` (a cudaStream_t): the kernel for
// the call's layout is compiled on the first call of that layout (one NVRTC compile per source
// and device architecture in the process), and kept for the next calls of the same layout
// (compared field by field: no source is generated again). Returns false, with why in
// `*reason`, when no generated kernel can run (NVRTC not found, a compile or load failure, or a
// first call for its source while the stream is being captured into a CUDA graph): the caller
// runs the interpreter kernel instead. Throws for a failed launch. Thread-safe.
// What the generated kernels did in this process: "generated=<launches> interpreter=<launches
// that fell back> compiled=<NVRTC compiles> cached=<cubins read from the disk cache>".
std::string JitStats();

// The blocks a generated kernel launches at most on the current device (8 resident a
// multiprocessor): PlanJitSums's max_blocks.
int JitMaxBlocks();

// With `sums` (its sum_output and sum_columns, and `partials`, grid.rows * Q floats on the
// device), the kernel also writes the column sums' partials (JitSumGrid) for the grid `grid`.
struct JitSums {
  int output = -1;
  int64_t columns = 0;
  JitSumGrid grid;
  float* partials = nullptr;
};

class JitKernel {
 public:
  bool Launch(const Program& program, const Layout& layout, void* stream, std::string* reason,
              const JitSums* sums = nullptr);

 private:
  std::mutex mutex_;
  std::vector<int64_t> signature_;  // the last call's layout, less its pointers
  const void* kernel_ = nullptr;    // its kernel (a cudaKernel_t), null when it has none
  std::string error_;               // why it has none
};
#endif

}  // namespace ew
}  // namespace onnxcampo
