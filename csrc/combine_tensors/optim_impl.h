// Optimizer kernel bodies, compiled once per SIMD level (see kernels_impl.h).
// Arithmetic is fp32 whatever the storage dtype (as torch's opmath); per-segment
// scalars (bias corrections) are computed in double once per segment.
#include <algorithm>
#include <atomic>
#include <utility>
#include <vector>
#include <cmath>
#include <stdexcept>
#include <type_traits>

#include "optim.h"

// The avx2 level runs the bf16 element loops of Adam, SGD, Adadelta, RMSprop, BertAdam, Adagrad and LAMB's stage 2
// in intrinsic blocks (bf16_avx2.h): there the compiler's form of those loops is bound by instruction count.
// AVX-512 levels keep the element loops (wider vectors, cheaper narrowing).
#if defined(__AVX2__) && !defined(__AVX512F__)
#define APEX_BF16_AVX2_BLOCKS 1
#include "bf16_avx2.h"
#else
#define APEX_BF16_AVX2_BLOCKS 0
#endif

// The flat buffers of one call never overlap (checked where they are built), but
// the compiler cannot see that through the lambda captures: without this hint
// it versions every loop with alias checks and keeps reloading pointers, which
// measured 2.5x slower than the plain loop.
#ifndef APEX_IVDEP
#if defined(__clang__)
#define APEX_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define APEX_IVDEP _Pragma("GCC ivdep")
#else
#define APEX_IVDEP
#endif
#endif

namespace apexc {
namespace APEX_SIMD_NS {

using apexc::load;
using apexc::store;
struct no_out_t {};
inline void store(no_out_t*, idx_t, float) {}

// An optimizer without an out copy streams no out buffer.
APEX_ELEMENT Stream stream(const no_out_t*, idx_t = 0) { return {0, 0}; }

// The element loops that run bf16_avx2.h's blocks first (avx2 level): bf16 params and grads, states in the param
// dtype, no out copy.
template <class P, class G, class O>
inline constexpr bool kBf16Blocks = APEX_BF16_AVX2_BLOCKS && std::is_same_v<P, bf16_t> && std::is_same_v<G, bf16_t> &&
                                    std::is_same_v<O, no_out_t>;

// Calls f(P*, G*, O*) for the supported (param, grad, out) storage combinations:
// grads in the param dtype, or fp32 params (master weights) with any grad dtype;
// an out copy only for fp32 params. Anything else is rejected by the binding.
template <class F>
inline void with_pgo(const OptArgs& a, F&& f) {
  if (a.pdt == F32) {
    auto with_g = [&](auto* o) {
      switch (a.gdt) {
        case F16: f(static_cast<float*>(nullptr), static_cast<half_t*>(nullptr), o); break;
        case BF16: f(static_cast<float*>(nullptr), static_cast<bf16_t*>(nullptr), o); break;
        default: f(static_cast<float*>(nullptr), static_cast<float*>(nullptr), o); break;
      }
    };
    if (!a.out) with_g(static_cast<no_out_t*>(nullptr));
    else if (a.odt == F16) with_g(static_cast<half_t*>(nullptr));
    else with_g(static_cast<bf16_t*>(nullptr));
  } else if (a.pdt == F16) {
    f(static_cast<half_t*>(nullptr), static_cast<half_t*>(nullptr), static_cast<no_out_t*>(nullptr));
  } else {
    f(static_cast<bf16_t*>(nullptr), static_cast<bf16_t*>(nullptr), static_cast<no_out_t*>(nullptr));
  }
}

// with_pgo plus the state storage type S: P's, or float for fp16/bf16 params under kF32States (Adam).
template <class F>
inline void with_pgos(const OptArgs& a, F&& f) {
  if ((a.flags & kF32States) && a.pdt != F32) {
    auto* none = static_cast<no_out_t*>(nullptr);
    auto* s32 = static_cast<float*>(nullptr);
    if (a.pdt == F16) f(static_cast<half_t*>(nullptr), static_cast<half_t*>(nullptr), none, s32);
    else f(static_cast<bf16_t*>(nullptr), static_cast<bf16_t*>(nullptr), none, s32);
    return;
  }
  with_pgo(a, [&](auto* pt, auto* gt, auto* ot) { f(pt, gt, ot, pt); });
}

#define APEX_TYPES(pt, gt, ot)                       \
  using P = std::remove_pointer_t<decltype(pt)>;     \
  using G = std::remove_pointer_t<decltype(gt)>;     \
  using O = std::remove_pointer_t<decltype(ot)>;     \
  P* __restrict p = static_cast<P*>(a.p);            \
  const G* __restrict g = static_cast<const G*>(a.g); \
  O* __restrict o = static_cast<O*>(a.out);          \
  (void)p; (void)g; (void)o

inline float gmul(const OptArgs& a, idx_t k) { return a.grad_scale * (a.seg_gmul ? a.seg_gmul[k] : 1.f); }

// Per-slot scalars that depend only on the slot's step count (bias corrections): the slots of a call nearly always
// share one count, so f(t) is taken once for slot 0's count and again only for a slot whose count differs (Adam
// over 5000 slots of 200 elements: 10000 pow() per call otherwise). Without per-slot steps every slot reads t = 0.
template <class F>
inline auto by_step_count(const OptArgs& a, F f) {
  const double t0 = (a.nseg > 0 && a.steps) ? a.steps[0] : 0.0;
  const auto v0 = f(t0);
  return [&a, f, t0, v0](idx_t k) {
    const double t = a.steps ? a.steps[k] : 0.0;
    return t == t0 ? v0 : f(t);
  };
}

// Adam's (and AdamP's) bias corrections by slot: (step size lr / (1 - b1^t), sqrt(1 - b2^t)) from hp[0..2] =
// lr, b1, b2; (lr, 1) without bias correction.
inline auto adam_corrections(const OptArgs& a, bool bias_correction) {
  const double lr = a.hp[0], b1 = a.hp[1], b2 = a.hp[2];
  return by_step_count(a, [=](double t) {
    return std::pair<float, float>(static_cast<float>(bias_correction ? lr / (1.0 - std::pow(b1, t)) : lr),
                                   static_cast<float>(bias_correction ? std::sqrt(1.0 - std::pow(b2, t)) : 1.0));
  });
}

// ---------------------------------------------------------------------------
// torch.optim.SGD. Weight decay and Nesterov are template parameters (chosen once per call): torch adds the
// decay term only when weight_decay != 0 (so an inf param stays inf instead of meeting 0 * inf = NaN), and
// once the memory keeps up (prefetched) the 16-bit loops are bound by instruction count, so terms that do not
// apply are not computed.
// POST (kDecoupled): a per-segment multiplier on the momentum result and the decay after it,
// u = s * seg_mul[k] (+ wd * p when POST == 2, i.e. weight_decay != 0; seg_mul absent = 1): NovoGrad's
// update m / (bc1 * d_k) + wd * p in the pass that updates its moment m, and NVIDIA FusedSGD's
// wd_after_momentum (no seg_mul).
template <bool L2, bool NESTEROV, int POST>
static void sgd_body(const OptArgs& a) {
  with_pgo(a, [&](auto* pt, auto* gt, auto* ot) {
    APEX_TYPES(pt, gt, ot);
    P* __restrict buf = static_cast<P*>(a.s[0]);
    const float lr = static_cast<float>(a.hp[0]), mom = static_cast<float>(a.hp[1]);
    const float take = static_cast<float>(1.0 - a.hp[2]);  // 1 - dampening
    const float wd = static_cast<float>(a.hp[3]);
    for_segments(a, [&](idx_t k, idx_t lo, idx_t hi) {
      const float gs = gmul(a, k);
      const G* __restrict gk = grad_at(a, g, k, lo);
      const float umul = a.seg_mul ? a.seg_mul[k] : 1.f;
      (void)umul;
      // d = g * scale (+ wd * p). p is read once per element: a second load(p, i) after a store is not
      // merged with the first (the compiler cannot prove the arrays disjoint through the lambda).
      // One loop body, with the momentum buffer a compile-time choice (MOM): without it the update is d.
      // torch starts the buffer as the gradient itself: keep 0, take 1 on a slot's first update.
      const bool first = a.first && a.first[k];
      const float keep = first ? 0.f : mom, tk = first ? 1.f : take;
      auto run = [&](auto mom_on) {
        constexpr bool MOM = decltype(mom_on)::value;
        streamed(lo, hi, [&](idx_t c0, idx_t c1) {
          idx_t i = c0;
#if APEX_BF16_AVX2_BLOCKS
          if constexpr (kBf16Blocks<P, G, O>) {
            const bf16_avx2::SgdScalars sc{lr, mom, keep, tk, wd, gs, umul};
            i = bf16_avx2::sgd_blocks<L2, NESTEROV, POST, MOM>(p, gk, lo, buf, c0, c1, sc);
          }
#endif
          APEX_IVDEP
          for (; i < c1; ++i) {
            const float pv = load(p, i);
            float d = load(gk, i - lo) * gs;
            if constexpr (L2) d = d + wd * pv;
            float s = d;
            if constexpr (MOM) {
              s = store_load(buf, i, keep * load(buf, i) + tk * d);  // used as stored (as torch does)
              if constexpr (NESTEROV) s = d + mom * s;
            }
            if constexpr (POST == 1) s = s * umul;
            if constexpr (POST == 2) s = s * umul + wd * pv;
            const float np = pv - lr * s;
            store(p, i, np);
            store(o, i, np);
          }
        }, stream(p), stream(gk, lo), MOM ? stream(buf) : Stream{0, 0}, stream(o));
      };
      if (mom == 0.f || !buf) run(std::false_type{});
      else run(std::true_type{});
    });
  });
}

static void sgd(const OptArgs& a) {
  const bool l2 = static_cast<float>(a.hp[3]) != 0.f, nesterov = a.flags & kNesterov;
  if (a.flags & kDecoupled) {
    if (l2) nesterov ? sgd_body<false, true, 2>(a) : sgd_body<false, false, 2>(a);
    else nesterov ? sgd_body<false, true, 1>(a) : sgd_body<false, false, 1>(a);
    return;
  }
  if (l2) nesterov ? sgd_body<true, true, 0>(a) : sgd_body<true, false, 0>(a);
  else nesterov ? sgd_body<false, true, 0>(a) : sgd_body<false, false, 0>(a);
}

// ---------------------------------------------------------------------------
// torch.optim.Adam / AdamW (and NVIDIA's FusedAdam: the same update without bias
// correction when asked). AMSGrad and the weight decay form (WD: kNoDecay, kL2Decay
// g + wd * p, kDecoupledDecay p * (1 - lr * wd)) are template parameters, so there is
// one loop body, no per-call branch inside it, and no decay term when weight_decay
// is 0 (as torch); bias correction is a per-segment scalar (step_size lr when off).
template <bool AMSGRAD, int WD>
static void adam_body(const OptArgs& a) {
  with_pgos(a, [&](auto* pt, auto* gt, auto* ot, auto* st) {
    APEX_TYPES(pt, gt, ot);
    using S = std::remove_pointer_t<decltype(st)>;
    S* __restrict m = static_cast<S*>(a.s[0]);
    S* __restrict v = static_cast<S*>(a.s[1]);
    S* __restrict vmax = static_cast<S*>(a.s[2]);
    (void)vmax;
    const double lr = a.hp[0], b1 = a.hp[1], b2 = a.hp[2];
    const float eps = static_cast<float>(a.hp[3]), wd = static_cast<float>(a.hp[4]);
    const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2);
    const float omb1 = static_cast<float>(1.0 - b1), omb2 = static_cast<float>(1.0 - b2);
    const float decay = static_cast<float>(1.0 - lr * wd);
    (void)decay;
    const auto corrections = adam_corrections(a, !(a.flags & kNoBiasCorrection));
    for_segments(a, [&](idx_t k, idx_t lo, idx_t hi) {
      const std::pair<float, float> bc = corrections(k);
      const float step_size = bc.first, bc2_sqrt = bc.second;
      const float gs = gmul(a, k);
      const G* __restrict gk = grad_at(a, g, k, lo);
      streamed(lo, hi, [&](idx_t c0, idx_t c1) {
        idx_t i = c0;
#if APEX_BF16_AVX2_BLOCKS
        if constexpr (!AMSGRAD && kBf16Blocks<P, G, O> && std::is_same_v<S, bf16_t>) {  // (not FLAG_F32_STATES)
          const bf16_avx2::AdamScalars sc{fb1, fb2, omb1, omb2, eps, step_size, bc2_sqrt, gs, wd, decay};
          i = bf16_avx2::adam_blocks<WD>(p, gk, lo, m, v, c0, c1, sc);  // the rest (a tail, a nan) below
        }
#endif
        APEX_IVDEP
        for (; i < c1; ++i) {
          float pv = load(p, i);
          if constexpr (WD == kDecoupledDecay) pv = pv * decay;
          float gv = load(gk, i - lo) * gs;
          if constexpr (WD == kL2Decay) gv = gv + wd * pv;
          float mv = fb1 * load(m, i) + omb1 * gv;
          float vv = fb2 * load(v, i) + omb2 * gv * gv;
          mv = store_load(m, i, mv);  // the moments as stored
          float vs = store_load(v, i, vv);
          if (AMSGRAD) {
            float vm = load(vmax, i);
            vs = store_load(vmax, i, vs > vm ? vs : vm);
          }
          float denom = std::sqrt(vs) / bc2_sqrt + eps;
          float np = pv - step_size * mv / denom;
          store(p, i, np);
          store(o, i, np);
        }
      }, stream(p), stream(gk, lo), stream(m), stream(v), AMSGRAD ? stream(vmax) : Stream{0, 0}, stream(o));
    });
  });
}

// As torch, decay terms exist only when weight_decay != 0: a 0 * inf L2 term would turn an inf param into NaN.
template <bool AMSGRAD>
static void adam_decay(const OptArgs& a) {
  if (a.hp[4] == 0.0) adam_body<AMSGRAD, kNoDecay>(a);
  else if (a.flags & kDecoupled) adam_body<AMSGRAD, kDecoupledDecay>(a);
  else adam_body<AMSGRAD, kL2Decay>(a);
}
static void adam(const OptArgs& a) { (a.flags & kAmsgrad) ? adam_decay<true>(a) : adam_decay<false>(a); }

// ---------------------------------------------------------------------------
static void adadelta(const OptArgs& a) {
  with_pgo(a, [&](auto* pt, auto* gt, auto* ot) {
    APEX_TYPES(pt, gt, ot);
    P* __restrict sq = static_cast<P*>(a.s[0]);
    P* __restrict acc = static_cast<P*>(a.s[1]);
    const float lr = static_cast<float>(a.hp[0]), rho = static_cast<float>(a.hp[1]);
    const float eps = static_cast<float>(a.hp[2]), wd = static_cast<float>(a.hp[3]);
    const float omr = static_cast<float>(1.0 - a.hp[1]);
    const bool decay = a.hp[3] != 0.0;
    for_segments(a, [&](idx_t k, idx_t lo, idx_t hi) {
      const float gs = gmul(a, k);
      const G* __restrict gk = grad_at(a, g, k, lo);
      streamed(lo, hi, [&](idx_t c0, idx_t c1) {
        idx_t i = c0;
#if APEX_BF16_AVX2_BLOCKS
        if constexpr (kBf16Blocks<P, G, O>) {
          const bf16_avx2::AdadeltaScalars sc{lr, rho, omr, eps, wd, gs, decay};
          i = bf16_avx2::adadelta_blocks(p, gk, lo, sq, acc, c0, c1, sc);
        }
#endif
        APEX_IVDEP
        for (; i < c1; ++i) {
          float pv = load(p, i);
          float gv = load(gk, i - lo) * gs;
          gv = pick_f32(decay, gv + wd * pv, gv);  // no term at weight_decay 0 (0 * inf = NaN)
          float stdv = std::sqrt(store_load(sq, i, rho * load(sq, i) + omr * gv * gv) + eps);
          float delta = std::sqrt(load(acc, i) + eps) / stdv * gv;
          store(acc, i, rho * load(acc, i) + omr * delta * delta);
          float np = pv - lr * delta;
          store(p, i, np);
          store(o, i, np);
        }
      }, stream(p), stream(gk, lo), stream(sq), stream(acc), stream(o));
    });
  });
}

// ---------------------------------------------------------------------------
// torch.optim.RMSprop (tf=false) and the TensorFlow/timm variant (tf=true):
// TF puts eps inside the sqrt, updates the averages as v += (1-a)(g^2 - v),
// and can fold lr into the momentum buffer. The options are template
// parameters, not tests in the loop: a conditional store (centered, momentum)
// keeps the compiler from vectorising the loop at all, which measured 4x slower.

template <bool TF, bool CENTERED, int MOM>
static void rmsprop_body(const OptArgs& a) {
  with_pgo(a, [&](auto* pt, auto* gt, auto* ot) {
    APEX_TYPES(pt, gt, ot);
    P* __restrict sq = static_cast<P*>(a.s[0]);
    P* __restrict buf = static_cast<P*>(a.s[1]);
    P* __restrict gavg = static_cast<P*>(a.s[2]);
    const float lr = static_cast<float>(a.hp[0]), alpha = static_cast<float>(a.hp[1]);
    const float eps = static_cast<float>(a.hp[2]), wd = static_cast<float>(a.hp[3]);
    const float mom = static_cast<float>(a.hp[4]);
    const bool decoupled = TF && (a.flags & kDecoupled);
    const float wd_decay = decoupled ? wd : 0.f, wd_l2 = decoupled ? 0.f : wd;
    const bool decay_on = decoupled && a.hp[3] != 0.0, l2_on = !decoupled && a.hp[3] != 0.0;
    const float one_minus = static_cast<float>(1.0 - a.hp[1]);
    for_segments(a, [&](idx_t k, idx_t lo, idx_t hi) {
      const float gs = gmul(a, k);
      const G* __restrict gk = grad_at(a, g, k, lo);
      streamed(lo, hi, [&](idx_t c0, idx_t c1) {
        idx_t i = c0;
#if APEX_BF16_AVX2_BLOCKS
        if constexpr (kBf16Blocks<P, G, O>) {
          const bf16_avx2::RmspropScalars sc{lr, alpha, one_minus, eps, mom, wd_decay, wd_l2, gs, decay_on, l2_on};
          i = bf16_avx2::rmsprop_blocks<TF, CENTERED, MOM>(p, gk, lo, sq, buf, gavg, c0, c1, sc);
        }
#endif
        APEX_IVDEP
        for (; i < c1; ++i) {
          float pv = load(p, i);
          // the decay terms only when weight_decay != 0 (0 * inf = NaN), the other arm selected bit for bit
          if (TF) pv = pick_f32(decay_on, pv - wd_decay * pv, pv);
          float gv = load(gk, i - lo) * gs;
          gv = pick_f32(l2_on, gv + wd_l2 * pv, gv);
          float s = load(sq, i);
          float sv = store_load(sq, i, TF ? s + one_minus * (gv * gv - s) : alpha * s + one_minus * gv * gv);
          if (CENTERED) {
            float ga = load(gavg, i);
            ga = store_load(gavg, i, ga + one_minus * (gv - ga));
            // The variance is >= 0 in exact math; rounding (or a low-precision
            // square_avg flushing to zero) can make it slightly negative, and
            // sqrt would turn that into NaN. max() keeps a NaN input NaN.
            sv = std::max(sv - ga * ga, 0.f);
          }
          const float avg = TF ? std::sqrt(sv + eps) : std::sqrt(sv) + eps;
          float np;
          if (MOM == kMomLr) {
            np = pv - store_load(buf, i, mom * load(buf, i) + lr * gv / avg);
          } else if (MOM == kMom) {
            np = pv - lr * store_load(buf, i, mom * load(buf, i) + gv / avg);
          } else {
            np = pv - lr * gv / avg;
          }
          store(p, i, np);
          store(o, i, np);
        }
      }, stream(p), stream(gk, lo), stream(sq), CENTERED ? stream(gavg) : Stream{0, 0},
               MOM != kNoMom ? stream(buf) : Stream{0, 0}, stream(o));
    });
  });
}

template <bool TF>
static void rmsprop_impl(const OptArgs& a) {
  const bool centered = a.flags & kCentered;
  const int mom = static_cast<float>(a.hp[4]) > 0.f ? (TF && (a.flags & kLrInMomentum) ? kMomLr : kMom) : kNoMom;
  if (centered) {
    if (mom == kMomLr) rmsprop_body<TF, true, kMomLr>(a);
    else if (mom == kMom) rmsprop_body<TF, true, kMom>(a);
    else rmsprop_body<TF, true, kNoMom>(a);
  } else {
    if (mom == kMomLr) rmsprop_body<TF, false, kMomLr>(a);
    else if (mom == kMom) rmsprop_body<TF, false, kMom>(a);
    else rmsprop_body<TF, false, kNoMom>(a);
  }
}
static void rmsprop(const OptArgs& a) { rmsprop_impl<false>(a); }
static void rmsprop_tf(const OptArgs& a) { rmsprop_impl<true>(a); }

// ---------------------------------------------------------------------------
static void bert_adam(const OptArgs& a) {
  with_pgo(a, [&](auto* pt, auto* gt, auto* ot) {
    APEX_TYPES(pt, gt, ot);
    P* __restrict m = static_cast<P*>(a.s[0]);
    P* __restrict v = static_cast<P*>(a.s[1]);
    const float lr = static_cast<float>(a.hp[0]), b1 = static_cast<float>(a.hp[1]);
    const float b2 = static_cast<float>(a.hp[2]), eps = static_cast<float>(a.hp[3]);
    const float wd = static_cast<float>(a.hp[4]);
    const float omb1 = static_cast<float>(1.0 - a.hp[1]), omb2 = static_cast<float>(1.0 - a.hp[2]);
    const bool decay = a.hp[4] != 0.0;
    for_segments(a, [&](idx_t k, idx_t lo, idx_t hi) {
      const float gs = gmul(a, k);
      const G* __restrict gk = grad_at(a, g, k, lo);
      streamed(lo, hi, [&](idx_t c0, idx_t c1) {
        idx_t i = c0;
#if APEX_BF16_AVX2_BLOCKS
        if constexpr (kBf16Blocks<P, G, O>) {
          const bf16_avx2::BertAdamScalars sc{lr, b1, b2, omb1, omb2, eps, wd, gs, decay};
          i = bf16_avx2::bert_adam_blocks(p, gk, lo, m, v, c0, c1, sc);
        }
#endif
        APEX_IVDEP
        for (; i < c1; ++i) {
          float pv = load(p, i);
          float gv = load(gk, i - lo) * gs;
          float mv = store_load(m, i, b1 * load(m, i) + omb1 * gv);
          float vv = store_load(v, i, b2 * load(v, i) + omb2 * gv * gv);
          float u = mv / (std::sqrt(vv) + eps);
          u = pick_f32(decay, u + wd * pv, u);  // no term at weight_decay 0 (0 * inf = NaN)
          float np = pv - lr * u;
          store(p, i, np);
          store(o, i, np);
        }
      }, stream(p), stream(gk, lo), stream(m), stream(v), stream(o));
    });
  });
}

// ---------------------------------------------------------------------------
// Per-segment reductions with a fixed chunking (thread-count independent):
// fn(k, lo, hi, double* acc) accumulates N values for one chunk of segment k.
template <int N, class F>
static void segment_reduce(const OptArgs& a, double* out, F&& fn) {
  for (idx_t k = 0; k < a.nseg * N; ++k) out[k] = 0.0;
  if (a.nseg <= 0) return;
  std::vector<idx_t> seg, lo, hi;
  for (idx_t k = 0; k < a.nseg; ++k) {
    if (a.skip && a.skip[k]) continue;
    const idx_t end = seg_end(a, k);
    for (idx_t b = a.seg[k]; b < end; b += kChunk) {
      seg.push_back(k);
      lo.push_back(b);
      hi.push_back(b + kChunk < end ? b + kChunk : end);
    }
  }
  const idx_t items = static_cast<idx_t>(seg.size());
  std::vector<double> part(static_cast<std::size_t>(items) * N, 0.0);
  parallel_items(items, a.seg[a.nseg] - a.seg[0], a.threads, [&](idx_t b, idx_t e) {
    for (idx_t i = b; i < e; ++i) fn(seg[i], lo[i], hi[i], &part[static_cast<std::size_t>(i) * N]);
  });
  for (idx_t i = 0; i < items; ++i)
    for (int j = 0; j < N; ++j) out[seg[i] * N + j] += part[static_cast<std::size_t>(i) * N + j];
}

constexpr int kL = 8;  // independent accumulators per reduced value

template <int N>
struct LaneAcc {
  double v[N][kL] = {};
  void fold(double* out) const {
    for (int j = 0; j < N; ++j) {
      double s = 0.0;
      for (int l = 0; l < kL; ++l) s += v[j][l];
      out[j] += s;
    }
  }
};

// Multipliers turning LAMB's moments into bias-corrected estimates (1 without kBiasCorrection).
struct LambBC {
  float m, v;
};

inline auto lamb_bcs(const OptArgs& a, double b1, double b2) {
  const bool on = (a.flags & kBiasCorrection) && a.steps;
  return by_step_count(a, [=](double t) {
    if (!on) return LambBC{1.f, 1.f};
    return LambBC{static_cast<float>(1.0 / (1.0 - std::pow(b1, t))), static_cast<float>(1.0 / (1.0 - std::pow(b2, t)))};
  });
}

static void lamb_stage1(const OptArgs& a) {
  with_pgo(a, [&](auto* pt, auto* gt, auto* ot) {
    APEX_TYPES(pt, gt, ot);
    P* __restrict m = static_cast<P*>(a.s[0]);
    P* __restrict v = static_cast<P*>(a.s[1]);
    const float b1 = static_cast<float>(a.hp[0]), b2 = static_cast<float>(a.hp[1]);
    const float eps = static_cast<float>(a.hp[2]), wd = static_cast<float>(a.hp[3]);
    const float b3 = static_cast<float>((a.flags & kBeta3) ? a.hp[4] : 1.0 - a.hp[0]);
    const float omb2 = static_cast<float>(1.0 - a.hp[1]);
    const auto bcs = lamb_bcs(a, a.hp[0], a.hp[1]);
    segment_reduce<2>(a, a.seg_out, [&](idx_t k, idx_t lo, idx_t hi, double* out) {
      const float gs = gmul(a, k);
      const G* __restrict gk = grad_at(a, g, k, lo);
      const LambBC bc = bcs(k);
      // Chunks of kChunk: the update (sqrt, divide) runs as one plain float loop the compiler vectorises, then
      // one loop per array adds its squares into kLanes double lanes (element i of the segment into lane
      // (i - lo) % kLanes), folded in lane order at the end: the same order at every SIMD level.
      // Accumulating inside the element loop kept it scalar (2.3x slower); a 16-element block with both loops
      // fully unrolled became lane shuffles in the 16-bit instantiations (bf16 2x slower than fp32); one
      // squares loop over both arrays was split into 8+4+2+1+1-wide pieces; 32 or 64 lanes (more independent
      // add chains) made the fp32 stage 1.8-2.5x slower (GCC, avx512, 32M elements, 1 thread). Chunk length per
      // storage width (any multiple of kLanes gives the same sums): fp32 64, 16-bit 512. Measured over 64-2048
      // on Zen 4 with clang and GCC: fp32 was slowest at 512 (16M elements, GCC: 7.9 -> 6.3 ms on 2 threads,
      // 11.9 -> 7.8 ms on 1); the 16-bit loops, which prefetch in software, were fastest at 512, 15-20% slower
      // at 64.
      constexpr int kLanes = 16, kChunk = sizeof(P) == 4 ? 64 : 512;
      // Local copies: through the captures the compiler reloads every scalar after each store to pb / ub.
      const float cb1 = b1, cb2 = b2, cb3 = b3, comb2 = omb2, ceps = eps, cwd = wd, cm = bc.m, cv = bc.v;
      const bool cdecay = a.hp[3] != 0.0;
      double pp[kLanes] = {}, uu[kLanes] = {};
      float pb[kChunk], ub[kChunk];
      for (idx_t base = lo; base < hi; base += kChunk) {
        const int n = static_cast<int>(std::min<idx_t>(kChunk, hi - base));
        streamed(base, base + n, [&](idx_t c0, idx_t c1) {
          APEX_IVDEP
          for (idx_t j = c0; j < c1; ++j) {
            const idx_t l = j - base;
            const float pv = load(p, j);
            const float gv = load(gk, j - lo) * gs;
            // u from the moments as stored (store_load: no reload from memory)
            const float mv = store_load(m, j, cb1 * load(m, j) + cb3 * gv);
            const float vv = store_load(v, j, cb2 * load(v, j) + comb2 * gv * gv);
            pb[l] = pv;
            const float u = mv * cm / (std::sqrt(vv * cv) + ceps);
            ub[l] = pick_f32(cdecay, u + cwd * pv, u);  // no term at weight_decay 0 (0 * inf = NaN)
          }
        }, stream(p), stream(gk, lo), stream(m), stream(v));
        const int full = n - n % kLanes;
        for (int l0 = 0; l0 < full; l0 += kLanes)
          for (int l = 0; l < kLanes; ++l) pp[l] += static_cast<double>(pb[l0 + l]) * pb[l0 + l];
        for (int l0 = 0; l0 < full; l0 += kLanes)
          for (int l = 0; l < kLanes; ++l) uu[l] += static_cast<double>(ub[l0 + l]) * ub[l0 + l];
        for (int l = 0; full + l < n; ++l) {
          pp[l] += static_cast<double>(pb[full + l]) * pb[full + l];
          uu[l] += static_cast<double>(ub[full + l]) * ub[full + l];
        }
      }
      double sp = 0.0, su = 0.0;
      for (int l = 0; l < kLanes; ++l) {
        sp += pp[l];
        su += uu[l];
      }
      out[0] += sp;
      out[1] += su;
    });
  });
}

static void lamb_stage2(const OptArgs& a) {
  with_pgo(a, [&](auto* pt, auto* gt, auto* ot) {
    APEX_TYPES(pt, gt, ot);
    const P* __restrict m = static_cast<const P*>(a.s[0]);
    const P* __restrict v = static_cast<const P*>(a.s[1]);
    const float lr = static_cast<float>(a.hp[0]), eps = static_cast<float>(a.hp[1]);
    const float wd = static_cast<float>(a.hp[2]);
    const bool decay = a.hp[2] != 0.0;
    const auto bcs = lamb_bcs(a, a.hp[3], a.hp[4]);
    for_segments(a, [&](idx_t k, idx_t lo, idx_t hi) {
      const float step = lr * (a.seg_mul ? a.seg_mul[k] : 1.f);
      const LambBC bc = bcs(k);
      streamed(lo, hi, [&](idx_t c0, idx_t c1) {
        idx_t i = c0;
#if APEX_BF16_AVX2_BLOCKS
        if constexpr (kBf16Blocks<P, P, O>) {  // (stage 2 reads no grad)
          const bf16_avx2::LambStage2Scalars sc{step, bc.m, bc.v, eps, wd, decay};
          i = bf16_avx2::lamb_stage2_blocks(p, m, v, c0, c1, sc);
        }
#endif
        APEX_IVDEP
        for (; i < c1; ++i) {
          float pv = load(p, i);
          float u = load(m, i) * bc.m / (std::sqrt(load(v, i) * bc.v) + eps);
          u = pick_f32(decay, u + wd * pv, u);  // no term at weight_decay 0 (0 * inf = NaN)
          float np = pv - step * u;
          store(p, i, np);
          store(o, i, np);
        }
      }, stream(p), stream(m), stream(v), stream(o));
    });
  });
}

// Both LAMB stages with the trust ratios between them (see OptimKernels::lamb). Measured against stage 1 and
// stage 2 as two calls with the ratios formed by torch ops: the same bits, 2-6% less time per step (no torch
// ops in between). Running the stages block by block, so that stage 2 would re-read p, m and v from the caches
// stage 1 left them in, measured 15% slower on the 145-tensor model (2 threads, Zen 4): no gain to keep.
static void lamb(const OptArgs& a) {
  if (a.nseg <= 0) return;
  OptArgs s1 = a, s2 = a;
  for (int i = 0; i < 12; ++i) {
    s1.hp[i] = i < 5 ? a.hp[i] : 0.0;
    s2.hp[i] = i < 5 ? a.hp[5 + i] : 0.0;
  }
  s1.seg_mul = nullptr;
  s2.seg_out = nullptr;
  lamb_stage1(s1);
  if (a.flags & kTrustRatio) {
    float* ratio = const_cast<float*>(a.seg_mul);  // an output here (see OptimKernels::lamb)
    const bool clamp = (a.flags & kClampWeightNorm) != 0;
    for (idx_t k = 0; k < a.nseg; ++k) {
      double w = std::sqrt(a.seg_out[2 * k]);
      const double u = std::sqrt(a.seg_out[2 * k + 1]);
      if (clamp && w > a.hp[10]) w = a.hp[10];  // a NaN norm stays NaN (as torch's clamp)
      ratio[k] = (w == 0.0 || u == 0.0) ? 1.f : static_cast<float>(w / u);
    }
  } else {
    s2.seg_mul = nullptr;
  }
  lamb_stage2(s2);
}

// ---------------------------------------------------------------------------
static void row_dots(const OptArgs& a) {
  with_pgo(a, [&](auto* pt, auto* gt, auto* ot) {
    APEX_TYPES(pt, gt, ot);
    segment_reduce<3>(a, a.seg_out, [&](idx_t k, idx_t lo, idx_t hi, double* out) {
      const float gs = gmul(a, k);
      const G* __restrict gk = grad_at(a, g, k, lo);
      LaneAcc<3> acc;
      auto body = [&](idx_t j, int l) {
        double gv = static_cast<double>(load(gk, j - lo) * gs), pv = load(p, j);
        acc.v[0][l] += gv * pv;
        acc.v[1][l] += gv * gv;
        acc.v[2][l] += pv * pv;
      };
      streamed_lanes<kL>(lo, hi, body, stream(gk, lo), stream(p));
      acc.fold(out);
    });
  });
}

// Per-segment sums of squared grads, read through grad_at (flat buffer or gather table), in double; skipped
// segments get 0. One code path for both grad sources, so a per-tensor norm (BertAdam's clipping) is the same
// bits whether the grads were copied into the flat buffer or are read where autograd left them.
static void grad_sum_sq(const OptArgs& a) {
  with_pgo(a, [&](auto* pt, auto* gt, auto* ot) {
    APEX_TYPES(pt, gt, ot);
    segment_reduce<1>(a, a.seg_out, [&](idx_t k, idx_t lo, idx_t hi, double* out) {
      const G* __restrict gk = grad_at(a, g, k, lo);
      LaneAcc<1> acc;
      auto body = [&](idx_t j, int l) {
        const double gv = load(gk, j - lo);
        acc.v[0][l] += gv * gv;
      };
      streamed_lanes<kL>(lo, hi, body, stream(gk, lo));
      acc.fold(out);
    });
  });
}

// AdamP's per-element perturbation from the updated moments.
struct AdamPScalars {
  float b1, b2, omb1, omb2, eps, step_size, bc2_sqrt, gs;
  bool nesterov;
};

template <class C>
inline AdamPScalars adamp_scalars(const OptArgs& a, idx_t k, const C& corrections) {
  const std::pair<float, float> bc = corrections(k);
  AdamPScalars s;
  s.b1 = static_cast<float>(a.hp[1]);
  s.b2 = static_cast<float>(a.hp[2]);
  s.omb1 = static_cast<float>(1.0 - a.hp[1]);
  s.omb2 = static_cast<float>(1.0 - a.hp[2]);
  s.eps = static_cast<float>(a.hp[3]);
  s.step_size = bc.first;
  s.bc2_sqrt = bc.second;
  s.gs = gmul(a, k);
  s.nesterov = a.flags & kNesterov;
  return s;
}

static void adamp_stage_a(const OptArgs& a) {
  with_pgo(a, [&](auto* pt, auto* gt, auto* ot) {
    APEX_TYPES(pt, gt, ot);
    const P* __restrict m = static_cast<const P*>(a.s[0]);
    const P* __restrict v = static_cast<const P*>(a.s[1]);
    const auto corrections = adam_corrections(a, true);
    segment_reduce<1>(a, a.seg_out, [&](idx_t k, idx_t lo, idx_t hi, double* out) {
      const float pn = a.seg_mul[k];
      if (pn == 0.f) return;
      const AdamPScalars s = adamp_scalars(a, k, corrections);
      const G* __restrict gk = grad_at(a, g, k, lo);
      LaneAcc<1> acc;
      auto body = [&](idx_t j, int l) {
        float gv = load(gk, j - lo) * s.gs;
        // round the moments through the storage dtype, as stage B stores them
        P mt, vt;
        store(&mt, 0, s.b1 * load(m, j) + s.omb1 * gv);
        store(&vt, 0, s.b2 * load(v, j) + s.omb2 * gv * gv);
        float mv = load(&mt, 0), vv = load(&vt, 0);
        float denom = std::sqrt(vv) / s.bc2_sqrt + s.eps;
        float pert = (s.nesterov ? s.b1 * mv + s.omb1 * gv : mv) / denom;
        acc.v[0][l] += static_cast<double>(load(p, j) * pn) * pert;
      };
      streamed_lanes<kL>(lo, hi, body, stream(gk, lo), stream(m), stream(v), stream(p));
      acc.fold(out);
    });
  });
}

static void adamp_stage_b(const OptArgs& a) {
  with_pgo(a, [&](auto* pt, auto* gt, auto* ot) {
    APEX_TYPES(pt, gt, ot);
    P* __restrict m = static_cast<P*>(a.s[0]);
    P* __restrict v = static_cast<P*>(a.s[1]);
    const double lr = a.hp[0], wd = a.hp[4];
    const auto corrections = adam_corrections(a, true);
    for_segments(a, [&](idx_t k, idx_t lo, idx_t hi) {
      const AdamPScalars s = adamp_scalars(a, k, corrections);
      const G* __restrict gk = grad_at(a, g, k, lo);
      const float pn = a.seg_mul ? a.seg_mul[k] : 0.f;
      const float coef = (pn != 0.f && a.seg_out) ? static_cast<float>(a.seg_out[k]) : 0.f;
      const float wdr = a.seg_aux ? a.seg_aux[k] : 1.f;
      const float decay = static_cast<float>(1.0 - lr * wd * wdr);
      streamed(lo, hi, [&](idx_t c0, idx_t c1) {
        APEX_IVDEP
        for (idx_t i = c0; i < c1; ++i) {
          float gv = load(gk, i - lo) * s.gs;
          float mv = store_load(m, i, s.b1 * load(m, i) + s.omb1 * gv);
          float vv = store_load(v, i, s.b2 * load(v, i) + s.omb2 * gv * gv);
          float denom = std::sqrt(vv) / s.bc2_sqrt + s.eps;
          float pert = pick_f32(s.nesterov, s.b1 * mv + s.omb1 * gv, mv) / denom;
          float pv = load(p, i);
          pert -= pv * pn * coef;
          float np = pv * decay - s.step_size * pert;
          store(p, i, np);
          store(o, i, np);
        }
      }, stream(p), stream(gk, lo), stream(m), stream(v), stream(o));
    });
  });
}

// ---------------------------------------------------------------------------
static void adagrad(const OptArgs& a) {
  with_pgo(a, [&](auto* pt, auto* gt, auto* ot) {
    APEX_TYPES(pt, gt, ot);
    P* __restrict sum = static_cast<P*>(a.s[0]);
    const double lr = a.hp[0], lr_decay = a.hp[3];
    const float eps = static_cast<float>(a.hp[1]), wd = static_cast<float>(a.hp[2]);
    const bool wmode = a.flags & kDecoupled;
    const bool l2_on = !wmode && a.hp[2] != 0.0, decay_on = wmode && a.hp[2] != 0.0;
    for_segments(a, [&](idx_t k, idx_t lo, idx_t hi) {
      const float clr = static_cast<float>(lr / (1.0 + (a.steps[k] - 1.0) * lr_decay));
      const float gs = gmul(a, k);
      const G* __restrict gk = grad_at(a, g, k, lo);
      streamed(lo, hi, [&](idx_t c0, idx_t c1) {
        idx_t i = c0;
#if APEX_BF16_AVX2_BLOCKS
        if constexpr (kBf16Blocks<P, G, O>) {
          const bf16_avx2::AdagradScalars sc{clr, eps, wd, gs, l2_on, decay_on};
          i = bf16_avx2::adagrad_blocks(p, gk, lo, sum, c0, c1, sc);
        }
#endif
        APEX_IVDEP
        for (; i < c1; ++i) {
          float pv = load(p, i);
          // the decay term (added to the grad, or to the update in wmode) only when weight_decay != 0
          float gv = load(gk, i - lo) * gs;
          gv = pick_f32(l2_on, gv + wd * pv, gv);
          float sv = store_load(sum, i, load(sum, i) + gv * gv);
          float u = gv / (std::sqrt(sv) + eps);
          u = pick_f32(decay_on, u + wd * pv, u);
          float np = pv - clr * u;
          store(p, i, np);
          store(o, i, np);
        }
      }, stream(p), stream(gk, lo), stream(sum), stream(o));
    });
  });
}

// ---------------------------------------------------------------------------
// x *= scale over separate buffers (grads left where autograd put them). Threads split the
// concatenated element range, as if the buffers were one flat buffer, so many small buffers
// cost one call and large ones still use every thread.
static bool scale_gather(const std::uintptr_t* addr, const idx_t* numel, idx_t n, int dt, float scale, bool check,
                         int threads) {
  if (n <= 0) return false;
  std::vector<idx_t> off(static_cast<std::size_t>(n) + 1, 0);
  for (idx_t j = 0; j < n; ++j) off[j + 1] = off[j] + numel[j];
  const idx_t total = off[n];
  bool found = false;
  with_type(dt, [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    std::atomic_bool any{false};
    parallel_for(total, threads, [&](idx_t b, idx_t e) {
      // first buffer whose end is past b (empty buffers are passed over)
      idx_t j = static_cast<idx_t>(std::upper_bound(off.begin(), off.end(), b) - off.begin()) - 1;
      bool bad = false;
      for (; j < n && off[j] < e; ++j) {
        const idx_t lo = std::max(off[j], b), hi = std::min(off[j + 1], e);
        if (lo >= hi) continue;
        T* x = reinterpret_cast<T*>(addr[j]) + (lo - off[j]);
        if (scale == 1.f) bad |= check && nonfinite_range(x, hi - lo);
        else bad |= scale_inplace_range(x, hi - lo, scale, check);
      }
      if (bad) any.store(true, std::memory_order_relaxed);
    });
    found = any.load();
  });
  return found;
}

static const OptimKernels optim_table = {
    sgd, adam, adadelta, rmsprop, rmsprop_tf, bert_adam, lamb_stage1, lamb_stage2, lamb, row_dots, adamp_stage_a,
    adamp_stage_b, adagrad, scale_gather, grad_sum_sq,
};

#undef APEX_TYPES

}  // namespace APEX_SIMD_NS
}  // namespace apexc
