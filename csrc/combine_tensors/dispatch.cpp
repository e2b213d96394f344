// Runtime CPU dispatch and thread-count policy.
//
// The best table the CPU supports is chosen once at import; APEX_SIMD (or
// set_simd_level from Python) forces a lower one so tests can exercise every
// level the machine has.
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common.h"
#include "optim.h"

namespace apexc {

namespace {
std::atomic<int> g_threads{0};
std::atomic<const Kernels*> g_kernels{nullptr};
std::atomic<const OptimKernels*> g_optim{nullptr};

int env_threads() {
  const char* e = std::getenv("APEX_NUM_THREADS");
  if (e && *e) {
    int v = std::atoi(e);
    if (v > 0) return v;
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc ? static_cast<int>(hc) : 1;
}
}  // namespace

int default_threads() {
  int t = g_threads.load(std::memory_order_relaxed);
  if (t <= 0) {
    t = env_threads();
    g_threads.store(t, std::memory_order_relaxed);
  }
  return t;
}

void set_default_threads(int n) { g_threads.store(n > 0 ? n : env_threads(), std::memory_order_relaxed); }

int resolve_threads(int requested) {
  int t = requested > 0 ? requested : default_threads();
  return t > 256 ? 256 : t;
}

std::vector<std::string> supported_levels() {
  std::vector<std::string> out{"baseline"};
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2) out.push_back("avx2");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    out.push_back("avx512");
#elif defined(__aarch64__)
  out.push_back("neon");  // Advanced SIMD is mandatory on AArch64
#endif
  return out;
}

static void select(const std::string& level) {
  const Kernels* k = nullptr;
  const OptimKernels* o = nullptr;
  if (level == "baseline") {
    k = &kernels_baseline();
    o = &optim_kernels_baseline();
  }
#if defined(__x86_64__) || defined(_M_X64)
  else if (level == "avx2") {
    k = &kernels_avx2();
    o = &optim_kernels_avx2();
  } else if (level == "avx512") {
    k = &kernels_avx512();
    o = &optim_kernels_avx512();
  }
#endif
#if defined(__aarch64__)
  else if (level == "neon") {
    k = &kernels_neon();
    o = &optim_kernels_neon();
  }
#endif
  if (!k) throw std::invalid_argument("unknown SIMD level '" + level + "'");
  g_kernels.store(k);
  g_optim.store(o);
}

void set_simd_level(const std::string& level) {
  auto sup = supported_levels();
  std::string want = level;
  if (want.empty() || want == "auto" || want == "best") want = sup.back();
  bool ok = false;
  for (auto& s : sup) ok = ok || s == want;
  if (!ok) {
    std::string list;
    for (auto& s : sup) list += (list.empty() ? "" : ", ") + s;
    throw std::invalid_argument("SIMD level '" + level + "' is not supported by this CPU/build; expected one of: " +
                                list + " (or 'auto')");
  }
  select(want);
}

void init_dispatch() {
  const char* e = std::getenv("APEX_SIMD");
  set_simd_level(e ? std::string(e) : std::string("auto"));
}

const Kernels& K() {
  const Kernels* k = g_kernels.load(std::memory_order_acquire);
  if (!k) {
    init_dispatch();
    k = g_kernels.load();
  }
  return *k;
}

const OptimKernels& OK() {
  const OptimKernels* o = g_optim.load(std::memory_order_acquire);
  if (!o) {
    init_dispatch();
    o = g_optim.load();
  }
  return *o;
}

}  // namespace apexc
