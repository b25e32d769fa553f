// cuDNN convolutions on CUDA (conv_grad.h): ConvWeightGrad's backward filter (NCHW) and the NHWC
// ops' forward (grouped too: cudnnSetConvolutionGroupCount), backward-data and backward-filter
// calls (conv_nhwc.h), cuDNN loaded at run
// time (dlopen: the library links no cuDNN; ONNX Runtime's CUDA provider has loaded it already,
// else $ONNXCAMPO_CUDNN or libcudnn.so.9 on the loader's path). The declarations below are the
// few cuDNN 9 entry points and constants used (cudnn_ops.h, cudnn_cnn.h; opaque handles).
//
// Per (device, stream): one cuDNN handle and one workspace, grown to the largest a shape needs.
// Per shape (in the process): the algorithm that runs fastest on the first call of the shape,
// timed here (cudaEvents, a warm-up then the best of two blocks of three calls each, each block
// queued behind a kernel that holds the stream until the host has enqueued it, so the events
// time the GPU and not cuDNN's host cost: at batch 1 a call's ~85 us on the host hid every
// algorithm's kernel, and the choice fell on implicit_convolve_sgemm, 1.96 of ResNet-50's 2.25
// GPU ms; docs/benchmarks/custom-ops/2026-12-03a/) among those
// cudnnFind*Algorithm lists as working within kMaxWorkspace. Find's own
// single-trial ranking was not trusted: on the H200 it chose wgrad_alg0 (0.76 ms) for the
// ResNet-50 1x1 c128 28 x 28 shape where a GEMM-based algorithm takes about 0.04 ms
// (docs/benchmarks/custom-ops/2026-12-01a/conv_grad.json). Planning synchronises and
// allocates: ORT's runs before a CUDA-graph capture make those calls.
// ONNXCAMPO_CONV_GRAD_LOG=1 prints each shape's candidates and choice to stderr.
// float16 tensors run with Tensor Core math and float32 accumulation (compute type float), as
// ORT's Conv does; float32 tensors with cuDNN's default math (TF32 on Ampere and later, as
// ORT's use_tf32 default).
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "conv_grad.h"
#include "cuda_util.h"

namespace onnxcampo {
namespace {

using Handle = void*;
using Desc = void*;
enum : int { kNchw = 0, kNhwc = 1, kFloat = 0, kHalf = 2, kCrossCorrelation = 1, kDefaultMath = 0, kTensorOpMath = 1 };
struct AlgoPerf {  // cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t (one layout)
  int algo;
  int status;
  float time;
  size_t memory;
  int determinism;
  int math_type;
  int reserved[3];
};

struct Cudnn {
  int (*create)(Handle*) = nullptr;
  int (*set_stream)(Handle, cudaStream_t) = nullptr;
  int (*create_tensor)(Desc*) = nullptr;
  int (*set_tensor)(Desc, int, int, int, int, int, int) = nullptr;
  int (*create_filter)(Desc*) = nullptr;
  int (*set_filter)(Desc, int, int, int, int, int, int) = nullptr;
  int (*create_conv)(Desc*) = nullptr;
  int (*set_conv)(Desc, int, int, int, int, int, int, int, int) = nullptr;
  int (*set_math)(Desc, int) = nullptr;
  int (*set_group)(Desc, int) = nullptr;
  // per ConvKind (forward, data, filter): Find, the workspace size and the call; the descriptor
  // arguments in cuDNN's order for that kind (forward x, w, conv, y; data w, dy, conv, dx;
  // filter x, dy, conv, dw)
  using Find = int (*)(Handle, Desc, Desc, Desc, Desc, int, int*, AlgoPerf*);
  using Workspace = int (*)(Handle, Desc, Desc, Desc, Desc, int, size_t*);
  using Call = int (*)(Handle, const void*, Desc, const void*, Desc, const void*, Desc, int, void*, size_t,
                       const void*, Desc, void*);
  Find find[3] = {nullptr, nullptr, nullptr};
  Workspace workspace[3] = {nullptr, nullptr, nullptr};
  Call call[3] = {nullptr, nullptr, nullptr};
  const char* (*error)(int) = nullptr;
  std::string problem;  // why cuDNN is not usable ("" when it is)
};

const Cudnn& LoadCudnn() {
  static const Cudnn cudnn = [] {
    Cudnn c;
    void* library = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_NOLOAD);  // ORT's CUDA provider's
    if (library == nullptr) {
      const char* path = std::getenv("ONNXCAMPO_CUDNN");
      library = dlopen(path != nullptr && *path ? path : "libcudnn.so.9", RTLD_NOW | RTLD_LOCAL);
    }
    if (library == nullptr) {
      c.problem = "cuDNN 9 not found (libcudnn.so.9; ONNX Runtime's CUDA provider loads it, or set ONNXCAMPO_CUDNN)";
      return c;
    }
    const bool bound =
        Bind(library, "cudnnCreate", &c.create) && Bind(library, "cudnnSetStream", &c.set_stream) &&
        Bind(library, "cudnnCreateTensorDescriptor", &c.create_tensor) &&
        Bind(library, "cudnnSetTensor4dDescriptor", &c.set_tensor) &&
        Bind(library, "cudnnCreateFilterDescriptor", &c.create_filter) &&
        Bind(library, "cudnnSetFilter4dDescriptor", &c.set_filter) &&
        Bind(library, "cudnnCreateConvolutionDescriptor", &c.create_conv) &&
        Bind(library, "cudnnSetConvolution2dDescriptor", &c.set_conv) &&
        Bind(library, "cudnnSetConvolutionMathType", &c.set_math) &&
        Bind(library, "cudnnSetConvolutionGroupCount", &c.set_group) &&
        Bind(library, "cudnnFindConvolutionForwardAlgorithm", &c.find[0]) &&
        Bind(library, "cudnnGetConvolutionForwardWorkspaceSize", &c.workspace[0]) &&
        Bind(library, "cudnnConvolutionForward", &c.call[0]) &&
        Bind(library, "cudnnFindConvolutionBackwardDataAlgorithm", &c.find[1]) &&
        Bind(library, "cudnnGetConvolutionBackwardDataWorkspaceSize", &c.workspace[1]) &&
        Bind(library, "cudnnConvolutionBackwardData", &c.call[1]) &&
        Bind(library, "cudnnFindConvolutionBackwardFilterAlgorithm", &c.find[2]) &&
        Bind(library, "cudnnGetConvolutionBackwardFilterWorkspaceSize", &c.workspace[2]) &&
        Bind(library, "cudnnConvolutionBackwardFilter", &c.call[2]) &&
        Bind(library, "cudnnGetErrorString", &c.error);
    if (!bound) c.problem = "libcudnn.so.9 lacks a cuDNN convolution entry point the library uses";
    return c;
  }();
  return cudnn;
}

void Check(const Cudnn& c, int status, const char* what) {
  if (status != 0) {
    throw std::runtime_error(std::string("cuDNN ") + what + " failed: " + (c.error ? c.error(status) : "?"));
  }
}

constexpr size_t kMaxWorkspace = size_t{256} << 20;  // an algorithm needing more is not taken

// The descriptors and algorithm of one shape.
struct Plan {
  Desc x = nullptr, y = nullptr, filter = nullptr, conv = nullptr;
  int algo = 0;
  size_t workspace = 0;
};

int KindIndex(ConvKind kind) { return kind == ConvKind::kForward ? 0 : kind == ConvKind::kData ? 1 : 2; }
const char* KindName(ConvKind kind) {
  return kind == ConvKind::kForward ? "forward" : kind == ConvKind::kData ? "backward-data" : "backward-filter";
}

// The four descriptors in cuDNN's order for the call's kind, and its two data pointers.
struct Operands {
  Desc d[4];
  const void* in[2];
};
Operands OperandsOf(const Plan& p, const ConvCall& g) {
  switch (g.kind) {
    case ConvKind::kForward: return {{p.x, p.filter, p.conv, p.y}, {g.x, g.w}};
    case ConvKind::kData: return {{p.filter, p.y, p.conv, p.x}, {g.w, g.dy}};
    default: return {{p.x, p.y, p.conv, p.filter}, {g.x, g.dy}};
  }
}

int Launch(const Cudnn& c, Handle handle, const Plan& p, const ConvCall& g, int algo, void* workspace, size_t size) {
  const float one = 1.0f, zero = 0.0f;
  const Operands o = OperandsOf(p, g);
  return c.call[KindIndex(g.kind)](handle, &one, o.d[0], o.in[0], o.d[1], o.in[1], o.d[2], algo, workspace, size,
                                   &zero, o.d[3], g.out);
}

// A stream's cuDNN handle and workspace.
struct StreamState {
  Handle handle = nullptr;
  void* workspace = nullptr;
  size_t size = 0;
};

std::mutex mutex;

std::map<std::pair<int, cudaStream_t>, StreamState>& Streams() {
  static std::map<std::pair<int, cudaStream_t>, StreamState> streams;
  return streams;
}

using ShapeKey = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;
std::map<ShapeKey, Plan>& Plans() {
  static std::map<ShapeKey, Plan> plans;
  return plans;
}

int Narrow(int64_t value, const char* what) {
  if (value < 0 || value > (int64_t{1} << 31) - 1) throw std::runtime_error(std::string(what) + " exceeds cuDNN's int range");
  return static_cast<int>(value);
}

// Holds the stream for `ns` nanoseconds of GPU time (the global timer), so that what the host
// enqueues meanwhile runs back to back after it.
__global__ void HoldStream(unsigned long long ns) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

// Times each candidate on the call's own tensors (dw is overwritten by the real call after) and
// returns the fastest: per algorithm one warm-up call, then two blocks of three calls between
// cudaEvents, the faster block counting; each block behind HoldStream for four times the host
// time of its three calls (estimated from the warm-up call; at least 50 us, at most 20 ms), so
// the block's kernels run back to back and the events measure their GPU time. A temporary
// workspace of the largest candidate's size.
int FastestAlgo(const Cudnn& c, Handle handle, const Plan& p, const ConvCall& g,
                const std::vector<AlgoPerf>& candidates, cudaStream_t stream) {
  size_t largest = 0;
  for (const AlgoPerf& a : candidates) largest = std::max(largest, a.memory);
  void* workspace = nullptr;
  if (largest > 0) CudaCheck(cudaMalloc(&workspace, largest), "cudaMalloc (cuDNN algorithm timing)");
  cudaEvent_t start = nullptr, stop = nullptr;
  CudaCheck(cudaEventCreate(&start), "cudaEventCreate");
  CudaCheck(cudaEventCreate(&stop), "cudaEventCreate");
  const bool log = std::getenv("ONNXCAMPO_CONV_GRAD_LOG") != nullptr;
  int best = candidates[0].algo;
  float best_ms = -1.0f;
  std::string report;
  for (const AlgoPerf& a : candidates) {
    auto call = [&] { return Launch(c, handle, p, g, a.algo, workspace, largest); };
    const auto host_start = std::chrono::steady_clock::now();
    if (call() != 0) continue;  // listed but not runnable here: not a candidate
    const double host_ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - host_start)
            .count();
    const auto hold_ns =
        static_cast<unsigned long long>(std::min(2.0e7, std::max(5.0e4, 4.0 * 3.0 * host_ns)));
    float ms = -1.0f;
    for (int block = 0; block < 2; ++block) {
      HoldStream<<<1, 1, 0, stream>>>(hold_ns);
      CudaCheck(cudaGetLastError(), "HoldStream launch");
      CudaCheck(cudaEventRecord(start, stream), "cudaEventRecord");
      for (int k = 0; k < 3; ++k) Check(c, call(), "cuDNN convolution (timing)");
      CudaCheck(cudaEventRecord(stop, stream), "cudaEventRecord");
      CudaCheck(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float elapsed = 0.0f;
      CudaCheck(cudaEventElapsedTime(&elapsed, start, stop), "cudaEventElapsedTime");
      if (ms < 0.0f || elapsed / 3.0f < ms) ms = elapsed / 3.0f;
    }
    if (log) report += " algo " + std::to_string(a.algo) + " " + std::to_string(ms) + " ms (find " + std::to_string(a.time) + ");";
    if (best_ms < 0.0f || ms < best_ms) {
      best_ms = ms;
      best = a.algo;
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  CudaCheck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (workspace != nullptr) CudaCheck(cudaFree(workspace), "cudaFree");
  if (log) {
    std::fprintf(stderr, "onnxcampo cuDNN %s%s x[%lld,%lld,%lld,%lld] dy[%lld,%lld,%lld,%lld] k%lldx%lld s%lld g%lld:%s chosen %d\n",
                 KindName(g.kind), g.nhwc ? " NHWC" : "", static_cast<long long>(g.n), static_cast<long long>(g.cin),
                 static_cast<long long>(g.h), static_cast<long long>(g.w_), static_cast<long long>(g.n),
                 static_cast<long long>(g.cout),
                 static_cast<long long>(g.ho), static_cast<long long>(g.wo), static_cast<long long>(g.a.kh),
                 static_cast<long long>(g.a.kw), static_cast<long long>(g.a.sh), static_cast<long long>(g.group),
                 report.c_str(), best);
  }
  return best;
}

Plan MakePlan(const Cudnn& c, Handle handle, const ConvCall& g, cudaStream_t stream) {
  const Im2ColAttrs& a = g.a;
  Plan p;
  const int type = g.half ? kHalf : kFloat;
  const int layout = g.nhwc ? kNhwc : kNchw;
  Check(c, c.create_tensor(&p.x), "cudnnCreateTensorDescriptor");
  Check(c, c.set_tensor(p.x, layout, type, Narrow(g.n, "N"), Narrow(g.cin, "Cin"), Narrow(g.h, "H"), Narrow(g.w_, "W")),
        "cudnnSetTensor4dDescriptor (x)");
  Check(c, c.create_tensor(&p.y), "cudnnCreateTensorDescriptor");
  Check(c, c.set_tensor(p.y, layout, type, Narrow(g.n, "N"), Narrow(g.cout, "Cout"), Narrow(g.ho, "Ho"), Narrow(g.wo, "Wo")),
        "cudnnSetTensor4dDescriptor (y)");
  // a grouped convolution's filter holds Cin / group input channels (KRSC: [Cout, kh, kw, Cin / group])
  Check(c, c.create_filter(&p.filter), "cudnnCreateFilterDescriptor");
  Check(c, c.set_filter(p.filter, type, g.krsc ? kNhwc : kNchw, Narrow(g.cout, "Cout"), Narrow(g.cin / g.group, "Cin"),
                        Narrow(a.kh, "kh"), Narrow(a.kw, "kw")),
        "cudnnSetFilter4dDescriptor");
  Check(c, c.create_conv(&p.conv), "cudnnCreateConvolutionDescriptor");
  Check(c, c.set_conv(p.conv, Narrow(a.pt, "pad"), Narrow(a.pl, "pad"), Narrow(a.sh, "stride"), Narrow(a.sw, "stride"),
                      Narrow(a.dh, "dilation"), Narrow(a.dw, "dilation"), kCrossCorrelation, kFloat),
        "cudnnSetConvolution2dDescriptor");
  Check(c, c.set_math(p.conv, g.half ? kTensorOpMath : kDefaultMath), "cudnnSetConvolutionMathType");
  if (g.group != 1) Check(c, c.set_group(p.conv, Narrow(g.group, "group")), "cudnnSetConvolutionGroupCount");
  AlgoPerf perf[10] = {};
  int found = 0;
  const Operands o = OperandsOf(p, g);
  const int kind = KindIndex(g.kind);
  Check(c, c.find[kind](handle, o.d[0], o.d[1], o.d[2], o.d[3], 10, &found, perf), "cudnnFindConvolution*Algorithm");
  std::vector<AlgoPerf> candidates;
  for (int k = 0; k < found; ++k) {
    if (perf[k].status == 0 && perf[k].memory <= kMaxWorkspace) candidates.push_back(perf[k]);
  }
  if (candidates.empty()) {
    throw std::runtime_error(std::string("cuDNN has no ") + KindName(g.kind) +
                             " algorithm for this shape within 256 MB of workspace");
  }
  p.algo = candidates[0].algo;
  if (candidates.size() > 1) p.algo = FastestAlgo(c, handle, p, g, candidates, stream);
  Check(c, c.workspace[kind](handle, o.d[0], o.d[1], o.d[2], o.d[3], p.algo, &p.workspace),
        "cudnnGetConvolution*WorkspaceSize");
  return p;
}

}  // namespace

void CudnnConvolution(const ConvCall& g, void* stream_handle) {
  const int64_t out_size = g.kind == ConvKind::kForward ? g.n * g.cout * g.ho * g.wo
                           : g.kind == ConvKind::kData  ? g.n * g.cin * g.h * g.w_
                                                        : g.cout * g.cin * g.a.kh * g.a.kw;
  if (out_size == 0) return;
  const Cudnn& c = LoadCudnn();
  if (!c.problem.empty()) throw std::runtime_error(c.problem);
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  if (g.group < 1 || g.cin % g.group != 0 || g.cout % g.group != 0 || (g.group != 1 && g.kind != ConvKind::kForward)) {
    throw std::runtime_error("cuDNN convolution: group must divide Cin and Cout, and be 1 for the gradients");
  }
  const int64_t summed = g.kind == ConvKind::kForward ? g.cin / g.group * g.a.kh * g.a.kw
                         : g.kind == ConvKind::kData  ? g.cout * g.a.kh * g.a.kw
                                                      : g.n * g.ho * g.wo;
  if (summed == 0) {  // an empty sum: zeros
    CudaCheck(cudaMemsetAsync(g.out, 0, static_cast<size_t>(out_size) * (g.half ? 2 : 4), stream), "cudaMemsetAsync");
    return;
  }
  int device = 0;
  CudaCheck(cudaGetDevice(&device), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mutex);  // cuDNN calls enqueue work only; the lock covers the bookkeeping too
  StreamState& state = Streams()[{device, stream}];
  if (state.handle == nullptr) Check(c, c.create(&state.handle), "cudnnCreate");
  Check(c, c.set_stream(state.handle, stream), "cudnnSetStream");
  const Im2ColAttrs& a = g.a;
  const int variant = KindIndex(g.kind) * 8 + (g.half ? 4 : 0) + (g.nhwc ? 2 : 0) + (g.krsc ? 1 : 0);
  const ShapeKey key{device, variant, g.n, g.cin, g.h, g.w_, g.cout, g.ho, g.wo, a.kh, a.kw, a.sh, a.sw, a.dh, a.dw,
                     a.pt * 1000003 + a.pl, g.group};
  auto found = Plans().find(key);
  if (found == Plans().end()) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CudaCheck(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone) {
      throw std::runtime_error("a new shape cannot be planned while the stream is captured into a CUDA graph: "
                               "run the model once before capturing");
    }
    found = Plans().emplace(key, MakePlan(c, state.handle, g, stream)).first;
  }
  const Plan& p = found->second;
  if (p.workspace > state.size) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CudaCheck(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone) {
      throw std::runtime_error("the cuDNN workspace cannot grow while the stream is captured into a CUDA graph");
    }
    CudaCheck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");  // the old workspace may be in use
    if (state.workspace != nullptr) CudaCheck(cudaFree(state.workspace), "cudaFree");
    state.workspace = nullptr;
    CudaCheck(cudaMalloc(&state.workspace, p.workspace), "cudaMalloc (cuDNN workspace)");
    state.size = p.workspace;
  }
  Check(c, Launch(c, state.handle, p, g, p.algo, state.workspace, state.size), "cuDNN convolution");
}

void ConvWeightGradCuda(const ConvGradArgs& g, void* stream) {
  ConvCall call;
  call.kind = ConvKind::kFilter;
  call.x = g.x, call.dy = g.dy, call.out = g.dw, call.half = g.half;
  call.n = g.n, call.cin = g.cin, call.h = g.h, call.w_ = g.w, call.cout = g.cout, call.ho = g.ho, call.wo = g.wo;
  call.a = g.a;
  CudnnConvolution(call, stream);
}

}  // namespace onnxcampo
