// Kernel bodies, compiled once per SIMD level. The including translation unit
// defines APEX_SIMD_NS (namespace) and APEX_SIMD_NAME, and is built with that
// level's target flags; the loops below are written so that the compiler can
// vectorise them (no branches on data, fixed-width accumulators for sums).
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "common.h"

namespace apexc {
namespace APEX_SIMD_NS {

// Calls f(T*) with the storage type matching dtype code `dt`.
template <class F>
inline void with_type(int dt, F&& f) {
  switch (dt) {
    case F16: f(static_cast<half_t*>(nullptr)); break;
    case BF16: f(static_cast<bf16_t*>(nullptr)); break;
    default: f(static_cast<float*>(nullptr)); break;
  }
}

constexpr int kLanes = 16;

// Software prefetch for the streaming loops (optimizer updates and reductions), for streams of 16-bit elements
// only. A loop streams one to seven buffers; on some x86 hosts the hardware prefetchers fall behind the 16-bit
// loops, whose loads then wait on memory (bf16 SGD with momentum, 108M elements, 2 threads, Intel Xeon with
// AVX-512: 17 GB/s, 46 GB/s with these prefetches). fp32 streams are left to the hardware: on that Xeon the fp32
// loops ran at the host's bandwidth either way, and on an AMD EPYC (Zen 4) prefetching them into L1 made the
// fp32 loops 20-35% slower (Adam, SGD, BertAdam, LAMB stage 1, sum of squares; 1 and 2 threads), where the 16-bit
// loops ran the same with or without. streamed(lo, hi, body, streams...) runs body(c0, c1) over chunks of
// kStreamChunk elements of [lo, hi) and, before each full chunk, prefetches every line of each 16-bit stream
// kStreamAhead elements further on. A full chunk has a constant trip count, so its vector loop has no remainder;
// the rest of the range runs as one shorter chunk. Elementwise loops get the bits of one loop over [lo, hi);
// reductions keep theirs too as long as their lane of element i is (i - lo) % lanes with lanes dividing
// kStreamChunk: every chunk starts on lane 0. Prefetches past the end of a buffer are harmless: they never fault.
constexpr idx_t kStreamChunk = 64, kStreamAhead = 1024;

// element i of a stream at base + i * size (size 0: nothing to prefetch)
struct Stream {
  std::uintptr_t base, size;
};
// x indexed from `origin`: x[i - origin] is the loop's element i; wider elements are not prefetched (above)
template <class T>
APEX_ELEMENT Stream stream(const T* x, idx_t origin = 0) {
  if constexpr (sizeof(T) > 2) return {0, 0};
  return {reinterpret_cast<std::uintptr_t>(x) - static_cast<std::uintptr_t>(origin) * sizeof(T), sizeof(T)};
}

APEX_ELEMENT void prefetch_chunk(const Stream& s, idx_t at) {
#if defined(__GNUC__) || defined(__clang__)
  if (!s.size) return;
  const std::uintptr_t first = s.base + static_cast<std::uintptr_t>(at) * s.size;
  for (std::uintptr_t b = 0; b < kStreamChunk * s.size; b += 64) __builtin_prefetch(reinterpret_cast<const void*>(first + b));
#else
  (void)s;
  (void)at;
#endif
}

template <class Body, class... S>
APEX_ELEMENT void streamed(idx_t lo, idx_t hi, Body&& body, const S&... s) {
  idx_t c = lo;
  for (; hi - c > kStreamChunk; c += kStreamChunk) {
    (prefetch_chunk(s, c + kStreamAhead), ...);
    body(c, c + kStreamChunk);
  }
  body(c, hi);
}

// A lane-split reduction over [lo, hi) through streamed(): body(i, l) for every element, with l = (i - lo) % L,
// so each lane accumulates the same elements in the same order as one plain loop would give it.
template <int L, class Body, class... S>
APEX_ELEMENT void streamed_lanes(idx_t lo, idx_t hi, Body&& body, const S&... s) {
  static_assert(kStreamChunk % L == 0, "a streamed chunk must hold whole lane groups");
  streamed(lo, hi, [&](idx_t c0, idx_t c1) {
    idx_t i = c0;
    for (; i + L <= c1; i += L)
      for (int l = 0; l < L; ++l) body(i + l, l);
    for (int l = 0; i < c1; ++i, ++l) body(i, l);
  }, s...);
}

template <class S, class D>
static bool scale_range(const S* __restrict src, D* __restrict dst, idx_t n, float s, bool check) {
  std::uint32_t bad = 0;
  if (check) {
    streamed(0, n, [&](idx_t c0, idx_t c1) {
      for (idx_t i = c0; i < c1; ++i) {
        float v = load(src, i);
        bad |= (f32_to_bits(v) & 0x7f800000u) == 0x7f800000u ? 1u : 0u;
        store(dst, i, v * s);
      }
    }, stream(src), stream(dst));
  } else {
    streamed(0, n, [&](idx_t c0, idx_t c1) {
      for (idx_t i = c0; i < c1; ++i) store(dst, i, load(src, i) * s);
    }, stream(src), stream(dst));
  }
  return bad != 0;
}

// In-place variant: src and dst alias, so no __restrict.
template <class T>
static bool scale_inplace_range(T* p, idx_t n, float s, bool check) {
  std::uint32_t bad = 0;
  streamed(0, n, [&](idx_t c0, idx_t c1) {
    for (idx_t i = c0; i < c1; ++i) {
      float v = load(p, i);
      bad |= (f32_to_bits(v) & 0x7f800000u) == 0x7f800000u ? 1u : 0u;
      store(p, i, v * s);
    }
  }, stream(p));
  return check && bad != 0;
}

template <class S, class D>
static bool axpy_range(const S* __restrict src, D* __restrict dst, idx_t n, float s) {
  std::uint32_t bad = 0;
  streamed(0, n, [&](idx_t c0, idx_t c1) {
    for (idx_t i = c0; i < c1; ++i) {
      float v = load(src, i);
      bad |= (f32_to_bits(v) & 0x7f800000u) == 0x7f800000u ? 1u : 0u;
      store(dst, i, load(dst, i) + v * s);
    }
  }, stream(src), stream(dst));
  return bad != 0;
}

static bool scale(const void* src, int sdt, void* dst, int ddt, idx_t n, float s, bool check, int threads) {
  bool found = false;
  with_type(sdt, [&](auto* st) {
    using S = std::remove_pointer_t<decltype(st)>;
    with_type(ddt, [&](auto* dt_) {
      using D = std::remove_pointer_t<decltype(dt_)>;
      const S* sp = static_cast<const S*>(src);
      D* dp = static_cast<D*>(dst);
      std::atomic_bool any{false};
      parallel_for(n, threads, [&](idx_t b, idx_t e) {
        bool r;
        if (static_cast<const void*>(sp) == static_cast<void*>(dp)) {
          if constexpr (std::is_same_v<S, D>) {
            r = scale_inplace_range(dp + b, e - b, s, check);
          } else {
            r = false;  // unreachable: aliasing with different dtypes is rejected by the binding
          }
        } else {
          r = scale_range(sp + b, dp + b, e - b, s, check);
        }
        if (r) any.store(true, std::memory_order_relaxed);
      });
      found = any.load();
    });
  });
  return found;
}

static bool axpy(const void* src, int sdt, void* dst, int ddt, idx_t n, float s, bool check, int threads) {
  bool found = false;
  with_type(sdt, [&](auto* st) {
    using S = std::remove_pointer_t<decltype(st)>;
    with_type(ddt, [&](auto* dt_) {
      using D = std::remove_pointer_t<decltype(dt_)>;
      std::atomic_bool any{false};
      parallel_for(n, threads, [&](idx_t b, idx_t e) {
        if (axpy_range(static_cast<const S*>(src) + b, static_cast<D*>(dst) + b, e - b, s))
          any.store(true, std::memory_order_relaxed);
      });
      found = any.load();
    });
  });
  return check && found;
}

// Converts once, then replicates the stored bits as plain integers: a loop assigning the 16-bit element structs
// is not vectorised (bf16, 108M elements, 2 threads: 9 GB/s against 27 GB/s for the integer loop), and zero bits
// go through memset, which picks the host's best store sequence.
static void fill(void* dst, int dt, idx_t n, float value, int threads) {
  with_type(dt, [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    using Bits = std::conditional_t<sizeof(T) == 2, std::uint16_t, std::uint32_t>;
    static_assert(sizeof(T) == sizeof(Bits), "storage types are 16 or 32 bits wide");
    T v;
    store(&v, 0, value);
    Bits bits;
    std::memcpy(&bits, &v, sizeof bits);
    Bits* p = static_cast<Bits*>(dst);
    parallel_for(n, threads, [&](idx_t b, idx_t e) {
      if (bits == 0) {
        std::memset(p + b, 0, static_cast<std::size_t>(e - b) * sizeof(Bits));
      } else {
        for (idx_t i = b; i < e; ++i) p[i] = bits;
      }
    });
  });
}

template <class T>
static bool nonfinite_range(const T* p, idx_t n) {
  std::uint32_t bad = 0;
  streamed(0, n, [&](idx_t c0, idx_t c1) {
    for (idx_t i = c0; i < c1; ++i) bad |= nonfinite_bits(load(p, i)) ? 1u : 0u;
  }, stream(p));
  return bad != 0;
}

static bool has_nonfinite(const void* src, int dt, idx_t n, int threads) {
  bool found = false;
  with_type(dt, [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    std::atomic_bool any{false};
    parallel_for(n, threads, [&](idx_t b, idx_t e) {
      if (nonfinite_range(static_cast<const T*>(src) + b, e - b)) any.store(true, std::memory_order_relaxed);
    });
    found = any.load();
  });
  return found;
}

// Sum of squares of one range with kLanes independent double accumulators,
// combined in a fixed order: the result depends only on the range, never on
// how ranges were distributed over threads.
template <class T>
static double sum_sq_range(const T* p, idx_t n) {
  double acc[kLanes] = {0};
  streamed_lanes<kLanes>(0, n, [&](idx_t i, int l) {
    const double v = static_cast<double>(load(p, i));
    acc[l] += v * v;
  }, stream(p));
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// Max |x|; nan anywhere makes the result nan (as torch.norm(inf) does).
template <class T>
static double max_abs_range(const T* p, idx_t n) {
  float acc[kLanes] = {0};
  std::uint32_t nan = 0;
  streamed_lanes<kLanes>(0, n, [&](idx_t i, int l) {
    const std::uint32_t a = f32_to_bits(load(p, i)) & 0x7fffffffu;
    nan |= a > 0x7f800000u ? 1u : 0u;
    const float av = bits_to_f32(a);
    acc[l] = av > acc[l] ? av : acc[l];
  }, stream(p));
  float m = 0.f;
  for (int l = 0; l < kLanes; ++l) m = acc[l] > m ? acc[l] : m;
  return nan ? std::nan("") : static_cast<double>(m);
}

template <class R>
static double chunked_reduce(idx_t n, int threads, R&& range_fn, bool use_max) {
  const idx_t chunks = ceil_div(n, kChunk);
  std::vector<double> part(static_cast<std::size_t>(chunks), 0.0);
  parallel_items(chunks, n, threads, [&](idx_t b, idx_t e) {
    for (idx_t c = b; c < e; ++c) {
      const idx_t lo = c * kChunk, hi = step_to(lo, kChunk, n);
      part[static_cast<std::size_t>(c)] = range_fn(lo, hi - lo);
    }
  });
  double r = 0.0;
  for (double v : part) {
    if (use_max) {
      r = (std::isnan(v) || std::isnan(r)) ? std::nan("") : (v > r ? v : r);
    } else {
      r += v;
    }
  }
  return r;
}

static double sum_sq(const void* src, int dt, idx_t n, int threads) {
  double r = 0.0;
  with_type(dt, [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    const T* p = static_cast<const T*>(src);
    r = chunked_reduce(n, threads, [&](idx_t lo, idx_t len) { return sum_sq_range(p + lo, len); }, false);
  });
  return r;
}

static double max_abs(const void* src, int dt, idx_t n, int threads) {
  double r = 0.0;
  with_type(dt, [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    const T* p = static_cast<const T*>(src);
    r = chunked_reduce(n, threads, [&](idx_t lo, idx_t len) { return max_abs_range(p + lo, len); }, true);
  });
  return r;
}

// Work items for per-segment reductions: each segment is cut into kChunk
// pieces; partials are summed per segment in item order (thread-independent).
struct SegItems {
  std::vector<idx_t> seg, lo, hi;
};

inline SegItems make_items(Segments s) {
  SegItems it;
  for (idx_t k = 0; k < s.n; ++k) {
    for (idx_t lo = s.off[k], hi; lo < s.off[k + 1]; lo = hi) {
      hi = step_to(lo, kChunk, s.off[k + 1]);
      it.seg.push_back(k);
      it.lo.push_back(lo);
      it.hi.push_back(hi);
    }
  }
  return it;
}

static void segment_sum_sq(const void* src, int dt, Segments s, double* out, int threads) {
  for (idx_t k = 0; k < s.n; ++k) out[k] = 0.0;
  if (s.n == 0) return;
  SegItems it = make_items(s);
  const idx_t items = static_cast<idx_t>(it.seg.size());
  std::vector<double> part(it.seg.size(), 0.0);
  with_type(dt, [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    const T* p = static_cast<const T*>(src);
    parallel_items(items, s.off[s.n] - s.off[0], threads, [&](idx_t b, idx_t e) {
      for (idx_t i = b; i < e; ++i) part[i] = sum_sq_range(p + it.lo[i], it.hi[i] - it.lo[i]);
    });
  });
  for (idx_t i = 0; i < items; ++i) out[it.seg[i]] += part[i];
}

static const Kernels table = {
    APEX_SIMD_NAME, scale, axpy, fill, has_nonfinite, sum_sq, max_abs, segment_sum_sq,
};

}  // namespace APEX_SIMD_NS
}  // namespace apexc
