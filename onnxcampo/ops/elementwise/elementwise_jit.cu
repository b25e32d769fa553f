// FusedElementwise's generated kernels on CUDA (elementwise_jit.h): NVRTC found and loaded at
// run time (dlopen: the library needs no NVRTC to load, and runs the interpreter kernel where
// there is none), one compile per (source, device architecture) in the process, the cubin loaded
// with the runtime's context-independent cudaLibrary API and launched with cudaLaunchKernel on
// ORT's stream: capturable into a CUDA graph once compiled.
//
// Where NVRTC comes from, first found wins: $ONNXCAMPO_NVRTC (a path; onnxcampo.ops sets it to
// the nvidia-cuda-nvrtc wheel's library when that is installed), then libnvrtc.so.13,
// libnvrtc.so.12 and libnvrtc.so on the loader's path.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_util.h"
#include "elementwise_jit.h"

namespace onnxcampo {
namespace ew {
namespace {

// The NVRTC entry points used (nvrtc.h's signatures; nvrtcResult is an int enum, 0 success).
using NvrtcProgram = void*;
struct Nvrtc {
  int (*create)(NvrtcProgram*, const char*, const char*, int, const char* const*, const char* const*) = nullptr;
  int (*compile)(NvrtcProgram, int, const char* const*) = nullptr;
  int (*log_size)(NvrtcProgram, size_t*) = nullptr;
  int (*log)(NvrtcProgram, char*) = nullptr;
  int (*cubin_size)(NvrtcProgram, size_t*) = nullptr;
  int (*cubin)(NvrtcProgram, char*) = nullptr;
  int (*destroy)(NvrtcProgram*) = nullptr;
  int (*version)(int*, int*) = nullptr;
  std::string error;  // why NVRTC is not usable ("" when it is)
  std::string where;  // the library file that was loaded
};

const Nvrtc& LoadNvrtc() {
  static const Nvrtc nvrtc = [] {
    Nvrtc n;
    std::vector<std::string> candidates;
    if (const char* path = std::getenv("ONNXCAMPO_NVRTC")) {
      if (*path) candidates.push_back(path);
    }
    for (const char* name : {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}) candidates.push_back(name);
    void* library = nullptr;
    for (const std::string& name : candidates) {
      library = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (library != nullptr) {
        n.where = name;
        break;
      }
    }
    if (library == nullptr) {
      n.error = "NVRTC not found (install the nvidia-cuda-nvrtc wheel or set ONNXCAMPO_NVRTC to libnvrtc.so)";
      return n;
    }
    const bool bound = Bind(library, "nvrtcCreateProgram", &n.create) && Bind(library, "nvrtcCompileProgram", &n.compile) &&
                       Bind(library, "nvrtcGetProgramLogSize", &n.log_size) && Bind(library, "nvrtcGetProgramLog", &n.log) &&
                       Bind(library, "nvrtcGetCUBINSize", &n.cubin_size) && Bind(library, "nvrtcGetCUBIN", &n.cubin) &&
                       Bind(library, "nvrtcDestroyProgram", &n.destroy) && Bind(library, "nvrtcVersion", &n.version);
    if (!bound) n.error = n.where + " lacks an NVRTC entry point";
    return n;
  }();
  return nvrtc;
}

// What the kernels did in this process (JitStats).
std::atomic<int64_t> generated_launches{0}, fallbacks{0}, compiles{0}, cache_reads{0};

// A compiled kernel, or why there is none.
struct Entry {
  cudaKernel_t kernel = nullptr;
  std::string error;
};

// NVRTC's cubin of `source` for sm_<arch>: "" or why not. The options keep the interpreter's
// arithmetic: no FMA contraction, IEEE division and square root, no flush to zero.
std::string Compile(const Nvrtc& nv, const std::string& source, int arch, std::vector<char>* cubin) {
  NvrtcProgram program = nullptr;
  if (nv.create(&program, source.c_str(), "fused_elementwise.cu", 0, nullptr, nullptr) != 0) {
    return "nvrtcCreateProgram failed";
  }
  const std::string arch_option = "--gpu-architecture=sm_" + std::to_string(arch);
  const char* options[] = {arch_option.c_str(), "--fmad=false", "--prec-div=true", "--prec-sqrt=true", "--ftz=false"};
  const int status = nv.compile(program, static_cast<int>(sizeof options / sizeof *options), options);
  std::string error;
  if (status != 0) {
    size_t size = 0;
    nv.log_size(program, &size);
    std::string log(size, '\0');
    if (size) nv.log(program, &log[0]);
    error = "NVRTC (" + nv.where + ") could not compile the generated kernel for sm_" + std::to_string(arch) + ": " +
            log.substr(0, 2000);
  } else {
    size_t size = 0;
    nv.cubin_size(program, &size);
    cubin->resize(size);
    if (size) nv.cubin(program, cubin->data());
  }
  nv.destroy(&program);
  return error;
}

// ---- the cubin cache on disk ----------------------------------------------------------------
// Compiling takes ~0.1 s a kernel, so a step graph's first run would spend seconds on it: the
// cubins are kept in $ONNXCAMPO_KERNEL_CACHE (a folder; "off" turns the cache off), by default
// $XDG_CACHE_HOME/onnxcampo/kernels or ~/.cache/onnxcampo/kernels, one file per source, NVRTC
// version and architecture (named by a 64-bit FNV-1a hash of the three; the file starts with the
// key's length and its own hash of the source, checked on reading). Written atomically
// (temporary file, rename); any failure to read or write it only costs a compile.

std::string CacheFolder() {
  const char* set = std::getenv("ONNXCAMPO_KERNEL_CACHE");
  if (set != nullptr && *set) return std::string(set) == "off" ? "" : set;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME")) {
    if (*xdg) return std::string(xdg) + "/onnxcampo/kernels";
  }
  if (const char* home = std::getenv("HOME")) {
    if (*home) return std::string(home) + "/.cache/onnxcampo/kernels";
  }
  return "";
}

uint64_t Fnv1a(const std::string& text, uint64_t hash = 1469598103934665603ull) {
  for (unsigned char c : text) hash = (hash ^ c) * 1099511628211ull;
  return hash;
}

bool MakeFolders(const std::string& path) {
  for (size_t at = 1; at <= path.size(); ++at) {
    if (at == path.size() || path[at] == '/') {
      const std::string part = path.substr(0, at);
      if (mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) return false;
    }
  }
  return true;
}

struct CubinFile {
  std::string path;   // "" when the cache is off
  uint64_t check = 0;  // the second hash, stored in the file
};

CubinFile CubinFor(const std::string& key) {
  CubinFile file;
  const std::string folder = CacheFolder();
  if (folder.empty()) return file;
  char name[40];
  std::snprintf(name, sizeof name, "/ew-%016llx.cubin", static_cast<unsigned long long>(Fnv1a(key)));
  file.path = folder + name;
  file.check = Fnv1a(key, 0x9e3779b97f4a7c15ull) ^ key.size();
  return file;
}

bool ReadCubin(const CubinFile& file, std::vector<char>* cubin) {
  if (file.path.empty()) return false;
  FILE* f = std::fopen(file.path.c_str(), "rb");
  if (f == nullptr) return false;
  uint64_t check = 0;
  bool ok = std::fread(&check, sizeof check, 1, f) == 1 && check == file.check;
  if (ok) {
    std::vector<char> data;
    char chunk[1 << 16];
    size_t got = 0;
    while ((got = std::fread(chunk, 1, sizeof chunk, f)) > 0) data.insert(data.end(), chunk, chunk + got);
    ok = !data.empty() && !std::ferror(f);
    if (ok) cubin->swap(data);
  }
  std::fclose(f);
  return ok;
}

void WriteCubin(const CubinFile& file, const std::vector<char>& cubin) {
  if (file.path.empty()) return;
  const size_t slash = file.path.rfind('/');
  if (!MakeFolders(file.path.substr(0, slash))) return;
  const std::string temporary = file.path + ".tmp" + std::to_string(getpid());
  FILE* f = std::fopen(temporary.c_str(), "wb");
  if (f == nullptr) return;
  bool ok = std::fwrite(&file.check, sizeof file.check, 1, f) == 1 &&
            std::fwrite(cubin.data(), 1, cubin.size(), f) == cubin.size();
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(temporary.c_str(), file.path.c_str()) != 0) std::remove(temporary.c_str());
}

// Compiles `source` for sm_<arch> (or reads its cubin from the cache) and loads it.
Entry Build(const std::string& source, int arch) {
  Entry entry;
  const Nvrtc& nv = LoadNvrtc();
  if (!nv.error.empty()) {
    entry.error = nv.error;
    return entry;
  }
  int major = 0, minor = 0;
  nv.version(&major, &minor);
  const CubinFile file =
      CubinFor("nvrtc " + std::to_string(major) + "." + std::to_string(minor) + " sm_" + std::to_string(arch) + "\n" + source);
  std::vector<char> cubin;
  if (ReadCubin(file, &cubin)) {
    ++cache_reads;
  } else {
    ++compiles;
    entry.error = Compile(nv, source, arch, &cubin);
    if (!entry.error.empty()) return entry;
    WriteCubin(file, cubin);
  }
  cudaLibrary_t library = nullptr;
  cudaError_t loaded = cudaLibraryLoadData(&library, cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0);
  if (loaded == cudaSuccess) loaded = cudaLibraryGetKernel(&entry.kernel, library, kJitKernelName);
  if (loaded != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it for the interpreter launch that follows
    entry.kernel = nullptr;
    entry.error = std::string("the generated kernel does not load: ") + cudaGetErrorString(loaded);
  }
  return entry;  // the library stays loaded for the life of the process
}

int CurrentArch() {
  int device = 0, major = 0, minor = 0;
  CudaCheck(cudaGetDevice(&device), "cudaGetDevice");
  CudaCheck(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  CudaCheck(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "cudaDeviceGetAttribute");
  return major * 10 + minor;
}

// Sources seen with literal shapes per program, to stop specialising a program called with
// ever new shapes (dynamic dimensions): past kMaxShapes it gets one kernel that reads them.
constexpr int kMaxShapes = 8;

std::mutex mutex;
std::map<std::string, Entry>& Cache() {
  static std::map<std::string, Entry> cache;
  return cache;
}
std::map<std::string, int>& ShapeCounts() {
  static std::map<std::string, int> counts;
  return counts;
}

bool Aligned(const void* pointer, bool half) {
  return reinterpret_cast<uintptr_t>(pointer) % (half ? 2 * kJitLanes : 4 * kJitLanes) == 0;
}

// The layout fields a generated kernel depends on (all but the pointers).
std::vector<int64_t> Signature(const Layout& t) {
  std::vector<int64_t> s = {t.inputs, t.outputs, t.in_half, t.out_half, t.rank, t.n >= (int64_t{1} << 31)};
  for (int k = 0; k < t.inputs; ++k) s.push_back(t.kind[k]);
  if (t.any_strided) {
    s.insert(s.end(), t.dim, t.dim + t.rank);
    for (int k = 0; k < t.inputs; ++k) s.insert(s.end(), t.stride[k], t.stride[k] + t.rank);
  }
  return s;
}

// The kernel for `layout` (compiled now if new in the process), or null with why in `*reason`;
// `*capturing`: null because the stream is being captured (a later call may compile it).
const void* Find(const Program& program, const Layout& layout, const JitSums* sums, cudaStream_t stream,
                 std::string* reason, bool* capturing) {
  *capturing = false;
  JitOptions options;
  if (sums != nullptr) {
    options.sum_output = sums->output;
    options.sum_columns = sums->columns;
  }
  options.index64 = layout.n >= (int64_t{1} << 31);
  const int arch = CurrentArch();
  std::lock_guard<std::mutex> lock(mutex);
  // a program's identity: its source with the shape read from the parameter
  options.literal_shape = false;
  const std::string generic = GenerateSource(program, layout, options);
  std::string source = generic;
  if (layout.any_strided) {
    options.literal_shape = true;
    source = GenerateSource(program, layout, options);
    if (!Cache().count(std::to_string(arch) + source) && ShapeCounts()[generic] >= kMaxShapes) source = generic;
  }
  const std::string key = std::to_string(arch) + source;
  auto found = Cache().find(key);
  if (found == Cache().end()) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CudaCheck(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
    if (capture != cudaStreamCaptureStatusNone) {
      *reason = "a new generated kernel cannot be compiled while the stream is captured into a CUDA graph";
      *capturing = true;
      return nullptr;
    }
    found = Cache().emplace(key, Build(source, arch)).first;
    if (source != generic) ++ShapeCounts()[generic];
  }
  *reason = found->second.error;
  return reinterpret_cast<const void*>(found->second.kernel);
}

}  // namespace

bool JitKernel::Launch(const Program& program, const Layout& layout, void* stream_handle, std::string* reason,
                       const JitSums* sums) {
  if (layout.n == 0) return true;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  const void* kernel = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<int64_t> signature = Signature(layout);
    signature.push_back(sums != nullptr ? sums->output : -1);
    signature.push_back(sums != nullptr ? sums->columns : 0);
    if (signature != signature_) {
      bool capturing = false;
      kernel_ = Find(program, layout, sums, stream, &error_, &capturing);
      // a refusal during capture is not the layout's answer: ask again next call
      signature_ = capturing ? std::vector<int64_t>{} : std::move(signature);
    }
    if (kernel_ == nullptr) {
      *reason = error_;
      ++fallbacks;
      return false;
    }
    kernel = kernel_;
  }
  JitParams params{};
  for (int k = 0; k < layout.inputs; ++k) {
    params.in[k] = layout.in[k];
    for (int d = 0; d < kMaxDims; ++d) params.stride[k][d] = layout.stride[k][d];
    if (Aligned(layout.in[k], layout.in_half >> k & 1)) params.in_aligned |= 1u << k;
  }
  for (int k = 0; k < layout.outputs; ++k) {
    params.out[k] = layout.out[k];
    if (Aligned(layout.out[k], layout.out_half >> k & 1)) params.out_aligned |= 1u << k;
  }
  for (int d = 0; d < kMaxDims; ++d) params.dim[d] = layout.dim[d];
  params.n = layout.n;
  const int64_t groups = (layout.n + kJitLanes - 1) / kJitLanes;
  const int64_t wanted = (groups + kJitThreads - 1) / kJitThreads;
  int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, JitMaxBlocks())));
  if (sums != nullptr) {
    blocks = sums->grid.blocks;
    params.sums = sums->partials;
  }
  void* args[] = {&params};
  CudaCheck(cudaLaunchKernel(kernel, dim3(blocks), dim3(kJitThreads), args, 0, stream),
            "FusedElementwise (generated) launch");
  ++generated_launches;
  return true;
}

int JitMaxBlocks() { return MultiprocessorCount() * 8; }

std::string JitStats() {
  return "generated=" + std::to_string(generated_launches.load()) + " interpreter=" + std::to_string(fallbacks.load()) +
         " compiled=" + std::to_string(compiles.load()) + " cached=" + std::to_string(cache_reads.load());
}

}  // namespace ew
}  // namespace onnxcampo
