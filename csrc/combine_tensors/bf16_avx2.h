// bf16 Adam / AdamW blocks written with AVX2 intrinsics, for the avx2 level only.
//
// Without AVX-512 the bf16 Adam loop is bound by instruction count, not memory: the compiler widens each bf16
// load with a zero-extension and a shift, narrows each store with a cross-lane permute after the pack, and
// gives every rounded store the nan rule's compare and select. Here 16 values go through two registers in
// "unpack order" (elements 0-3 and 8-11 in one, 4-7 and 12-15 in the other): an unpack with zero widens them
// (the bf16 bits land in the top half of each 32-bit lane), and an in-lane pack of the two rounded halves
// restores memory order, so neither direction needs a shift-and-permute. The nan rule is checked once per
// block instead of per store: a block where any stored value (m, v or the new param) is a nan is left, with
// nothing written, to the caller's element loop, which applies the rule.
//
// The arithmetic is the element loop's, operation by operation (no fma: -ffp-contract=off everywhere), and the
// rounding is common.h's round to nearest even without the nan arm, so the bits are the element loop's; the
// tests compare this level with the baseline bitwise (tests/kernels/test_conversions.py).
#pragma once

#include <immintrin.h>

#include "common.h"
#include "optim.h"

namespace apexc {
namespace bf16_avx2 {

// 16 bf16 values -> two fp32 vectors in unpack order
APEX_ELEMENT void load16(const bf16_t* src, __m256& lo, __m256& hi) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x));
}

// f32_to_bf16's round to nearest even for a non-nan lane, result in the top half of the 32-bit lane:
// u + 0x7fff, or + 0x8000 when the kept part is odd (the compare gives -1 where it is even)
APEX_ELEMENT __m256i round_keep_top(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i even = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x10000)), _mm256_setzero_si256());
  return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x8000)), even);
}

// the stored value read back as fp32 (bf16_to_f32 of the stored half)
APEX_ELEMENT __m256 stored_value(__m256i r) {
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// two rounded vectors in unpack order -> 16 bf16 values in memory order
APEX_ELEMENT void store16(bf16_t* dst, __m256i lo, __m256i hi) {
  const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(lo, 16), _mm256_srli_epi32(hi, 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
}

// Adam's per-slot scalars, as the element loop uses them
struct AdamScalars {
  float b1, b2, omb1, omb2, eps, step_size, bc2_sqrt, gs, wd, decay;
};

// Runs adam_body's element update over whole 16-element blocks of [i, end): bf16 params, grads and moments, no
// AMSGrad, WD its decay form (AdamDecay); g is the slot's grad at element `lo`. Returns where it stopped: `end`
// rounded down to a block, or the first block with a nan to store, which it leaves untouched.
template <int WD>
APEX_ELEMENT idx_t adam_blocks(bf16_t* __restrict p, const bf16_t* __restrict g, idx_t lo, bf16_t* __restrict m,
                               bf16_t* __restrict v, idx_t i, idx_t end, const AdamScalars& c) {
  const __m256 b1 = _mm256_set1_ps(c.b1), b2 = _mm256_set1_ps(c.b2);
  const __m256 omb1 = _mm256_set1_ps(c.omb1), omb2 = _mm256_set1_ps(c.omb2);
  const __m256 eps = _mm256_set1_ps(c.eps), step_size = _mm256_set1_ps(c.step_size);
  const __m256 bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt), gs = _mm256_set1_ps(c.gs);
  const __m256 wd = _mm256_set1_ps(c.wd), decay = _mm256_set1_ps(c.decay);
  (void)wd;
  (void)decay;
  for (; end - i >= 16; i += 16) {
    __m256 p0, p1, g0, g1, m0, m1, v0, v1;
    load16(p + i, p0, p1);
    load16(g + (i - lo), g0, g1);
    load16(m + i, m0, m1);
    load16(v + i, v0, v1);
    if constexpr (WD == kDecoupledDecay) {  // decoupled: p * (1 - lr * wd)
      p0 = _mm256_mul_ps(p0, decay);
      p1 = _mm256_mul_ps(p1, decay);
    }
    g0 = _mm256_mul_ps(g0, gs);
    g1 = _mm256_mul_ps(g1, gs);
    if constexpr (WD == kL2Decay) {  // L2: g + wd * p
      g0 = _mm256_add_ps(g0, _mm256_mul_ps(wd, p0));
      g1 = _mm256_add_ps(g1, _mm256_mul_ps(wd, p1));
    }
    m0 = _mm256_add_ps(_mm256_mul_ps(b1, m0), _mm256_mul_ps(omb1, g0));
    m1 = _mm256_add_ps(_mm256_mul_ps(b1, m1), _mm256_mul_ps(omb1, g1));
    v0 = _mm256_add_ps(_mm256_mul_ps(b2, v0), _mm256_mul_ps(_mm256_mul_ps(omb2, g0), g0));
    v1 = _mm256_add_ps(_mm256_mul_ps(b2, v1), _mm256_mul_ps(_mm256_mul_ps(omb2, g1), g1));
    const __m256i rm0 = round_keep_top(m0), rm1 = round_keep_top(m1);
    const __m256i rv0 = round_keep_top(v0), rv1 = round_keep_top(v1);
    const __m256 den0 = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(stored_value(rv0)), bc2_sqrt), eps);
    const __m256 den1 = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(stored_value(rv1)), bc2_sqrt), eps);
    const __m256 np0 = _mm256_sub_ps(p0, _mm256_div_ps(_mm256_mul_ps(step_size, stored_value(rm0)), den0));
    const __m256 np1 = _mm256_sub_ps(p1, _mm256_div_ps(_mm256_mul_ps(step_size, stored_value(rm1)), den1));
    // one unordered compare covers two vectors: a nan anywhere among the six values to store
    const __m256 nan = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(m0, m1, _CMP_UNORD_Q), _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q)),
                                    _mm256_cmp_ps(np0, np1, _CMP_UNORD_Q));
    if (__builtin_expect(!_mm256_testz_ps(nan, nan), 0)) return i;
    store16(m + i, rm0, rm1);
    store16(v + i, rv0, rv1);
    store16(p + i, round_keep_top(np0), round_keep_top(np1));
  }
  return i;
}

}  // namespace bf16_avx2
}  // namespace apexc
