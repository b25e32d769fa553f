// cuDNN convolutions on CUDA (conv_grad.h): ConvWeightGrad's backward filter (NCHW) and the NHWC
// ops' forward (grouped too), backward-data and backward-filter calls (conv_nhwc.h), cuDNN loaded
// at run time (dlopen: the library links no cuDNN; ONNX Runtime's CUDA provider has loaded it
// already, else $ONNXCAMPO_CUDNN or libcudnn.so.9 on the loader's path). The declarations below
// are the few cuDNN 9 entry points and constants used (cudnn_graph.h, cudnn_ops.h, cudnn_cnn.h;
// opaque handles).
//
// Two ways to run a shape, chosen by ONNXCAMPO_CUDNN_API when a session makes the node's kernel
// (CudnnGraphApiAsked; unset, kGraphByDefault) and planned on the shape's first call:
// - the legacy calls (cudnnConvolutionForward and its adjoints, an algorithm from
//   cudnnFind*Algorithm), the default: the H100 database priced a ConvNhwc call made this way at
//   119 us of host time (`host_launch.conv_nhwc`, cuDNN 9), so that a plain run of a channels-last
//   network is bound by the host (a CUDA-graph replay does not pay it);
// - cuDNN's graph API (ONNXCAMPO_CUDNN_API=graph; cudnnBackend*: an operation graph of one
//   convolution, the engine configurations heuristic A lists, each finalized into an execution
//   plan): a call is then one variant pack and cudnnBackendExecute, which is how ONNX Runtime's own
//   Conv calls cuDNN (through cudnn-frontend). Where the graph API has no plan for a shape, the
//   legacy calls run it. tests/gpu/test_conv_nhwc_cuda.py checks both ways and records each one's
//   host time per call.
//
// One cuDNN handle per device (its stream set on each call, under one lock); one workspace per
// (device, stream), grown to the largest a shape needs. Per shape (in the process): the plan or
// algorithm that runs fastest on the first call of the shape, timed here (cudaEvents, a warm-up
// then the best of two blocks of three calls each, each block queued behind a kernel that holds
// the stream until the host has enqueued it, so the events time the GPU and not cuDNN's host
// cost: at batch 1 a call's ~85 us on the host hid every algorithm's kernel, and the choice fell on
// implicit_convolve_sgemm, 1.96 of ResNet-50's 2.25 GPU ms; docs/benchmarks/custom-ops/2026-12-03a/)
// among those cuDNN lists as working within kMaxWorkspace. cudnnFind's own single-trial ranking
// was not trusted: on the H200 it chose wgrad_alg0 (0.76 ms) for the ResNet-50 1x1 c128 28 x 28
// shape where a GEMM-based algorithm takes about 0.04 ms
// (docs/benchmarks/custom-ops/2026-12-01a/conv_grad.json). Planning synchronises and allocates:
// ORT's runs before a CUDA-graph capture make those calls.
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

// cuDNN 9's graph API constants used (cudnn_graph.h)
enum : int {
  // cudnnBackendAttributeType_t
  kTypeHandle = 0, kTypeDataType = 1, kTypeInt64 = 3, kTypeFloat = 4, kTypeVoidPtr = 6, kTypeConvMode = 7,
  kTypeHeurMode = 8, kTypeDescriptor = 15,
  // cudnnBackendDescriptorType_t
  kConvolutionDescriptor = 1, kEngineCfgDescriptor = 3, kEngineHeurDescriptor = 4, kExecutionPlanDescriptor = 5,
  kOpConvForward = 10, kOpConvBackwardFilter = 11, kOpConvBackwardData = 12, kOperationGraphDescriptor = 15,
  kVariantPackDescriptor = 16, kTensorDescriptor = 17,
  kHeurModeA = 3,
  // cudnnBackendAttributeName_t
  kConvCompType = 100, kConvMode = 101, kConvDilations = 102, kConvFilterStrides = 103, kConvPostPaddings = 104,
  kConvPrePaddings = 105, kConvSpatialDims = 106,
  kHeurMode = 200, kHeurOperationGraph = 201, kHeurResults = 202,
  kPlanHandle = 400, kPlanEngineConfig = 401, kPlanWorkspaceSize = 402,
  kOperationGraphHandle = 800, kOperationGraphOps = 801,
  kTensorByteAlignment = 900, kTensorDataType = 901, kTensorDimensions = 902, kTensorStrides = 903,
  kTensorUniqueId = 906,
  kVariantPackUniqueIds = 1000, kVariantPackDataPointers = 1001, kVariantPackWorkspace = 1003,
};
// per ConvKind (forward, data, filter): the operation descriptor type, and its attributes for the
// tensors {x or dx, w or dw, y or dy}, the convolution, alpha and beta
constexpr int kOperation[3] = {kOpConvForward, kOpConvBackwardData, kOpConvBackwardFilter};
constexpr int kOperationAttrs[3][6] = {{704, 703, 705, 702, 700, 701},
                                       {710, 709, 711, 708, 706, 707},
                                       {716, 715, 717, 714, 712, 713}};
constexpr int64_t kUids[3] = {1, 2, 3};  // the variant pack's x (dx), w (dw), y (dy)

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
  // the graph API (cudnnBackend*)
  int (*backend_create)(int, Desc*) = nullptr;
  int (*backend_destroy)(Desc) = nullptr;
  int (*backend_finalize)(Desc) = nullptr;
  int (*backend_set)(Desc, int, int, int64_t, const void*) = nullptr;
  int (*backend_get)(Desc, int, int, int64_t, int64_t*, void*) = nullptr;
  int (*backend_execute)(Handle, Desc, Desc) = nullptr;
  bool graph_api = false;  // every cudnnBackend* entry point bound
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
    c.graph_api = Bind(library, "cudnnBackendCreateDescriptor", &c.backend_create) &&
                  Bind(library, "cudnnBackendDestroyDescriptor", &c.backend_destroy) &&
                  Bind(library, "cudnnBackendFinalize", &c.backend_finalize) &&
                  Bind(library, "cudnnBackendSetAttribute", &c.backend_set) &&
                  Bind(library, "cudnnBackendGetAttribute", &c.backend_get) &&
                  Bind(library, "cudnnBackendExecute", &c.backend_execute);
    return c;
  }();
  return cudnn;
}

void Check(const Cudnn& c, int status, const char* what) {
  if (status != 0) {
    throw std::runtime_error(std::string("cuDNN ") + what + " failed: " + (c.error ? c.error(status) : "?"));
  }
}

constexpr size_t kMaxWorkspace = size_t{256} << 20;  // an algorithm or plan needing more is not taken
constexpr int kMaxPlans = 6;  // the graph API's engine configurations tried per shape, in heuristic order

// The descriptors and algorithm of one shape: an execution plan of the graph API (`plan`), else
// the legacy descriptors and algorithm.
struct Plan {
  Desc x = nullptr, y = nullptr, filter = nullptr, conv = nullptr;
  int algo = 0;
  Desc plan = nullptr;
  std::vector<Desc> graph;  // the descriptors the plan was made from, kept as long as it is
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

// The call's device pointers in the variant pack's order: x (dx), w (dw), y (dy).
void PointersOf(const ConvCall& g, void* out[3]) {
  switch (g.kind) {
    case ConvKind::kForward: out[0] = const_cast<void*>(g.x), out[1] = const_cast<void*>(g.w), out[2] = g.out; break;
    case ConvKind::kData: out[0] = g.out, out[1] = const_cast<void*>(g.w), out[2] = const_cast<void*>(g.dy); break;
    default: out[0] = const_cast<void*>(g.x), out[1] = g.out, out[2] = const_cast<void*>(g.dy); break;
  }
}

// One execution of a graph-API plan: a variant pack of the call's pointers and the workspace.
int Execute(const Cudnn& c, Handle handle, Desc plan, const ConvCall& g, void* workspace) {
  void* pointers[3];
  PointersOf(g, pointers);
  Desc pack = nullptr;
  int status = c.backend_create(kVariantPackDescriptor, &pack);
  if (status != 0) return status;
  if ((status = c.backend_set(pack, kVariantPackUniqueIds, kTypeInt64, 3, kUids)) == 0 &&
      (status = c.backend_set(pack, kVariantPackDataPointers, kTypeVoidPtr, 3, pointers)) == 0 &&
      (status = c.backend_set(pack, kVariantPackWorkspace, kTypeVoidPtr, 1, &workspace)) == 0 &&
      (status = c.backend_finalize(pack)) == 0) {
    status = c.backend_execute(handle, plan, pack);
  }
  c.backend_destroy(pack);
  return status;
}

// The per-device cuDNN handle, and the per-stream workspace.
struct Workspace {
  void* data = nullptr;
  size_t size = 0;
};

std::mutex mutex;

std::map<int, Handle>& Handles() {
  static std::map<int, Handle> handles;
  return handles;
}

std::map<std::pair<int, cudaStream_t>, Workspace>& Workspaces() {
  static std::map<std::pair<int, cudaStream_t>, Workspace> workspaces;
  return workspaces;
}

using ShapeKey = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int>;
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

// Times `count` candidates (`call(k, workspace, size)` enqueues candidate k, returning cuDNN's
// status) on the call's own tensors (dw is overwritten by the real call after) and returns the
// index of the fastest: per candidate one warm-up call, then two blocks of three calls between
// cudaEvents, the faster block counting; each block behind HoldStream for four times the host
// time of its three calls (estimated from the warm-up call; at least 50 us, at most 20 ms), so
// the block's kernels run back to back and the events measure their GPU time. A temporary
// workspace of `largest` bytes. A candidate whose warm-up call fails is not taken; -1 when none runs.
template <typename Call, typename Name>
int Fastest(const Cudnn& c, int count, size_t largest, cudaStream_t stream, const Call& call, const Name& name,
            std::string* report) {
  void* workspace = nullptr;
  if (largest > 0) CudaCheck(cudaMalloc(&workspace, largest), "cudaMalloc (cuDNN algorithm timing)");
  cudaEvent_t start = nullptr, stop = nullptr;
  CudaCheck(cudaEventCreate(&start), "cudaEventCreate");
  CudaCheck(cudaEventCreate(&stop), "cudaEventCreate");
  int best = -1;
  float best_ms = -1.0f;
  for (int k = 0; k < count; ++k) {
    const auto host_start = std::chrono::steady_clock::now();
    if (call(k, workspace, largest) != 0) continue;  // listed but not runnable here: not a candidate
    const double host_ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - host_start).count();
    const auto hold_ns = static_cast<unsigned long long>(std::min(2.0e7, std::max(5.0e4, 4.0 * 3.0 * host_ns)));
    float ms = -1.0f;
    for (int block = 0; block < 2; ++block) {
      HoldStream<<<1, 1, 0, stream>>>(hold_ns);
      CudaCheck(cudaGetLastError(), "HoldStream launch");
      CudaCheck(cudaEventRecord(start, stream), "cudaEventRecord");
      for (int r = 0; r < 3; ++r) Check(c, call(k, workspace, largest), "cuDNN convolution (timing)");
      CudaCheck(cudaEventRecord(stop, stream), "cudaEventRecord");
      CudaCheck(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float elapsed = 0.0f;
      CudaCheck(cudaEventElapsedTime(&elapsed, start, stop), "cudaEventElapsedTime");
      if (ms < 0.0f || elapsed / 3.0f < ms) ms = elapsed / 3.0f;
    }
    if (report != nullptr) {
      *report += " " + name(k) + " " + std::to_string(ms) + " ms (host " + std::to_string(host_ns / 1e3) + " us);";
    }
    if (best_ms < 0.0f || ms < best_ms) {
      best_ms = ms;
      best = k;
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  CudaCheck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (workspace != nullptr) CudaCheck(cudaFree(workspace), "cudaFree");
  return best;
}

void Log(const ConvCall& g, const char* how, const std::string& report, const std::string& chosen) {
  std::fprintf(stderr, "onnxcampo cuDNN %s%s %s x[%lld,%lld,%lld,%lld] dy[%lld,%lld,%lld,%lld] k%lldx%lld s%lld g%lld:%s chosen %s\n",
               KindName(g.kind), g.nhwc ? " NHWC" : "", how, static_cast<long long>(g.n),
               static_cast<long long>(g.cin), static_cast<long long>(g.h), static_cast<long long>(g.w_),
               static_cast<long long>(g.n), static_cast<long long>(g.cout), static_cast<long long>(g.ho),
               static_cast<long long>(g.wo), static_cast<long long>(g.a.kh), static_cast<long long>(g.a.kw),
               static_cast<long long>(g.a.sh), static_cast<long long>(g.group), report.c_str(), chosen.c_str());
}

// --- the graph API ----------------------------------------------------------------------------

// Destroys the descriptors it holds when it goes.
struct Descriptors {
  explicit Descriptors(const Cudnn& cudnn) : c(cudnn) {}
  ~Descriptors() {
    for (Desc d : held) c.backend_destroy(d);
  }
  // a new descriptor of `type`, with the attributes `set` gives it, finalized; nullptr where cuDNN refuses
  template <typename Set>
  Desc Make(int type, const Set& set, bool finalize = true) {
    Desc d = nullptr;
    if (c.backend_create(type, &d) != 0) return nullptr;
    held.push_back(d);
    if (!set(d)) return nullptr;
    if (finalize && c.backend_finalize(d) != 0) return nullptr;
    return d;
  }
  const Cudnn& c;
  std::vector<Desc> held;
};

// The 4-D tensor [n, ch, h, w] (logical order) stored channels-last or not, float16 or float32.
Desc GraphTensor(Descriptors& ds, int64_t uid, bool half, bool channels_last, int64_t n, int64_t ch, int64_t h,
                 int64_t w, int64_t alignment) {
  const Cudnn& c = ds.c;
  const int64_t dims[4] = {n, ch, h, w};
  const int64_t nhwc[4] = {h * w * ch, 1, w * ch, ch}, nchw[4] = {ch * h * w, h * w, w, 1};
  const int type = half ? kHalf : kFloat;
  return ds.Make(kTensorDescriptor, [&](Desc d) {
    return c.backend_set(d, kTensorDataType, kTypeDataType, 1, &type) == 0 &&
           c.backend_set(d, kTensorDimensions, kTypeInt64, 4, dims) == 0 &&
           c.backend_set(d, kTensorStrides, kTypeInt64, 4, channels_last ? nhwc : nchw) == 0 &&
           c.backend_set(d, kTensorUniqueId, kTypeInt64, 1, &uid) == 0 &&
           c.backend_set(d, kTensorByteAlignment, kTypeInt64, 1, &alignment) == 0;
  });
}

// The operation graph of the call's one convolution; nullptr where cuDNN refuses a descriptor.
Desc GraphOf(Descriptors& ds, Handle handle, const ConvCall& g, int64_t alignment) {
  const Cudnn& c = ds.c;
  const Im2ColAttrs& a = g.a;
  Desc x = GraphTensor(ds, kUids[0], g.half, g.nhwc, g.n, g.cin, g.h, g.w_, alignment);
  Desc w = GraphTensor(ds, kUids[1], g.half, g.krsc, g.cout, g.cin / g.group, a.kh, a.kw, alignment);
  Desc y = GraphTensor(ds, kUids[2], g.half, g.nhwc, g.n, g.cout, g.ho, g.wo, alignment);
  if (x == nullptr || w == nullptr || y == nullptr) return nullptr;
  const int compute = kFloat, mode = kCrossCorrelation;
  const int64_t spatial = 2, dilations[2] = {a.dh, a.dw}, strides[2] = {a.sh, a.sw}, pads[2] = {a.pt, a.pl};
  Desc conv = ds.Make(kConvolutionDescriptor, [&](Desc d) {
    return c.backend_set(d, kConvCompType, kTypeDataType, 1, &compute) == 0 &&
           c.backend_set(d, kConvMode, kTypeConvMode, 1, &mode) == 0 &&
           c.backend_set(d, kConvSpatialDims, kTypeInt64, 1, &spatial) == 0 &&
           c.backend_set(d, kConvDilations, kTypeInt64, 2, dilations) == 0 &&
           c.backend_set(d, kConvFilterStrides, kTypeInt64, 2, strides) == 0 &&
           c.backend_set(d, kConvPrePaddings, kTypeInt64, 2, pads) == 0 &&
           c.backend_set(d, kConvPostPaddings, kTypeInt64, 2, pads) == 0;  // symmetric, as the legacy calls
  });
  if (conv == nullptr) return nullptr;
  const int kind = KindIndex(g.kind);
  const int* attrs = kOperationAttrs[kind];
  const float one = 1.0f, zero = 0.0f;
  Desc op = ds.Make(kOperation[kind], [&](Desc d) {
    return c.backend_set(d, attrs[0], kTypeDescriptor, 1, &x) == 0 && c.backend_set(d, attrs[1], kTypeDescriptor, 1, &w) == 0 &&
           c.backend_set(d, attrs[2], kTypeDescriptor, 1, &y) == 0 &&
           c.backend_set(d, attrs[3], kTypeDescriptor, 1, &conv) == 0 &&
           c.backend_set(d, attrs[4], kTypeFloat, 1, &one) == 0 && c.backend_set(d, attrs[5], kTypeFloat, 1, &zero) == 0;
  });
  if (op == nullptr) return nullptr;
  return ds.Make(kOperationGraphDescriptor, [&](Desc d) {
    return c.backend_set(d, kOperationGraphHandle, kTypeHandle, 1, &handle) == 0 &&
           c.backend_set(d, kOperationGraphOps, kTypeDescriptor, 1, &op) == 0;
  });
}

// The fastest execution plan of the first kMaxPlans engine configurations heuristic A lists for
// the call (within kMaxWorkspace), in `p`; false where the graph API has none for it.
bool MakeGraphPlan(const Cudnn& c, Handle handle, const ConvCall& g, int64_t alignment, cudaStream_t stream, Plan* p) {
  Descriptors ds(c);
  Desc graph = GraphOf(ds, handle, g, alignment);
  if (graph == nullptr) return false;
  const int mode = kHeurModeA;
  Desc heuristics = ds.Make(kEngineHeurDescriptor, [&](Desc d) {
    return c.backend_set(d, kHeurOperationGraph, kTypeDescriptor, 1, &graph) == 0 &&
           c.backend_set(d, kHeurMode, kTypeHeurMode, 1, &mode) == 0;
  });
  if (heuristics == nullptr) return false;
  int64_t listed = 0;
  if (c.backend_get(heuristics, kHeurResults, kTypeDescriptor, 0, &listed, nullptr) != 0 || listed <= 0) return false;
  std::vector<Desc> configs(static_cast<size_t>(listed), nullptr);
  for (Desc& config : configs) {
    if ((config = ds.Make(kEngineCfgDescriptor, [](Desc) { return true; }, false)) == nullptr) return false;
  }
  int64_t got = 0;
  if (c.backend_get(heuristics, kHeurResults, kTypeDescriptor, listed, &got, configs.data()) != 0) return false;
  std::vector<Desc> plans;  // finalized plans within the workspace limit (not held by `ds`)
  std::vector<size_t> sizes;
  for (int64_t k = 0; k < got && static_cast<int>(plans.size()) < kMaxPlans; ++k) {
    Desc plan = nullptr;
    if (c.backend_create(kExecutionPlanDescriptor, &plan) != 0) continue;
    int64_t size = -1, count = 0;
    const bool made = c.backend_set(plan, kPlanHandle, kTypeHandle, 1, &handle) == 0 &&
                      c.backend_set(plan, kPlanEngineConfig, kTypeDescriptor, 1, &configs[k]) == 0 &&
                      c.backend_finalize(plan) == 0 &&
                      c.backend_get(plan, kPlanWorkspaceSize, kTypeInt64, 1, &count, &size) == 0 && size >= 0 &&
                      static_cast<size_t>(size) <= kMaxWorkspace;
    if (!made) {
      c.backend_destroy(plan);
      continue;
    }
    plans.push_back(plan);
    sizes.push_back(static_cast<size_t>(size));
  }
  if (plans.empty()) return false;
  const bool log = std::getenv("ONNXCAMPO_CONV_GRAD_LOG") != nullptr;
  std::string report;
  int best = 0;
  if (plans.size() > 1) {
    const size_t largest = *std::max_element(sizes.begin(), sizes.end());
    best = Fastest(
        c, static_cast<int>(plans.size()), largest, stream,
        [&](int k, void* workspace, size_t) { return Execute(c, handle, plans[k], g, workspace); },
        [](int k) { return "plan " + std::to_string(k); }, log ? &report : nullptr);
  }
  for (size_t k = 0; k < plans.size(); ++k) {
    if (static_cast<int>(k) != best) c.backend_destroy(plans[k]);
  }
  if (best < 0) return false;
  if (log) Log(g, "graph API", report, "plan " + std::to_string(best) + " of " + std::to_string(plans.size()));
  p->plan = plans[best];
  p->workspace = sizes[best];
  p->graph = std::move(ds.held);  // cuDNN does not say whether a plan outlives them
  ds.held.clear();
  return true;
}

// --- the legacy calls -------------------------------------------------------------------------

Plan MakeLegacyPlan(const Cudnn& c, Handle handle, const ConvCall& g, cudaStream_t stream) {
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
  if (candidates.size() > 1) {
    const bool log = std::getenv("ONNXCAMPO_CONV_GRAD_LOG") != nullptr;
    std::string report;
    size_t largest = 0;
    for (const AlgoPerf& perf_k : candidates) largest = std::max(largest, perf_k.memory);
    const int best = Fastest(
        c, static_cast<int>(candidates.size()), largest, stream,
        [&](int k, void* workspace, size_t size) { return Launch(c, handle, p, g, candidates[k].algo, workspace, size); },
        [&](int k) { return "algo " + std::to_string(candidates[k].algo); }, log ? &report : nullptr);
    if (best >= 0) p.algo = candidates[best].algo;
    if (log) Log(g, "legacy", report, "algo " + std::to_string(p.algo));
  }
  Check(c, c.workspace[kind](handle, o.d[0], o.d[1], o.d[2], o.d[3], p.algo, &p.workspace),
        "cudnnGetConvolution*WorkspaceSize");
  return p;
}

// The shape's plan: the graph API's where it has one (and the legacy calls are not asked for),
// else the legacy calls'.
Plan MakePlan(const Cudnn& c, Handle handle, const ConvCall& g, int64_t alignment, bool legacy, cudaStream_t stream) {
  Plan p;
  if (c.graph_api && !legacy && MakeGraphPlan(c, handle, g, alignment, stream, &p)) return p;
  return MakeLegacyPlan(c, handle, g, stream);
}

// The largest power of two (at most 16 bytes) that divides every pointer of the call.
int64_t AlignmentOf(const ConvCall& g) {
  void* pointers[3];
  PointersOf(g, pointers);
  int64_t alignment = 16;
  for (void* pointer : pointers) {
    while (alignment > 1 && reinterpret_cast<uintptr_t>(pointer) % alignment != 0) alignment /= 2;
  }
  return alignment;
}

}  // namespace

// Unset, the legacy calls (kGraphByDefault).
constexpr bool kGraphByDefault = false;

bool CudnnGraphApiAsked() {
  const char* value = std::getenv("ONNXCAMPO_CUDNN_API");
  if (value == nullptr || *value == 0) return kGraphByDefault;
  return std::string(value) == "graph";
}

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
  Handle& handle = Handles()[device];
  if (handle == nullptr) Check(c, c.create(&handle), "cudnnCreate");
  Check(c, c.set_stream(handle, stream), "cudnnSetStream");
  Workspace& state = Workspaces()[{device, stream}];
  const Im2ColAttrs& a = g.a;
  const int variant = KindIndex(g.kind) * 8 + (g.half ? 4 : 0) + (g.nhwc ? 2 : 0) + (g.krsc ? 1 : 0);
  const int64_t alignment = AlignmentOf(g);  // a plan is made for the pointers' alignment
  const bool legacy = !g.graph;
  const ShapeKey key{device, variant, g.n, g.cin, g.h, g.w_, g.cout, g.ho, g.wo, a.kh, a.kw, a.sh, a.sw, a.dh, a.dw,
                     a.pt * 1000003 + a.pl, g.group, static_cast<int>(alignment) * 2 + (legacy ? 1 : 0)};
  auto found = Plans().find(key);
  if (found == Plans().end()) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CudaCheck(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone) {
      throw std::runtime_error("a new shape cannot be planned while the stream is captured into a CUDA graph: "
                               "run the model once before capturing");
    }
    found = Plans().emplace(key, MakePlan(c, handle, g, alignment, legacy, stream)).first;
  }
  const Plan& p = found->second;
  if (p.workspace > state.size) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CudaCheck(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone) {
      throw std::runtime_error("the cuDNN workspace cannot grow while the stream is captured into a CUDA graph");
    }
    CudaCheck(cudaStreamSynchronize(stream), "cudaStreamSynchronize");  // the old workspace may be in use
    if (state.data != nullptr) CudaCheck(cudaFree(state.data), "cudaFree");
    state.data = nullptr;
    CudaCheck(cudaMalloc(&state.data, p.workspace), "cudaMalloc (cuDNN workspace)");
    state.size = p.workspace;
  }
  if (p.plan != nullptr) {
    Check(c, Execute(c, handle, p.plan, g, state.data), "cudnnBackendExecute (convolution)");
    return;
  }
  Check(c, Launch(c, handle, p, g, p.algo, state.data, state.size), "cuDNN convolution");
}

void ConvWeightGradCuda(const ConvGradArgs& g, void* stream) {
  ConvCall call;
  call.kind = ConvKind::kFilter;
  call.x = g.x, call.dy = g.dy, call.out = g.dw, call.half = g.half, call.graph = g.graph;
  call.n = g.n, call.cin = g.cin, call.h = g.h, call.w_ = g.w, call.cout = g.cout, call.ho = g.ho, call.wo = g.wo;
  call.a = g.a;
  CudnnConvolution(call, stream);
}

}  // namespace onnxcampo
