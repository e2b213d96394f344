"""FusedAdagrad with NVIDIA Apex's signature and semantics, on combined buffers.

Adagrad (Duchi et al. 2011) as NVIDIA's FusedAdagrad computes it (no learning-rate
decay, accumulator starting at 0)::

    adagrad_w_mode=False (L2, = torch.optim.Adagrad with lr_decay=0):
        g = grad + weight_decay * p ;  h = h + g^2 ;  p = p - lr * g / (sqrt(h) + eps)
    adagrad_w_mode=True (decoupled decay):
        h = h + grad^2 ;  p = p - lr * (grad / (sqrt(h) + eps) + weight_decay * p)

A group with torch.optim.Adagrad's ``lr_decay`` other than 0 (a loaded torch checkpoint, an added group) is
rejected (ValueError) rather than trained without the decay.

Executors: the apex_C ``_raw_adagrad_step`` kernel on CPU (one pass per group x dtype),
the same math as torch ops on flat slices elsewhere. ``state[p]`` holds ``sum`` only
(NVIDIA's layout; torch's Adagrad also keeps a ``step``).
"""

from __future__ import annotations

from typing import List

from .. import _core
from ._base import CombinedOptimizer, _check_range
from ._flat import FlatSet
from ._functional import adagrad_math, settler
from ._nvidia import AmpCOp, NvidiaCompatMixin, OverflowFlag

__all__ = ["FusedAdagrad"]


class FusedAdagrad(NvidiaCompatMixin, CombinedOptimizer):
    """Adagrad as ``apex.optimizers.FusedAdagrad``.

    Args: params, lr=1e-2, eps=1e-10, weight_decay=0., set_grad_none=True, adagrad_w_mode=False.
    """

    # upstream's kernel handles, for subclasses that replace step() (see `AmpCOp`)
    multi_tensor_adagrad = AmpCOp("multi_tensor_adagrad")
    _dummy_overflow_buf = OverflowFlag()

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
        if "lr_decay" in group:  # torch.optim.Adagrad's option, in every checkpoint it writes
            _check_range("lr_decay value", group["lr_decay"], 0.0)
            if float(group["lr_decay"]) != 0.0:
                raise ValueError(
                    f"{type(self).__name__} has no learning-rate decay (NVIDIA's Adagrad): expected lr_decay=0, got "
                    f"lr_decay={group['lr_decay']!r} (torch.optim.Adagrad's lr / (1 + (step - 1) * lr_decay) would "
                    "be dropped); continue such a run with torch.optim.Adagrad"
                )

    def _state_names(self, group: dict) -> List[str]:
        return ["sum"]

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        flags = _core.ext.FLAG_DECOUPLED if self.adagrad_w_mode else 0
        # hp[3] = lr_decay = 0: the per-segment steps the kernel reads then do not matter
        a = self._prepare_args(s, [group["lr"], group["eps"], group["weight_decay"], 0.0], flags)
        _core.ext._raw_adagrad_step(a)

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        settle = settler(s.dtype)

        def update(p, g, states, _):
            adagrad_math(p, g, *states, lr=group["lr"], eps=group["eps"], weight_decay=group["weight_decay"],
                         decoupled=bool(self.adagrad_w_mode), grad_scale=self._grad_scale(), settle=settle)

        self._update_runs(s, ["sum"], update)
        self.last_executor = "torch"
