// Shared definitions of the torch-free kernel core.
//
// Everything here works on raw host buffers: a pointer, an element count and a
// dtype code. Nothing includes or links libtorch, so one build serves every
// torch version (and numpy-only tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <string>
#include <vector>

namespace apexc {

using idx_t = std::int64_t;

// Dtype codes shared with Python (apex._core.DTYPE_CODES).
enum DType : int { F32 = 0, F16 = 1, BF16 = 2 };

inline bool valid_dtype(int d) { return d == F32 || d == F16 || d == BF16; }
inline std::size_t dtype_size(int d) { return d == F32 ? 4 : 2; }

// ---------------------------------------------------------------------------
// Scalar conversions. The *_soft functions define the bits every SIMD level
// must produce: round to nearest even, subnormals kept (also under DAZ/FTZ),
// infinities kept; a nan keeps its sign and the top bits of its payload and is
// quieted: fp32 -> fp16 / bf16 stores keep the top 10 / 7 payload bits with the
// quiet bit set, fp16 loads set the quiet bit of a signalling nan, bf16 loads
// are exact. These are the bits of x86 F16C and of torch's own CPU casts, so the
// F16C levels need no fix-up instructions around the conversions.
// They are branch-free and every select is a mask, never a conditional
// expression: GCC (default -ftrapping-math) will not speculate the float add
// of one arm, so a conditional kept the whole optimizer loop scalar.
// ---------------------------------------------------------------------------
// Element helpers (bit casts, conversions, load/store) are forced inline: an optimizer loop vectorises only
// if every call in its body is inlined, and GCC's size heuristics stop inlining the larger fp16 conversions
// once a translation unit grows (a loop of scalar calls measured 20x slower).
#if defined(__GNUC__) || defined(__clang__)
#define APEX_ELEMENT inline __attribute__((always_inline))
#else
#define APEX_ELEMENT inline
#endif

APEX_ELEMENT float bits_to_f32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
APEX_ELEMENT std::uint32_t f32_to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// All ones when c holds, else zero; pick(m, a, b) = m ? a : b without a branch.
// Range tests compare as signed 32-bit (operands are below 2^31): one vector
// compare on x86, where an unsigned one takes two.
APEX_ELEMENT std::int32_t s32(std::uint32_t u) { return static_cast<std::int32_t>(u); }
APEX_ELEMENT std::uint32_t mask_if(bool c) { return 0u - static_cast<std::uint32_t>(c); }
APEX_ELEMENT std::uint32_t pick(std::uint32_t m, std::uint32_t a, std::uint32_t b) { return (a & m) | (b & ~m); }
// c ? a : b for floats, both arms evaluated: optimizer loops use it for a per-call option (nesterov, decoupled
// decay), where a conditional float expression became a branch that kept the whole loop scalar.
APEX_ELEMENT float pick_f32(bool c, float a, float b) {
  return bits_to_f32(pick(mask_if(c), f32_to_bits(a), f32_to_bits(b)));
}

APEX_ELEMENT float half_to_f32_soft(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t em = h & 0x7fffu;
  // Normal halves: move exponent+mantissa into float position and rebias the
  // exponent (15 -> 127) with an integer add.
  const std::uint32_t normal = (em << 13) + 0x38000000u;
  // Subnormal halves are em * 2^-24, computed as (0.5 + em * 2^-24) - 0.5: every
  // operand is a normal float, so the value survives flush-denormal modes
  // (DAZ/FTZ, e.g. torch.set_flush_denormal(True)).
  const std::uint32_t sub = f32_to_bits(bits_to_f32(0x3f000000u | em) - 0.5f);
  // inf; a nan keeps its payload and is quieted (bit 22)
  const std::uint32_t special = (em << 13) | 0x7f800000u | (mask_if(s32(em) > 0x7c00) & 0x00400000u);
  std::uint32_t out = pick(mask_if(s32(em) < 0x0400), sub, normal);
  out = pick(mask_if(s32(em) >= 0x7c00), special, out);
  return bits_to_f32(out | sign);
}

APEX_ELEMENT std::uint16_t f32_to_half_soft(float f) {
  const std::uint32_t u = f32_to_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  // Normal range: rebias the exponent, round to nearest even on bit 13.
  const std::uint32_t odd = (a >> 13) & 1u;
  const std::uint32_t normal = (a + 0xc8000fffu + odd) >> 13;  // 0xc8000000 = (15-127)<<23
  // Subnormal range: adding 0.5f aligns the mantissa so the FPU rounds (RNE).
  const std::uint32_t sub = f32_to_bits(bits_to_f32(a) + 0.5f) - 0x3f000000u;
  std::uint32_t r = pick(mask_if(s32(a) < 0x38800000), sub, normal);  // 2^-14
  r = pick(mask_if(s32(a) >= 0x477ff000), 0x7c00u, r);                 // rounds to inf
  r = pick(mask_if(s32(a) > 0x7f800000), ((a >> 13) & 0x3ffu) | 0x7e00u, r);  // nan: top payload bits, quiet
  return static_cast<std::uint16_t>(r | sign);
}

APEX_ELEMENT float bf16_to_f32(std::uint16_t h) { return bits_to_f32(static_cast<std::uint32_t>(h) << 16); }

// Integer arithmetic and a nan compare, so it is exact under any MXCSR/FPCR mode. Hardware bf16
// narrowing (AVX512-BF16 VCVTNEPS2BF16, ARM BFCVT) reads denormal inputs as
// zero; VCVTNEPS2BF16 with an exact fix-up for those inputs was measured and is
// slower in the bf16 Adam kernels (docs/DESIGN-NOTES.md, f16/bf16 storage).
APEX_ELEMENT std::uint16_t f32_to_bf16(float f) {
  // RNE: add 0x7fff, or 0x8000 when the kept part is odd (bit 16), and keep the top half; a nan keeps its top
  // half with the quiet bit set. As a bit test, two selects and a nan compare (one vector compare, where the
  // abs + integer compare took two) this vectorises to 6 instructions against 8 for the shift-and-add form:
  // the bf16 optimizer loops store 2-3 values per element and are instruction bound.
  const std::uint32_t u = f32_to_bits(f);
  const std::uint32_t bias = pick(mask_if((u & 0x10000u) != 0), 0x8000u, 0x7fffu);
  const std::uint32_t r = pick(mask_if(f != f), u | 0x00400000u, u + bias);
  return static_cast<std::uint16_t>(r >> 16);
}

// fp16 through the conversion instructions: on x86_64 F16C (VCVTPH2PS,
// VCVTPS2PH with the MXCSR rounding, nearest-even unless a program changes it;
// torch never does), one instruction per 8 or 16 values; on AArch64 FCVTL /
// FCVTN (4 values each, FPCR rounding, nearest-even by default), which every
// AArch64 CPU has, so only a level that asks for them (the neon level defines
// APEX_AARCH64_F16_CONVERT) uses them and the baseline level keeps the soft
// forms it is tested against. Both give the *_soft bits for every input,
// subnormals and nans included, with or without flush-to-zero (x86 DAZ/FTZ;
// AArch64 FPCR.FZ, which these conversions apply to fp32 inputs only, and
// every fp32 denormal rounds to a signed zero in fp16 anyway), with FPCR's
// default-nan and alternative-half-precision modes off, as Linux starts every
// thread (checked over all 2^16 / 2^32 inputs). Only clang (zig, the release
// build) vectorises _Float16 conversions into these instructions; GCC before
// 13 would emit one call per element on x86, so GCC builds use the *_soft
// forms (same bits).
#if defined(__clang__) && ((defined(__x86_64__) && defined(__F16C__)) || \
                           (defined(__aarch64__) && defined(APEX_AARCH64_F16_CONVERT)))
#define APEX_F16_HARDWARE 1
APEX_ELEMENT float half_to_f32(std::uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return static_cast<float>(x);
}
APEX_ELEMENT std::uint16_t f32_to_half(float f) {
  const _Float16 x = static_cast<_Float16>(f);
  std::uint16_t hw;
  std::memcpy(&hw, &x, 2);
  return hw;
}
#else
#define APEX_F16_HARDWARE 0
APEX_ELEMENT float half_to_f32(std::uint16_t h) { return half_to_f32_soft(h); }
APEX_ELEMENT std::uint16_t f32_to_half(float f) { return f32_to_half_soft(f); }
#endif

// Storage types: float for F32, distinct 16-bit wrappers for F16 / BF16.
struct half_t { std::uint16_t x; };
struct bf16_t { std::uint16_t x; };

APEX_ELEMENT float load(const float* p, idx_t i) { return p[i]; }
APEX_ELEMENT float load(const half_t* p, idx_t i) { return half_to_f32(p[i].x); }
APEX_ELEMENT float load(const bf16_t* p, idx_t i) { return bf16_to_f32(p[i].x); }
APEX_ELEMENT void store(float* p, idx_t i, float v) { p[i] = v; }
APEX_ELEMENT void store(half_t* p, idx_t i, float v) { p[i].x = f32_to_half(v); }
APEX_ELEMENT void store(bf16_t* p, idx_t i, float v) { p[i].x = f32_to_bf16(v); }
// store(p, i, v) and then load(p, i), without the round trip through memory: a loop that reads back
// what it stored (a low-precision state the update uses as stored) stays in registers.
APEX_ELEMENT float store_load(float* p, idx_t i, float v) {
  p[i] = v;
  return v;
}
APEX_ELEMENT float store_load(half_t* p, idx_t i, float v) {
  const std::uint16_t h = f32_to_half(v);
  p[i].x = h;
  return half_to_f32(h);
}
APEX_ELEMENT float store_load(bf16_t* p, idx_t i, float v) {
  const std::uint16_t h = f32_to_bf16(v);
  p[i].x = h;
  return bf16_to_f32(h);
}

// Bit test for inf/nan that vectorises (no float compares on nan).
APEX_ELEMENT bool nonfinite_bits(float v) { return (f32_to_bits(v) & 0x7f800000u) == 0x7f800000u; }

// ---------------------------------------------------------------------------
// Checked arithmetic. Element counts that reach a kernel are validated by the
// bindings (at most kMaxElements), but the index arithmetic below is written so
// that no count in [0, 2^63) can overflow it either.
// ---------------------------------------------------------------------------
// Largest element count any entry point accepts: 2^48 elements (1 PiB of fp32),
// far beyond any real buffer and small enough that count * 8 bytes cannot overflow.
constexpr idx_t kMaxElements = idx_t{1} << 48;

// a + b and a * b, false (and *out untouched) when the exact result does not fit.
inline bool checked_add(idx_t a, idx_t b, idx_t* out) {
  idx_t r;
  if (__builtin_add_overflow(a, b, &r)) return false;
  *out = r;
  return true;
}
inline bool checked_mul(idx_t a, idx_t b, idx_t* out) {
  idx_t r;
  if (__builtin_mul_overflow(a, b, &r)) return false;
  *out = r;
  return true;
}
// ceil(n / d) for n >= 0, d > 0 without forming n + d - 1.
inline idx_t ceil_div(idx_t n, idx_t d) { return n / d + (n % d != 0 ? 1 : 0); }
// min(b + step, end) for b <= end without forming b + step past end.
inline idx_t step_to(idx_t b, idx_t step, idx_t end) { return end - b > step ? b + step : end; }

// ---------------------------------------------------------------------------
// Threading: a call's threads are the OpenMP team of the runtime torch loaded
// (libgomp, or a runtime with its GOMP entry points) when the process has one,
// else std::threads started for the call. Either way nothing of ours outlives
// a call. See run_team (dispatch.cpp) for why and for the fork rule.
// ---------------------------------------------------------------------------
constexpr idx_t kMinPerThread = 1 << 16;  // below this, threads cost more than they save
constexpr idx_t kChunk = 1 << 14;         // reduction chunk: fixed, so sums do not depend on threads

int default_threads();
void set_default_threads(int n);
int resolve_threads(int requested);

// Runs body(ctx) on `parts` threads at once, the caller being one of them, and returns when all have returned
// (an exception from body is rethrown here, the first one). The other threads come from the OpenMP runtime's team
// when that pool is in use, else they are std::threads started for this call.
void run_team(int parts, void (*body)(void*), void* ctx);
// "openmp" or "threads": what the next run_team uses. set_thread_pool takes "auto" (OpenMP when the process has a
// runtime, else threads), "openmp" (std::invalid_argument when there is none) or "threads".
std::string thread_pool();
void set_thread_pool(const std::string& name);

// How [0, n) is cut into ranges: range t is [t * per, min((t + 1) * per, n)) for
// t < parts. Every range but the last has a length that is a multiple of `align`;
// the ranges are disjoint and cover [0, n) exactly, for any n >= 0. `piece`
// (a multiple of `align` when there are several parts, at most `per`) is the
// unit in which the threads take work, see run_split; pieces start at multiples
// of `piece`.
struct Split {
  idx_t per;
  int parts;
  idx_t piece;
};

constexpr idx_t kPiecesPerThread = 16;

// At most `threads` ranges (<= 0 or 1: one range), each of at least `min_per`
// elements unless the whole is smaller.
inline Split split_range(idx_t n, int threads, idx_t min_per, idx_t align) {
  if (n <= 0) return {0, 0, 0};
  if (align < 1) align = 1;
  if (min_per < 1) min_per = 1;
  idx_t t = threads < 1 ? 1 : threads;
  const idx_t by_size = n / min_per;
  if (by_size < t) t = by_size < 1 ? 1 : by_size;
  idx_t per = ceil_div(n, t), aligned;
  if (!checked_mul(ceil_div(per, align), align, &aligned) || aligned >= n) return {n, 1, n};
  per = aligned;
  // per is a multiple of align, so ceil_div(per / align, k) * align <= per cannot overflow
  const idx_t piece = ceil_div(per / align, kPiecesPerThread) * align;
  return {per, static_cast<int>(ceil_div(n, per)), piece};
}

// The split parallel_for uses for n elements and a requested thread count.
inline Split plan_parallel_for(idx_t n, int threads, idx_t align = 64) {
  return split_range(n, resolve_threads(threads), kMinPerThread, align);
}

// Runs fn(begin, end) over [0, n) on split.parts threads (run_team), the calling
// one included. The threads take consecutive pieces of `split.piece` elements
// from a shared counter instead of one fixed range each: a thread that starts
// late (its core still busy with something else) then does less, instead of
// the call waiting for its whole range.
// fn must only depend on its range (every caller's ranges are independent:
// element-wise updates, or partial sums stored per fixed chunk and added in order).
template <class F>
void run_split(idx_t n, Split split, F&& fn) {
  if (split.parts <= 0) return;
  // fn has one call site (inside `work`, reached through `body` also for a single part): inlined twice, large
  // bodies could exceed the inliner's growth limits and lose their vectorised element loops
  const idx_t piece = split.piece;
  const idx_t pieces = ceil_div(n, piece);
  std::atomic<idx_t> next{0};
  auto work = [&fn, &next, piece, pieces, n] {
    for (idx_t i = next.fetch_add(1, std::memory_order_relaxed); i < pieces;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      const idx_t b = i * piece;  // < n: pieces = ceil(n / piece)
      fn(b, step_to(b, piece, n));
    }
  };
  void (*body)(void*) = [](void* w) { (*static_cast<decltype(work)*>(w))(); };
  if (split.parts == 1) {
    body(&work);
    return;
  }
  run_team(split.parts, body, &work);
}

// Runs fn(begin, end) over [0, n) split into up to `threads` contiguous ranges
// whose boundaries are multiples of `align`.
template <class F>
void parallel_for(idx_t n, int threads, F&& fn, idx_t align = 64) {
  run_split(n, plan_parallel_for(n, threads, align), fn);
}

// Same split, over an index space of work items (chunks, segments); the thread
// count is bounded by the elements those items cover (elems_hint).
template <class F>
void parallel_items(idx_t items, idx_t elems_hint, int threads, F&& fn) {
  int t = resolve_threads(threads);
  const idx_t by_size = elems_hint / kMinPerThread;
  if (by_size < t) t = static_cast<int>(by_size < 1 ? 1 : by_size);
  run_split(items, split_range(items, t, 1, 1), fn);
}

// ---------------------------------------------------------------------------
// Kernel table: one instance per SIMD level, all compiled from the same source
// (kernels_impl.h) with different target flags.
// ---------------------------------------------------------------------------
// Segment layout for per-tensor work inside one flat buffer: seg_off has
// nseg+1 entries, segment s covers [seg_off[s], seg_off[s+1]).
struct Segments {
  const idx_t* off;
  idx_t n;
};

struct Kernels {
  const char* name;
  // dst[i] = src[i] * scale with dtype conversion; src may equal dst (same dtype).
  // Returns true when `check` and any *input* element is inf or nan.
  bool (*scale)(const void* src, int sdt, void* dst, int ddt, idx_t n, float scale, bool check, int threads);
  // Adds src*scale into dst (gradient accumulation with unscale); returns non-finite of src.
  bool (*axpy)(const void* src, int sdt, void* dst, int ddt, idx_t n, float scale, bool check, int threads);
  void (*fill)(void* dst, int dt, idx_t n, float value, int threads);
  bool (*has_nonfinite)(const void* src, int dt, idx_t n, int threads);
  double (*sum_sq)(const void* src, int dt, idx_t n, int threads);
  double (*max_abs)(const void* src, int dt, idx_t n, int threads);
  // Per-segment sum of squares into out[nseg] (double).
  void (*segment_sum_sq)(const void* src, int dt, Segments seg, double* out, int threads);
};

const Kernels& kernels_baseline();
#if defined(__x86_64__) || defined(_M_X64)
const Kernels& kernels_avx2();
const Kernels& kernels_avx512();
#endif
#if defined(__aarch64__)
const Kernels& kernels_neon();
#endif

// Currently selected table (dispatch.cpp).
const Kernels& K();

}  // namespace apexc
