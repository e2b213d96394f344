"""FusedSGD with NVIDIA Apex's signature: torch.optim.SGD's math plus ``wd_after_momentum``.

With ``wd_after_momentum=False`` (the default) the update is torch.optim.SGD's
(weight decay added to the grad before the momentum). With ``wd_after_momentum=True``
the decay is added after the momentum, as NVIDIA's kernel does::

    b = momentum * b + (1 - dampening) * g      (b = g at a param's first update)
    d = g + momentum * b  (nesterov)  or  b
    p = p - lr * (d + weight_decay * p)

The apex_C kernel computes exactly that in the update's one pass (SGD with
``FLAG_DECOUPLED``); the torch executors compute ``p *= 1 - lr * weight_decay`` over the
params that have a grad, then the ordinary SGD update without decay (the same value up
to rounding).

``materialize_master_grads`` only concerns how NVIDIA's amp O2 hands fp16 grads to
the optimizer; our amp drives every fused optimizer through the combined-buffer
protocol instead, so the flag is accepted and recorded but changes nothing.
"""

from __future__ import annotations

from torch.optim.optimizer import required

from .. import _core
from ._flat import FlatSet
from ._nvidia import AmpCOp, OverflowFlag
from .clip import grad_runs
from .sgd import NpuFusedSGD

__all__ = ["FusedSGD"]


class FusedSGD(NpuFusedSGD):
    """SGD as ``apex.optimizers.FusedSGD``: torch.optim.SGD semantics, fused over combined buffers.

    Args: params, lr (required), momentum=0, dampening=0, weight_decay=0, nesterov=False,
    wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False.

    ``zero_grad()`` without an argument sets grads to None whatever ``set_grad_none`` says, as
    upstream's does on torch >= 2.0: there ``True`` sets None itself and ``False`` calls torch's
    ``zero_grad()``, whose default became ``set_to_none=True``. The flag is recorded as
    ``self.set_grad_none``; ``zero_grad(set_to_none=False)`` zeroes in place. (The other Fused*
    optimizers document ``set_grad_none=False`` as zeroing in place, and do that.)
    """

    # upstream's kernel handles, for subclasses that replace step() (see `AmpCOp`)
    multi_tensor_sgd = AmpCOp("multi_tensor_sgd")
    _dummy_overflow_buf = OverflowFlag()

    def __init__(self, params, lr=required, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False):
        self.wd_after_momentum = bool(wd_after_momentum)
        self.materialize_master_grads = bool(materialize_master_grads)
        self.set_grad_none = bool(set_grad_none)
        # NVIDIA's amp integration reads these attributes; kept for code that inspects them
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov)

    def _decay_first(self, s: FlatSet, group: dict) -> dict:
        """wd_after_momentum in the torch executors: shrink the params that have a grad, then SGD without decay."""
        if not self.wd_after_momentum or group["weight_decay"] == 0:
            return group
        factor = 1.0 - group["lr"] * group["weight_decay"]
        for lo, hi, _, _ in grad_runs(s):
            if s.uses_kernel:
                _core.scale_(s.flat_p[lo:hi], factor, check=False)
            else:
                view = s.flat_p[lo:hi]
                view.copy_(self._f32(view).mul_(factor))
        return {**group, "weight_decay": 0.0}

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        if not self.wd_after_momentum or group["weight_decay"] == 0:
            super()._kernel_step(s, group)
            return
        # p -= lr * (d + wd * p), d the momentum result, in one pass (no per-slot multiplier: seg_mul 0 means 1)
        flags = _core.ext.FLAG_DECOUPLED | (_core.ext.FLAG_NESTEROV if group["nesterov"] else 0)
        a = self._prepare_args(s, self._hp(group), flags)
        a.seg_mul = 0
        _core.ext._raw_sgd_step(a)

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        super()._torch_step(s, self._decay_first(s, group))

    def _torch_gather_step(self, s: FlatSet, group: dict) -> None:
        super()._torch_gather_step(s, self._decay_first(s, group))
