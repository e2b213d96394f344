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

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

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

#if defined(__x86_64__) || defined(_M_X64)
namespace {
// CPUID + XGETBV directly, not __builtin_cpu_supports: that reads __cpu_model, which the compiler runtime's
// __cpu_indicator_init fills, and zig's compiler_rt (the manylinux release build) stubs that out -- every level
// above baseline would silently vanish from the wheel. XGETBV also checks that the OS saves the YMM/ZMM state.
struct X86Levels {
  bool avx2 = false, avx512 = false;
};

X86Levels detect_x86() {
  X86Levels f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
  if (!osxsave || !avx || __get_cpuid_max(0, nullptr) < 7) return f;
  unsigned xcr0 = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0), "=d"(xcr0_hi) : "c"(0));
  const bool ymm_state = (xcr0 & 0x6u) == 0x6u;    // SSE + AVX state
  const bool zmm_state = (xcr0 & 0xe6u) == 0xe6u;  // + opmask, ZMM_Hi256, Hi16_ZMM
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = ymm_state && fma && f16c && (b & (1u << 5));
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31));  // f dq bw vl
  f.avx512 = f.avx2 && zmm_state && avx512;
  return f;
}
}  // namespace
#endif

std::vector<std::string> supported_levels() {
  std::vector<std::string> out{"baseline"};
#if defined(__x86_64__) || defined(_M_X64)
  static const X86Levels x86 = detect_x86();
  if (x86.avx2) out.push_back("avx2");
  if (x86.avx512) out.push_back("avx512");
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
