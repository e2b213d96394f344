// Runtime CPU dispatch and thread-count policy.
//
// The best table the CPU supports is chosen once at import; APEX_SIMD (or
// set_simd_level from Python) forces a lower one so tests can exercise every
// level the machine has.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <dlfcn.h>
#include <pthread.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

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

// ---------------------------------------------------------------------------
// Whose threads run a call (run_team).
//
// torch runs its CPU ops on an OpenMP team; after an op the team's workers spin on
// their cores for a while before sleeping (libgomp's default wait policy). A
// thread we start right after a torch op -- the usual case: a step follows the
// backward, or grads are written just before -- waits for a core one of them
// spins on: measured on 2 cores, a 1M-element Adam step took 3.7 ms after a torch
// op against 1.2 ms without one. Running the call on that same team instead hands
// the work to the spinning workers at once, as torch's own fused optimizers do,
// and starts no thread.
//
// The runtime is the one already in the process: GOMP_parallel (the GNU OpenMP
// entry point, also exported by LLVM's and Intel's runtimes) found with dlsym;
// the library links no OpenMP runtime of its own, so there is never a second
// pool. Without one (no torch loaded, a platform without dlsym) or in a child
// after fork() (a forked child has none of the parent's pool threads: a team
// would wait for them forever) the call's threads are std::threads, joined
// before it returns.
// ---------------------------------------------------------------------------
namespace {
using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);

// "openmp" is auto once a runtime is known to be there: a team whenever one can be used
enum Pool : int { kAuto = 0, kThreads = 1 };
std::atomic<int> g_pool{-1};  // -1: not chosen yet (APEX_THREAD_POOL, else auto)
std::atomic<GompParallel> g_gomp{nullptr};
std::atomic<bool> g_forked{false};

GompParallel find_gomp() {
  GompParallel f = g_gomp.load(std::memory_order_acquire);
  if (f) return f;
#if defined(__linux__)
  void* sym = dlsym(RTLD_DEFAULT, "GOMP_parallel");
  // torch loads its runtime through a library opened RTLD_GLOBAL; if a build loaded it privately, ask for the
  // runtimes by name without loading one (RTLD_NOLOAD)
  for (const char* lib : {"libgomp.so.1", "libomp.so", "libiomp5.so"}) {
    if (sym) break;
    if (void* h = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD)) sym = dlsym(h, "GOMP_parallel");  // handle kept: stays loaded
  }
  f = reinterpret_cast<GompParallel>(sym);
  if (f) g_gomp.store(f, std::memory_order_release);
#endif
  return f;
}

int chosen_pool() {
  int p = g_pool.load(std::memory_order_relaxed);
  if (p >= 0) return p;
  p = kAuto;
  // "openmp" (like anything else) is auto: it still falls back to threads when the process has no runtime
  if (const char* e = std::getenv("APEX_THREAD_POOL"); e && std::string(e) == "threads") p = kThreads;
  g_pool.store(p, std::memory_order_relaxed);
  return p;
}

void mark_forked() { g_forked.store(true, std::memory_order_relaxed); }

#if defined(__linux__)
[[maybe_unused]] const int g_atfork = pthread_atfork(nullptr, nullptr, &mark_forked);
#endif

// The runtime a call may use now, or nullptr for std::threads.
GompParallel team_runtime() {
  if (chosen_pool() == kThreads || g_forked.load(std::memory_order_relaxed)) return nullptr;
  return find_gomp();
}

// The floating-point control of the calling thread (x86: MXCSR, AArch64: FPCR): flush-to-zero and
// denormals-are-zero (torch.set_flush_denormal sets them for its calling thread only) and the rounding mode. A
// team's threads run with the caller's for the call, so a result never depends on which thread computed a piece.
#if defined(__x86_64__) || defined(_M_X64)
using FpControl = unsigned;
inline FpControl get_fp_control() { return _mm_getcsr(); }
inline void set_fp_control(FpControl v) { _mm_setcsr(v); }
#elif defined(__aarch64__)
using FpControl = std::uint64_t;
inline FpControl get_fp_control() {
  std::uint64_t v;
  __asm__ volatile("mrs %0, fpcr" : "=r"(v));
  return v;
}
inline void set_fp_control(FpControl v) { __asm__ volatile("msr fpcr, %0" : : "r"(v)); }
#else
using FpControl = int;
inline FpControl get_fp_control() { return 0; }
inline void set_fp_control(FpControl) {}
#endif

struct TeamCall {
  void (*body)(void*);
  void* ctx;
  FpControl fp;
  std::once_flag failed;
  std::exception_ptr error;
};

// The function every team thread runs: nothing may unwind through the runtime's C frames.
void team_entry(void* p) {
  auto* c = static_cast<TeamCall*>(p);
  const FpControl own = get_fp_control();
  if (own != c->fp) set_fp_control(c->fp);
  try {
    c->body(c->ctx);
  } catch (...) {
    std::exception_ptr e = std::current_exception();
    std::call_once(c->failed, [c, &e] { c->error = e; });
  }
  if (own != c->fp) set_fp_control(own);
}
}  // namespace

// The flush-denormal mode torch.set_flush_denormal sets, for the calling thread, without torch (the torch-free
// kernel tests prove the conversions under it): x86 MXCSR DAZ (bit 6) + FTZ (bit 15), AArch64 FPCR.FZ (bit 24).
// False, with nothing changed, where there is no such mode: on x86 DAZ is set only where the MXCSR mask that
// FXSAVE reports has bit 6 (writing a bit outside the mask faults), as torch asks cpuinfo.
bool set_flush_denormal(bool on) {
#if defined(__x86_64__) || defined(_M_X64)
  alignas(16) unsigned char area[512] = {};
  __asm__ volatile("fxsave %0" : "=m"(area));
  std::uint32_t mask;
  std::memcpy(&mask, area + 28, sizeof mask);
  if (mask == 0) mask = 0xFFBF;  // FXSAVE's "no mask recorded": the default mask, without DAZ
  constexpr unsigned kDaz = 1u << 6, kFtz = 1u << 15;
  if (!(mask & kDaz)) return false;
  const FpControl v = get_fp_control();
  set_fp_control(on ? (v | kDaz | kFtz) : (v & ~(kDaz | kFtz)));
  return true;
#elif defined(__aarch64__)
  constexpr std::uint64_t kFz = std::uint64_t{1} << 24;
  const FpControl v = get_fp_control();
  set_fp_control(on ? (v | kFz) : (v & ~kFz));
  return true;
#else
  (void)on;
  return false;
#endif
}

void run_team(int parts, void (*body)(void*), void* ctx) {
  if (parts <= 1) {
    body(ctx);
    return;
  }
  TeamCall call{body, ctx, get_fp_control(), {}, nullptr};
  if (GompParallel gomp = team_runtime()) {
    // num_threads = parts: the team size asked for, whatever torch.set_num_threads left as the default. A call from
    // inside a parallel region gets a team of one (nested parallelism is off by default): every piece, one thread.
    gomp(&team_entry, &call, static_cast<unsigned>(parts), 0u);
  } else {
    std::vector<std::thread> pool;
    pool.reserve(static_cast<std::size_t>(parts - 1));
    try {
      for (int t = 1; t < parts; ++t) pool.emplace_back(&team_entry, &call);
    } catch (...) {  // no thread could be started (resource limits): the ones that did and this one do the work
    }
    team_entry(&call);
    for (auto& th : pool) th.join();
  }
  if (call.error) std::rethrow_exception(call.error);
}

std::string thread_pool() { return team_runtime() ? "openmp" : "threads"; }

void set_thread_pool(const std::string& name) {
  if (name == "auto") {
    g_pool.store(kAuto);
  } else if (name == "threads") {
    g_pool.store(kThreads);
  } else if (name == "openmp") {
    if (!find_gomp())
      throw std::invalid_argument("thread pool 'openmp': no OpenMP runtime (GOMP_parallel) is loaded in this process");
    g_pool.store(kAuto);
  } else {
    throw std::invalid_argument("unknown thread pool '" + name + "'; expected 'auto', 'openmp' or 'threads'");
  }
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
