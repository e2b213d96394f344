"""FusedLAMB with NVIDIA Apex's signature, defaults and semantics, on combined buffers.

LAMB (You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes") as NVIDIA's FusedLAMB computes it. Once per ``step()``, over the grads of
all param groups::

    n = ||all grads||_2 ;   c = n / max_grad_norm if n > max_grad_norm else 1   (max_grad_norm: the constructor's)

then per param group, with the group's step count ``t``::

    g  = grad / c  (+ weight_decay * p           when adam_w_mode=False: L2 inside the moments)
    m  = beta1 * m + beta3 * g                    beta3 = 1 - beta1 with grad_averaging, else 1
    v  = beta2 * v + (1 - beta2) * g^2
    u  = (m / bc1) / (sqrt(v / bc2) + eps)       bc1 = 1 - beta1^t, bc2 = 1 - beta2^t (1 without bias_correction)
         (+ weight_decay * p                      when adam_w_mode=True: decoupled decay in the update)
    r  = ||p|| / ||u||  per tensor               only when weight_decay != 0 or use_nvlamb; r = 1 if either norm is 0
    p  = p - lr * r * u

Executors: on CPU the apex_C ``_raw_grad_sum_sq`` pass for the global norm, then one ``_raw_lamb_step``
call per group x dtype making two passes (stage 1: m, v and the per-tensor norms of p and u;
the trust ratios from those norms; stage 2: the update). Both grad reads take the grads where
autograd left them after ``zero_grad(set_to_none=True)`` (no copy), except with
``adam_w_mode=False`` and a non-zero weight decay, where the L2 term is formed first in a
scratch buffer from the flat grad buffer (two more cheap passes). Elsewhere the same math
runs as torch ops on flat slices (NpuFusedLamb's torch executor, with NVIDIA's options).

Unlike NVIDIA, the grads are left as they are (NVIDIA overwrites ``p.grad`` with ``u``),
bf16 params work, and ``max_grad_norm=None`` disables the clipping.
"""

from __future__ import annotations

import math
import weakref
from typing import List, Optional, Union

import torch

from .. import _core
from ._base import CombinedOptimizer, _call_closure, _check_adam_group, _check_range, check_no_amsgrad
from ._flat import FlatSet
from ._functional import lamb_trust_ratio
from ._nvidia import AmpCOp, NvidiaCompatMixin, OverflowFlag
from .clip import prepared_grad_norm
from .lamb import lamb_flat_step

__all__ = ["FusedLAMB", "lamb_clip_divisor"]


def lamb_clip_divisor(norm: Union[float, torch.Tensor], max_grad_norm: Optional[float]):
    """NVIDIA's global clipping: the grads are divided by norm/max_grad_norm when the norm exceeds it
    (``max_grad_norm=0``: by infinity, so every grad becomes 0, as NVIDIA's kernel gives)."""
    if max_grad_norm is None:
        return 1.0
    if isinstance(norm, torch.Tensor):
        return torch.where(norm > max_grad_norm, norm / max_grad_norm, torch.ones_like(norm))
    if norm > max_grad_norm:
        return norm / max_grad_norm if max_grad_norm else math.inf
    return 1.0


def _nvidia_trust_ratio(p_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
    """``||p|| / ||u||`` per param, 1 where either is 0: `lamb_trust_ratio` without the NPU patch's clamp."""
    return lamb_trust_ratio(p_norm, u_norm, max_weight_norm=None)


class _Scratch:
    """Per-FlatSet kernel inputs: per-segment norms (float64 pairs) and trust ratios (float32)."""

    def __init__(self, s: FlatSet):
        self.norms = torch.zeros(2 * s.nseg, dtype=torch.float64)
        self.ratio = torch.ones(s.nseg, dtype=torch.float32)


class FusedLAMB(NvidiaCompatMixin, CombinedOptimizer):
    """LAMB as ``apex.optimizers.FusedLAMB`` (see the module docstring for the exact math).

    Args: params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
    amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0,
    use_nvlamb=False.

    As NVIDIA: ``amsgrad=True`` raises RuntimeError; ``max_grad_norm`` is read from the
    constructor's defaults (not per group); ``adam_w_mode``, ``use_nvlamb`` and
    ``set_grad_none`` are optimizer attributes; the step count is per group.
    """

    # upstream's kernel handles, for subclasses that replace step() (see `AmpCOp`)
    multi_tensor_l2norm = AmpCOp("multi_tensor_l2norm")
    multi_tensor_lamb = AmpCOp("multi_tensor_lamb")
    _dummy_overflow_buf = OverflowFlag()

    _has_step = False

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0,
                 use_nvlamb=False):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        self._validate_group(defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0  # NVIDIA's int flag
        self.set_grad_none = bool(set_grad_none)
        self.use_nvlamb = bool(use_nvlamb)
        super().__init__(params, defaults)

    def _init_combined(self) -> None:
        # also run when a copy (deepcopy / unpickle) restores only torch's fields
        super()._init_combined()
        self._scratch: weakref.WeakKeyDictionary[FlatSet, _Scratch] = weakref.WeakKeyDictionary()
        self._clip: Union[float, torch.Tensor] = 1.0

    def _validate_group(self, group: dict) -> None:
        _check_adam_group(group)
        check_no_amsgrad(type(self).__name__, group)
        if group.get("max_grad_norm") is not None:
            _check_range("max_grad_norm", group["max_grad_norm"], 0.0, allow_inf=True)

    def _state_names(self, group: dict) -> List[str]:
        return ["exp_avg", "exp_avg_sq"]

    # ------------------------------------------------------------------ step
    def _max_grad_norm(self) -> Optional[float]:
        value = self.defaults.get("max_grad_norm")
        return None if value is None else float(value)

    def _global_clip(self, prepared) -> Union[float, torch.Tensor]:
        """Divisor of every grad this step, from the (unscaled) norm of all grads of all groups (`prepared`: the
        sets of `_prepare_step`, whose grads the update reads)."""
        max_norm = self._max_grad_norm()
        if max_norm is None:
            return 1.0
        total = prepared_grad_norm([s for _, sets in prepared for s in sets])
        return lamb_clip_divisor(total * self._grad_scale(), max_norm)

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB update of every param with a grad. Returns the closure's loss (None without a closure)."""
        loss = _call_closure(closure)
        self._lamb_step()
        return loss

    def _lamb_step(self) -> None:
        prepared = self._prepare_counted_step()
        self._clip = self._global_clip(prepared)
        self._update(prepared)

    _gather_grads = True  # _raw_lamb_step reads grads only through OptArgs (in its stage 1)
    _reads_values = True  # the global grad norm (max_grad_norm clipping) is read on the host

    def _gathers(self, s: FlatSet, group: dict) -> bool:
        # the L2 mode forms g/c + wd*p in a scratch buffer from the flat grad buffer (see _kernel_step)
        if group["weight_decay"] != 0 and not self.adam_w_mode:
            return False
        return super()._gathers(s, group)

    def _grad_mul(self) -> Union[float, torch.Tensor]:
        """What each stored grad is multiplied by: amp's folded unscale over the clipping divisor."""
        return self._grad_scale() / self._clip

    def _uses_ratio(self, group: dict) -> bool:
        return self.use_nvlamb or group["weight_decay"] != 0

    def _lamb_flags(self, group: dict) -> int:
        flags = _core.ext.FLAG_BETA3
        if group["bias_correction"]:
            flags |= _core.ext.FLAG_BIAS_CORRECTION
        return flags

    @staticmethod
    def _beta3(group: dict) -> float:
        return 1.0 - group["betas"][0] if group["grad_averaging"] else 1.0

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        self._use_group_step(s, group)
        b1, b2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        scratch = self._scratch.get(s)
        if scratch is None:
            scratch = self._scratch[s] = _Scratch(s)
        flags = self._lamb_flags(group)
        a = self._prepare_args(s, [], flags)
        a.grad_scale = float(self._grad_mul())
        a.seg_gmul = 0
        a.seg_mul = 0
        kernel_wd = wd
        l2_grad = None
        g0 = a.g  # the flat grad buffer's address, or 0 while the set has none (grads read in place)
        if wd != 0 and not self.adam_w_mode:
            # L2 mode: the moments see g/c + wd*p, and the update has no decay term
            l2_grad = torch.empty_like(s.flat_g)
            _core.scale_(s.flat_g, a.grad_scale, out=l2_grad, check=False)
            _core.axpy_(s.flat_p, l2_grad, wd, check=False)
            a.g = l2_grad.data_ptr()
            a.grad_scale = 1.0
            kernel_wd = 0.0
        try:
            # stage 1's hyperparameters, then stage 2's; the kernel forms the trust ratios between the stages
            a.hp = [b1, b2, eps, kernel_wd, self._beta3(group), float(group["lr"]), eps, kernel_wd, b1, b2]
            a.seg_out = scratch.norms.data_ptr()
            if self._uses_ratio(group):
                a.flags = flags | _core.ext.FLAG_TRUST_RATIO
                a.seg_mul = scratch.ratio.data_ptr()
            _core.ext._raw_lamb_step(a)
        finally:
            a.seg_out = 0
            a.seg_mul = 0
            a.g = g0

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        step = self._use_group_step(s, group)
        b1, b2 = group["betas"]
        wd = group["weight_decay"]
        bc1 = 1 - b1**step if group["bias_correction"] else 1.0
        bc2 = 1 - b2**step if group["bias_correction"] else 1.0
        lamb_flat_step(
            self, s, grad_mul=self._grad_mul(), l2=0.0 if self.adam_w_mode else wd, beta1=b1, beta2=b2,
            beta3=self._beta3(group), eps=group["eps"], weight_decay=wd if self.adam_w_mode else 0.0, bc1=bc1,
            bc2=bc2, lr=float(group["lr"]), trust_ratio=_nvidia_trust_ratio if self._uses_ratio(group) else None,
        )
        self.last_executor = "torch"
