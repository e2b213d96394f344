"""FusedAdagrad with NVIDIA Apex's signature and semantics, on combined buffers.

Adagrad (Duchi et al. 2011) as NVIDIA's FusedAdagrad computes it (no learning-rate
decay, accumulator starting at 0)::

    adagrad_w_mode=False (L2, = torch.optim.Adagrad with lr_decay=0):
        g = grad + weight_decay * p ;  h = h + g^2 ;  p = p - lr * g / (sqrt(h) + eps)
    adagrad_w_mode=True (decoupled decay):
        h = h + grad^2 ;  p = p - lr * (grad / (sqrt(h) + eps) + weight_decay * p)

Executors: the apex_C ``adagrad_step`` kernel on CPU (one pass per group x dtype),
the same math as torch ops on flat slices elsewhere. ``state[p]`` holds ``sum`` only
(NVIDIA's layout; torch's Adagrad also keeps a ``step``).
"""

from __future__ import annotations

from typing import List

from .. import _core
from ._base import CombinedOptimizer, _check_range
from ._flat import FlatSet
from ._nvidia import NvidiaCompatMixin

__all__ = ["FusedAdagrad"]


class FusedAdagrad(NvidiaCompatMixin, CombinedOptimizer):
    """Adagrad as ``apex.optimizers.FusedAdagrad``.

    Args: params, lr=1e-2, eps=1e-10, weight_decay=0., set_grad_none=True, adagrad_w_mode=False.
    """

    _gather_grads = True  # the kernel reads grads only through OptArgs

    _has_step = False

    def __init__(self, params, lr=1e-2, eps=1e-10, weight_decay=0.0, set_grad_none=True, adagrad_w_mode=False):
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay)
        self._validate_group(defaults)
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0  # NVIDIA's int flag
        self.set_grad_none = bool(set_grad_none)
        super().__init__(params, defaults)

    def _validate_group(self, group: dict) -> None:
        _check_range("learning rate", group["lr"], 0.0)
        _check_range("epsilon value", group["eps"], 0.0)
        _check_range("weight_decay value", group["weight_decay"], 0.0)

    def _state_names(self, group: dict) -> List[str]:
        return ["sum"]

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        flags = _core.ext.FLAG_DECOUPLED if self.adagrad_w_mode else 0
        # hp[3] = lr_decay = 0: the per-segment steps the kernel reads then do not matter
        a = self._prepare_args(s, [group["lr"], group["eps"], group["weight_decay"], 0.0], flags)
        _core.ext.adagrad_step(a)

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        gs = self._grad_scale()
        for lo, hi, _, _, _ in s.active_runs():
            p = self._f32(s.flat_p[lo:hi])
            g = self._f32(s.flat_g[lo:hi])
            g = g * gs if gs != 1.0 else g.clone()
            h_st = s.flat_s["sum"][lo:hi]
            h = self._f32(h_st)
            if wd != 0 and not self.adagrad_w_mode:
                g.add_(p, alpha=wd)
            h.addcmul_(g, g)
            self._write_back(h_st, h)
            u = g.div_(self._f32(h_st).sqrt().add_(eps))
            if wd != 0 and self.adagrad_w_mode:
                u.add_(p, alpha=wd)
            p.add_(u, alpha=-lr)
            self._write_back(s.flat_p[lo:hi], p)
        self.last_executor = "torch"
