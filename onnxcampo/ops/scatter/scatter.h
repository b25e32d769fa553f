// ScatterNDAdd(data, indices, updates) -> output: ONNX ScatterND with reduction="add".
//
//   output = copy of data; for every index tuple t (indices viewed as [tuples, k]):
//     output[indices[t, 0], ..., indices[t, k-1], ...] += updates[t, ...]
//
// data, updates and output are float32 or float16 (one type), indices int64. The slice an index
// tuple selects is data.shape[k:], `slice` elements long and contiguous in row-major order, so a
// tuple's destination is one offset (sum of index_j * stride_j) and its update is the `slice`
// elements of updates that follow t * slice. Negative indices count from the end (ONNX: an index
// of dimension j lies in [-d_j, d_j - 1]). Out of range: the CPU kernel fails (ScatterError),
// the CUDA kernel clamps as ONNX Runtime's own CUDA kernel does (>= d_j: d_j - 1; < -d_j: 0).
//
// Free of ONNX Runtime types: scatter_op.cc reads the call, scatter_cpu.cc and scatter.cu
// compute it. Pointers are host memory for the CPU kernel, device memory for the CUDA kernel.
#pragma once

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace onnxcampo {

// Index tuples longer than this are refused (by both kernels, so that they agree): the CUDA
// kernel passes dims and strides by value, and no model indexes that many dimensions.
constexpr int kScatterMaxIndexDims = 16;

struct ScatterArgs {
  const void* data = nullptr;
  const int64_t* indices = nullptr;  // [tuples, k]
  const void* updates = nullptr;     // [tuples, slice]
  void* output = nullptr;            // like data
  bool half = false;                 // float16 (else float32)
  int64_t data_elements = 0;
  int64_t tuples = 0;
  int64_t slice = 0;
  int k = 0;
  int64_t dims[kScatterMaxIndexDims] = {};     // data.shape[0 .. k-1]
  int64_t strides[kScatterMaxIndexDims] = {};  // elements between neighbours along dimension j
};

// An index out of range (CPU kernel): the message says which one.
struct ScatterError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Serial, in index order: every output element sums data, then its updates in the order of their
// tuples (float32 arithmetic; float16 rounds after each addition, as numpy's np.add.at does).
void ScatterNDAddCpu(const ScatterArgs& args);

#ifdef ONNXCAMPO_WITH_CUDA
// One device-to-device copy of data into output, then one launch of one thread per update
// element (per 2 or 4 of them when the slice allows vector atomics), on `stream` (a cudaStream_t);
// nothing allocated, nothing synchronised: CUDA graph capture records both.
void ScatterNDAddCuda(const ScatterArgs& args, void* stream);
#endif

}  // namespace onnxcampo
