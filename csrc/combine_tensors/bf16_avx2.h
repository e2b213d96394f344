// bf16 optimizer blocks written with AVX2 intrinsics, for the avx2 level only: Adam / AdamW, SGD, Adadelta, RMSprop,
// BertAdam, Adagrad and LAMB's stage 2 with bf16 params, grads and states.
//
// Without AVX-512 the bf16 loops are bound by instruction count, not memory: the compiler widens each bf16 load
// with a zero-extension and a shift, narrows each store with a cross-lane permute after the pack, and gives every
// rounded store the nan rule's compare and select. Here 16 values go through two registers in "unpack order"
// (elements 0-3 and 8-11 in one, 4-7 and 12-15 in the other): an unpack with zero widens them (the bf16 bits land
// in the top half of each 32-bit lane), and an in-lane pack of the two rounded halves restores memory order, so
// neither direction needs a shift-and-permute. The nan rule is checked once per block instead of per store: a
// block where any value to store (a state or the new param) is a nan is left, with nothing written, to the
// caller's element loop, which applies the rule.
//
// Each block function is its kernel's element loop written over V16 values, operation by operation and in the same
// order (no fma: -ffp-contract=off everywhere), and the rounding is common.h's round to nearest even without the
// nan arm, so the bits are the element loop's; the tests compare this level with the baseline bitwise
// (tests/kernels/test_conversions.py). Each returns where it stopped: `end` rounded down to a block, or the first
// block with a nan to store. `g` is the slot's grad at element `lo` (flat or gathered), as the element loops read it.
#pragma once

#include <immintrin.h>

#include "common.h"
#include "optim.h"

namespace apexc {
namespace bf16_avx2 {

// 16 fp32 values in unpack order, and the same 16 rounded to bf16 (kept in the top half of each 32-bit lane)
struct V16 {
  __m256 lo, hi;
};
struct R16 {
  __m256i lo, hi;
};

APEX_ELEMENT V16 splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
APEX_ELEMENT V16 operator+(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
APEX_ELEMENT V16 operator-(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
APEX_ELEMENT V16 operator*(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
APEX_ELEMENT V16 operator/(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
APEX_ELEMENT V16 sqrt(V16 a) { return {_mm256_sqrt_ps(a.lo), _mm256_sqrt_ps(a.hi)}; }
// std::max(a, b), which is (a < b) ? b : a: a nan `a` is kept
APEX_ELEMENT V16 max(V16 a, V16 b) { return {_mm256_max_ps(b.lo, a.lo), _mm256_max_ps(b.hi, a.hi)}; }

// 16 bf16 values -> fp32 in unpack order
APEX_ELEMENT V16 load16(const bf16_t* src) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i zero = _mm256_setzero_si256();
  return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x))};
}

// f32_to_bf16's round to nearest even for a non-nan lane, result in the top half of the 32-bit lane:
// u + 0x7fff, or + 0x8000 when the kept part is odd (the compare gives -1 where it is even)
APEX_ELEMENT __m256i round_keep_top(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i even = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x10000)), _mm256_setzero_si256());
  return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x8000)), even);
}
APEX_ELEMENT R16 round16(V16 v) { return {round_keep_top(v.lo), round_keep_top(v.hi)}; }

// the stored value read back as fp32 (bf16_to_f32 of the stored half), as store_load returns it
APEX_ELEMENT __m256 stored_value(__m256i r) {
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
APEX_ELEMENT V16 stored(R16 r) { return {stored_value(r.lo), stored_value(r.hi)}; }

// rounded values in unpack order -> 16 bf16 values in memory order
APEX_ELEMENT void store16(bf16_t* dst, R16 r) {
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(r.lo, 16), _mm256_srli_epi32(r.hi, 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
}

// The nan test of a block: one unordered compare covers a V16's two halves, `either` joins two such masks, and
// `any` is true when a lane is set.
APEX_ELEMENT __m256 unordered(V16 a) { return _mm256_cmp_ps(a.lo, a.hi, _CMP_UNORD_Q); }
APEX_ELEMENT __m256 either(__m256 a, __m256 b) { return _mm256_or_ps(a, b); }
APEX_ELEMENT bool any(__m256 mask) { return __builtin_expect(!_mm256_testz_ps(mask, mask), 0); }

// ---------------------------------------------------------------------------------------------------------------
// Adam / AdamW: adam_body's element loop, no AMSGrad; WD its decay form (AdamDecay).
struct AdamScalars {
  float b1, b2, omb1, omb2, eps, step_size, bc2_sqrt, gs, wd, decay;
};

template <int WD>
APEX_ELEMENT idx_t adam_blocks(bf16_t* __restrict p, const bf16_t* __restrict g, idx_t lo, bf16_t* __restrict m,
                               bf16_t* __restrict v, idx_t i, idx_t end, const AdamScalars& c) {
  const V16 b1 = splat(c.b1), b2 = splat(c.b2), omb1 = splat(c.omb1), omb2 = splat(c.omb2), eps = splat(c.eps);
  const V16 step_size = splat(c.step_size), bc2_sqrt = splat(c.bc2_sqrt), gs = splat(c.gs);
  const V16 wd = splat(c.wd), decay = splat(c.decay);
  (void)wd;
  (void)decay;
  for (; end - i >= 16; i += 16) {
    V16 pv = load16(p + i);
    if constexpr (WD == kDecoupledDecay) pv = pv * decay;
    V16 gv = load16(g + (i - lo)) * gs;
    if constexpr (WD == kL2Decay) gv = gv + wd * pv;
    const V16 mv = b1 * load16(m + i) + omb1 * gv;
    const V16 vv = b2 * load16(v + i) + omb2 * gv * gv;
    const R16 rm = round16(mv), rv = round16(vv);
    const V16 denom = sqrt(stored(rv)) / bc2_sqrt + eps;
    const V16 np = pv - step_size * stored(rm) / denom;
    if (any(either(either(unordered(mv), unordered(vv)), unordered(np)))) return i;
    store16(m + i, rm);
    store16(v + i, rv);
    store16(p + i, round16(np));
  }
  return i;
}

// ---------------------------------------------------------------------------------------------------------------
// SGD: sgd_body's element loop. MOM: with the momentum buffer (keep / tk: its first-update factors).
struct SgdScalars {
  float lr, mom, keep, tk, wd, gs, umul;
};

template <bool L2, bool NESTEROV, int POST, bool MOM>
APEX_ELEMENT idx_t sgd_blocks(bf16_t* __restrict p, const bf16_t* __restrict g, idx_t lo, bf16_t* __restrict buf,
                              idx_t i, idx_t end, const SgdScalars& c) {
  const V16 lr = splat(c.lr), mom = splat(c.mom), keep = splat(c.keep), tk = splat(c.tk), wd = splat(c.wd);
  const V16 gs = splat(c.gs), umul = splat(c.umul);
  (void)mom;
  (void)keep;
  (void)tk;
  (void)wd;
  (void)umul;
  for (; end - i >= 16; i += 16) {
    const V16 pv = load16(p + i);
    V16 d = load16(g + (i - lo)) * gs;
    if constexpr (L2) d = d + wd * pv;
    V16 s = d;
    R16 rb{};
    __m256 nan = _mm256_setzero_ps();
    if constexpr (MOM) {
      const V16 nb = keep * load16(buf + i) + tk * d;
      rb = round16(nb);
      nan = unordered(nb);
      s = stored(rb);
      if constexpr (NESTEROV) s = d + mom * s;
    }
    if constexpr (POST == 1) s = s * umul;
    if constexpr (POST == 2) s = s * umul + wd * pv;
    const V16 np = pv - lr * s;
    if (any(either(nan, unordered(np)))) return i;
    if constexpr (MOM) store16(buf + i, rb);
    store16(p + i, round16(np));
  }
  return i;
}

// ---------------------------------------------------------------------------------------------------------------
// Adadelta: adadelta's element loop (decay: weight_decay != 0).
struct AdadeltaScalars {
  float lr, rho, omr, eps, wd, gs;
  bool decay;
};

APEX_ELEMENT idx_t adadelta_blocks(bf16_t* __restrict p, const bf16_t* __restrict g, idx_t lo, bf16_t* __restrict sq,
                                   bf16_t* __restrict acc, idx_t i, idx_t end, const AdadeltaScalars& c) {
  const V16 lr = splat(c.lr), rho = splat(c.rho), omr = splat(c.omr), eps = splat(c.eps), wd = splat(c.wd);
  const V16 gs = splat(c.gs);
  for (; end - i >= 16; i += 16) {
    const V16 pv = load16(p + i);
    V16 gv = load16(g + (i - lo)) * gs;
    if (c.decay) gv = gv + wd * pv;
    const V16 nsq = rho * load16(sq + i) + omr * gv * gv;
    const R16 rsq = round16(nsq);
    const V16 stdv = sqrt(stored(rsq) + eps);
    const V16 av = load16(acc + i);
    const V16 delta = sqrt(av + eps) / stdv * gv;
    const V16 nacc = rho * av + omr * delta * delta;
    const V16 np = pv - lr * delta;
    if (any(either(either(unordered(nsq), unordered(nacc)), unordered(np)))) return i;
    store16(sq + i, rsq);
    store16(acc + i, round16(nacc));
    store16(p + i, round16(np));
  }
  return i;
}

// ---------------------------------------------------------------------------------------------------------------
// RMSprop and its TensorFlow form: rmsprop_body's element loop (MOM: RmsMom).
struct RmspropScalars {
  float lr, alpha, one_minus, eps, mom, wd_decay, wd_l2, gs;
  bool decay_on, l2_on;
};

template <bool TF, bool CENTERED, int MOM>
APEX_ELEMENT idx_t rmsprop_blocks(bf16_t* __restrict p, const bf16_t* __restrict g, idx_t lo, bf16_t* __restrict sq,
                                  bf16_t* __restrict buf, bf16_t* __restrict gavg, idx_t i, idx_t end,
                                  const RmspropScalars& c) {
  const V16 lr = splat(c.lr), alpha = splat(c.alpha), one_minus = splat(c.one_minus), eps = splat(c.eps);
  const V16 mom = splat(c.mom), wd_decay = splat(c.wd_decay), wd_l2 = splat(c.wd_l2), gs = splat(c.gs);
  const V16 zero = splat(0.f);
  (void)alpha;
  (void)mom;
  (void)wd_decay;
  (void)zero;
  for (; end - i >= 16; i += 16) {
    V16 pv = load16(p + i);
    if constexpr (TF) {
      if (c.decay_on) pv = pv - wd_decay * pv;
    }
    V16 gv = load16(g + (i - lo)) * gs;
    if (c.l2_on) gv = gv + wd_l2 * pv;
    const V16 s = load16(sq + i);
    V16 nsq;
    if constexpr (TF) nsq = s + one_minus * (gv * gv - s);
    else nsq = alpha * s + one_minus * gv * gv;
    const R16 rsq = round16(nsq);
    __m256 nan = unordered(nsq);
    V16 sv = stored(rsq);
    R16 rga{};
    if constexpr (CENTERED) {
      const V16 ga = load16(gavg + i);
      const V16 nga = ga + one_minus * (gv - ga);
      rga = round16(nga);
      nan = either(nan, unordered(nga));
      const V16 gas = stored(rga);
      sv = max(sv - gas * gas, zero);
    }
    V16 avg;
    if constexpr (TF) avg = sqrt(sv + eps);
    else avg = sqrt(sv) + eps;
    R16 rb{};
    V16 np;
    if constexpr (MOM == kMomLr) {
      const V16 nb = mom * load16(buf + i) + lr * gv / avg;
      rb = round16(nb);
      nan = either(nan, unordered(nb));
      np = pv - stored(rb);
    } else if constexpr (MOM == kMom) {
      const V16 nb = mom * load16(buf + i) + gv / avg;
      rb = round16(nb);
      nan = either(nan, unordered(nb));
      np = pv - lr * stored(rb);
    } else {
      np = pv - lr * gv / avg;
    }
    if (any(either(nan, unordered(np)))) return i;
    store16(sq + i, rsq);
    if constexpr (CENTERED) store16(gavg + i, rga);
    if constexpr (MOM != kNoMom) store16(buf + i, rb);
    store16(p + i, round16(np));
  }
  return i;
}

// ---------------------------------------------------------------------------------------------------------------
// BertAdam: bert_adam's element loop (decay: weight_decay != 0).
struct BertAdamScalars {
  float lr, b1, b2, omb1, omb2, eps, wd, gs;
  bool decay;
};

APEX_ELEMENT idx_t bert_adam_blocks(bf16_t* __restrict p, const bf16_t* __restrict g, idx_t lo, bf16_t* __restrict m,
                                    bf16_t* __restrict v, idx_t i, idx_t end, const BertAdamScalars& c) {
  const V16 lr = splat(c.lr), b1 = splat(c.b1), b2 = splat(c.b2), omb1 = splat(c.omb1), omb2 = splat(c.omb2);
  const V16 eps = splat(c.eps), wd = splat(c.wd), gs = splat(c.gs);
  for (; end - i >= 16; i += 16) {
    const V16 pv = load16(p + i);
    const V16 gv = load16(g + (i - lo)) * gs;
    const V16 nm = b1 * load16(m + i) + omb1 * gv;
    const V16 nv = b2 * load16(v + i) + omb2 * gv * gv;
    const R16 rm = round16(nm), rv = round16(nv);
    V16 u = stored(rm) / (sqrt(stored(rv)) + eps);
    if (c.decay) u = u + wd * pv;
    const V16 np = pv - lr * u;
    if (any(either(either(unordered(nm), unordered(nv)), unordered(np)))) return i;
    store16(m + i, rm);
    store16(v + i, rv);
    store16(p + i, round16(np));
  }
  return i;
}

// ---------------------------------------------------------------------------------------------------------------
// Adagrad: adagrad's element loop (l2_on: decay added to the grad, decay_on: to the update, NVIDIA's w mode).
struct AdagradScalars {
  float clr, eps, wd, gs;
  bool l2_on, decay_on;
};

APEX_ELEMENT idx_t adagrad_blocks(bf16_t* __restrict p, const bf16_t* __restrict g, idx_t lo, bf16_t* __restrict sum,
                                  idx_t i, idx_t end, const AdagradScalars& c) {
  const V16 clr = splat(c.clr), eps = splat(c.eps), wd = splat(c.wd), gs = splat(c.gs);
  for (; end - i >= 16; i += 16) {
    const V16 pv = load16(p + i);
    V16 gv = load16(g + (i - lo)) * gs;
    if (c.l2_on) gv = gv + wd * pv;
    const V16 nsum = load16(sum + i) + gv * gv;
    const R16 rsum = round16(nsum);
    V16 u = gv / (sqrt(stored(rsum)) + eps);
    if (c.decay_on) u = u + wd * pv;
    const V16 np = pv - clr * u;
    if (any(either(unordered(nsum), unordered(np)))) return i;
    store16(sum + i, rsum);
    store16(p + i, round16(np));
  }
  return i;
}

// ---------------------------------------------------------------------------------------------------------------
// LAMB stage 2: lamb_stage2's element loop (step: lr times the slot's trust ratio).
struct LambStage2Scalars {
  float step, bcm, bcv, eps, wd;
  bool decay;
};

APEX_ELEMENT idx_t lamb_stage2_blocks(bf16_t* __restrict p, const bf16_t* __restrict m, const bf16_t* __restrict v,
                                      idx_t i, idx_t end, const LambStage2Scalars& c) {
  const V16 step = splat(c.step), bcm = splat(c.bcm), bcv = splat(c.bcv), eps = splat(c.eps), wd = splat(c.wd);
  for (; end - i >= 16; i += 16) {
    const V16 pv = load16(p + i);
    V16 u = load16(m + i) * bcm / (sqrt(load16(v + i) * bcv) + eps);
    if (c.decay) u = u + wd * pv;
    const V16 np = pv - step * u;
    if (any(unordered(np))) return i;
    store16(p + i, round16(np));
  }
  return i;
}

}  // namespace bf16_avx2
}  // namespace apexc
