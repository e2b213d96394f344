// Optimizer kernels over combined (flat) buffers.
//
// One call updates every tensor of a param group at once. The flat buffers
// hold consecutive slots ("segments"), one per parameter; per-segment inputs
// (step counts, skip flags, trust ratios) let one pass honour per-tensor
// semantics such as bias correction per parameter.
#pragma once

#include "common.h"

namespace apexc {

struct OptArgs {
  void* p = nullptr;  // params, dtype pdt
  int pdt = F32;
  const void* g = nullptr;  // grads, dtype gdt (flat, laid out like p); unused when gtab is set
  int gdt = F32;
  // Optional grad gather table: nseg base addresses, one per slot; slot k's grad element for flat
  // index i is read at gtab[k] + (i - seg[k]). Lets a call read grads where autograd left them
  // (separate tensors) instead of a flat buffer. Chosen once per call: loops stay vectorised.
  const std::uintptr_t* gtab = nullptr;
  void* s[3] = {nullptr, nullptr, nullptr};  // state buffers, in the param dtype pdt (meaning per kernel), or
                                             // float32 with kF32States
  int sdt = F32;  // recorded by the bridge for diagnostics; kernels read states as pdt (torch keeps them so)
  void* out = nullptr;  // optional second copy of the updated param (dtype odt), e.g. O2 model weights
  int odt = F32;
  const idx_t* seg = nullptr;  // nseg+1 slot starts (last = end of the used buffer)
  idx_t nseg = 0;
  // Optional per-segment end (slot start + numel): the padding between slots is then never
  // touched, so it stays zero whatever the math does to zeros (e.g. 0/0 with eps=0).
  const idx_t* seg_end = nullptr;
  const float* steps = nullptr;         // per-segment step count, already advanced for this update
  const std::uint8_t* skip = nullptr;   // per-segment: nonzero = leave this slot untouched
  const std::uint8_t* first = nullptr;  // per-segment: nonzero = first update of this slot
  const float* seg_mul = nullptr;       // per-segment multiplier on the step (e.g. LAMB trust ratio)
  const float* seg_gmul = nullptr;      // per-segment multiplier on the grad (e.g. per-tensor clipping)
  const float* seg_aux = nullptr;       // per-segment extra input; meaning per kernel
  float grad_scale = 1.f;               // grads are multiplied by this first (unscale)
  double hp[12] = {0};                  // hyperparameters; meaning per kernel
  int flags = 0;                        // per-kernel option bits
  int threads = 0;
  double* seg_out = nullptr;  // per-segment reduction outputs, for kernels that produce them
};

// Flag bits; Python reads them as apex_C.FLAG_* (exported in module.cpp).
enum OptFlags : int {
  kNesterov = 1 << 0,
  kAmsgrad = 1 << 1,
  kDecoupled = 1 << 2,  // AdamW-style decoupled weight decay
  kCentered = 1 << 3,
  kLrInMomentum = 1 << 4,
  kNoBiasCorrection = 1 << 6,  // Adam: skip bias correction (NVIDIA FusedAdam bias_correction=False)
  kBiasCorrection = 1 << 7,    // LAMB: apply Adam bias correction from `steps` (NVIDIA FusedLAMB)
  kBeta3 = 1 << 8,             // LAMB: m's grad coefficient is hp[4] instead of 1-beta1 (grad_averaging)
  // Adam only: fp16/bf16 params and grads with float32 states and no out (NVIDIA FusedAdam's layout: each
  // param updated in fp32 from its stored value and rounded once, the moments kept in fp32).
  kF32States = 1 << 9,
  kTrustRatio = 1 << 10,       // lamb: seg_mul receives the per-segment trust ratio ||p|| / ||u||
  kClampWeightNorm = 1 << 11,  // lamb with kTrustRatio: ||p|| clamped to hp[10] first (the NPU patch's LAMB)
};

// Adam's weight decay forms, a template parameter of its loop bodies: none, L2 (g + wd * p) or decoupled
// (p * (1 - lr * wd)).
enum AdamDecay : int { kNoDecay = 0, kL2Decay = 1, kDecoupledDecay = 2 };

// RMSprop's momentum forms, a template parameter of its loop bodies: none, the buffer (p -= lr * buf), or the
// buffer with lr folded in (p -= buf; the TensorFlow form's lr_in_momentum).
enum RmsMom : int { kNoMom = 0, kMom = 1, kMomLr = 2 };

struct OptimKernels {
  // SGD. hp: lr, momentum, dampening, weight_decay. s[0]: momentum buffer. kDecoupled: the decay after the
  // momentum, p -= lr * (s * seg_mul[k] + wd * p) (seg_mul absent: 1), instead of wd * p added to the grad.
  void (*sgd)(const OptArgs&);
  // Adam / AdamW. hp: lr, beta1, beta2, eps, weight_decay. s: exp_avg, exp_avg_sq, max_exp_avg_sq.
  void (*adam)(const OptArgs&);
  // Adadelta. hp: lr, rho, eps, weight_decay. s: square_avg, acc_delta.
  void (*adadelta)(const OptArgs&);
  // RMSprop (torch). hp: lr, alpha, eps, weight_decay, momentum. s: square_avg, momentum_buffer, grad_avg.
  void (*rmsprop)(const OptArgs&);
  // RMSpropTF (TF/timm). hp: lr, alpha, eps, weight_decay, momentum. s: square_avg, momentum_buffer, grad_avg.
  void (*rmsprop_tf)(const OptArgs&);
  // BertAdam. hp: lr_scheduled, beta1, beta2, eps, weight_decay. s: exp_avg, exp_avg_sq. seg_gmul: clip coef.
  void (*bert_adam)(const OptArgs&);
  // LAMB stage 1: update m, v; seg_out[2k] = ||p_k||^2, seg_out[2k+1] = ||u_k||^2 with
  // u = m'/(sqrt(v')+eps) + wd*p. hp: beta1, beta2, eps, weight_decay, beta3. seg_gmul: grad multiplier.
  // m = beta1*m + c*g with c = hp[4] if kBeta3 else 1-beta1. m' = m/(1-beta1^t), v' = v/(1-beta2^t) with
  // kBiasCorrection (steps required), else m' = m, v' = v.
  void (*lamb_stage1)(const OptArgs&);
  // LAMB stage 2: p -= lr * seg_mul[k] * u (u recomputed from the updated m, v).
  // hp: lr, eps, weight_decay, beta1, beta2 (betas only used with kBiasCorrection).
  void (*lamb_stage2)(const OptArgs&);
  // LAMB in one call: stage 1, the trust ratios, stage 2. hp[0..4]: stage 1's; hp[5..9]: stage 2's.
  // kTrustRatio: seg_mul is an output, written per segment with min(||p||, hp[10] under kClampWeightNorm) /
  // ||u|| from stage 1's double sums in seg_out (square roots and quotient in double, rounded once to float),
  // 1 where either norm is 0, NaN where either is NaN (as torch.where over the same doubles); stage 2
  // multiplies by it. Without kTrustRatio stage 2 gets no multiplier and seg_mul is not touched.
  void (*lamb)(const OptArgs&);
  // Per-segment dot products of the grad and param: seg_out[3k..3k+2] = (g.p, g.g, p.p); grads scaled by
  // grad_scale. Segments here are rows (AdamP's channel views).
  void (*row_dots)(const OptArgs&);
  // AdamP, over rows (seg = row starts; steps per row). hp: lr, beta1, beta2, eps, weight_decay.
  // seg_mul[r] = 1/(||p view||+eps) for rows being projected, 0 otherwise; seg_aux[r] = wd_ratio of
  // the row's param. Stage A (no writes to m/v/p): seg_out[r] = sum over the row of p_n * perturb.
  // Stage B: updates m, v, p with perturb -= p_n * seg_out[r]. flags: kNesterov.
  void (*adamp_stage_a)(const OptArgs&);
  void (*adamp_stage_b)(const OptArgs&);
  // Adagrad (torch.optim.Adagrad). hp: lr, eps, weight_decay, lr_decay. s0: sum. steps required
  // (clr = lr / (1 + (t-1)*lr_decay)). kDecoupled: NVIDIA adagrad_w_mode (update = g/(sqrt(h)+eps) + wd*p).
  void (*adagrad)(const OptArgs&);
  // In place x *= scale over n separate buffers of dtype dt (addr[j], numel[j] elements), split across
  // threads by elements; returns whether any input value was inf/nan (only computed when `check`).
  // scale == 1 only reads. The buffers must be disjoint. (amp's unscale over grads left where they are.)
  bool (*scale_gather)(const std::uintptr_t* addr, const idx_t* numel, idx_t n, int dt, float scale, bool check,
                       int threads);
  // Per-segment sum of squared grads (double): seg_out[k] = sum over slot k of g^2, 0 for skipped slots. Reads
  // grads as the update kernels do (flat buffer or gather table); grad_scale and seg_gmul are not applied.
  void (*grad_sum_sq)(const OptArgs&);
};

const OptimKernels& optim_kernels_baseline();
#if defined(__x86_64__) || defined(_M_X64)
const OptimKernels& optim_kernels_avx2();
const OptimKernels& optim_kernels_avx512();
#endif
#if defined(__aarch64__)
const OptimKernels& optim_kernels_neon();
#endif

const OptimKernels& OK();

inline idx_t seg_end(const OptArgs& a, idx_t k) { return a.seg_end ? a.seg_end[k] : a.seg[k + 1]; }

// Slot k's grad from flat element `lo` on: its own buffer (gather table) or the flat buffer. Loops index
// the result with (i - lo), so one pointer choice per slot piece keeps the element loop branch-free.
template <class G>
inline const G* grad_at(const OptArgs& a, const G* flat, idx_t k, idx_t lo) {
  if (a.gtab) return reinterpret_cast<const G*>(a.gtab[k]) + (lo - a.seg[k]);
  return flat + lo;
}

// Runs fn(k, lo, hi) for every part of segment k that falls in this thread's
// element range; segments flagged in `skip` are not visited.
template <class F>
void for_segments(const OptArgs& a, F&& fn) {
  if (a.nseg <= 0) return;
  const idx_t base = a.seg[0], total = a.seg[a.nseg] - base;
  parallel_for(total, a.threads, [&](idx_t b, idx_t e) {
    b += base;
    e += base;
    // first segment whose end is past b
    idx_t lo = 0, hi = a.nseg;
    while (lo < hi) {
      idx_t mid = (lo + hi) / 2;
      if (a.seg[mid + 1] <= b) lo = mid + 1; else hi = mid;
    }
    for (idx_t k = lo; k < a.nseg && a.seg[k] < e; ++k) {
      if (a.skip && a.skip[k]) continue;
      idx_t s0 = a.seg[k] > b ? a.seg[k] : b;
      const idx_t end = seg_end(a, k);
      idx_t s1 = end < e ? end : e;
      if (s0 < s1) fn(k, s0, s1);
    }
  });
}

}  // namespace apexc
