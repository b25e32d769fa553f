// The onnxcampo custom-op library: domain ai.onnxcampo, CPU kernels always, CUDA kernels when
// built with ONNXCAMPO_WITH_CUDA. The library does not link libonnxruntime: the runtime hands
// its API to RegisterCustomOps (ORT_API_MANUAL_INIT).
//
// Each op unit (a folder of onnxcampo/ops/, docs/guide/architecture.md) registers its ops in
// its <unit>_op.cc with ONNXCAMPO_REGISTER_OPS; this file adds every registered unit's ops to
// the domain, the CPU ones first, then (built with CUDA) the CUDA ones, units in name order.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "avg_matmul/avg_matmul.h"
#include "op_util.h"

namespace onnxcampo {

std::vector<OpsUnit>& OpsUnits() {
  static std::vector<OpsUnit> units;  // filled by the units' static registrars when the library loads
  return units;
}

namespace {

constexpr const char* kDomain = "ai.onnxcampo";

struct Library {
  Ort::CustomOpDomain domain{kDomain};

  Library() {
    std::vector<OpsUnit> units = OpsUnits();
    std::sort(units.begin(), units.end(), [](const OpsUnit& a, const OpsUnit& b) { return std::strcmp(a.name, b.name) < 0; });
    for (const OpsUnit& unit : units) unit.add(domain, false);
#ifdef ONNXCAMPO_WITH_CUDA
    for (const OpsUnit& unit : units) unit.add(domain, true);
#endif
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
