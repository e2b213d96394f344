"""NpuFusedRMSprop: torch.optim.RMSprop's math (momentum, centered) on combined buffers."""

from __future__ import annotations

from typing import List

from .. import _core
from ._base import CombinedOptimizer, _check_range
from ._flat import FlatSet
from ._functional import l2_grad, settler

# The rmsprop kernels read fixed state slots: s0 square_avg, s1 momentum_buffer,
# s2 grad_avg. A group keeps only the states its options need (torch's layout),
# so the slots are bound by name, 0 for an absent state.
_SLOTS = ("square_avg", "momentum_buffer", "grad_avg")


def rmsprop_math(p, g, square_avg, buf, grad_avg, *, lr, alpha, eps, weight_decay, momentum, grad_scale, settle):
    """One RMSprop update on fp32 tensors (in place); torch.optim.RMSprop's formulas.

    ``buf`` is None unless momentum > 0, ``grad_avg`` None unless centered. ``settle(t)``
    rounds a state through its storage dtype in place (later terms read it as stored).
    """
    g = l2_grad(g, p, grad_scale, weight_decay)
    square_avg.mul_(alpha).addcmul_(g, g, value=1 - alpha)
    settle(square_avg)
    if grad_avg is not None:
        grad_avg.lerp_(g, 1 - alpha)
        settle(grad_avg)
        # square_avg - grad_avg**2 >= 0 in exact math, but from rounded states (an fp16 square_avg
        # flushing to zero) it can be slightly negative: clamp as the kernel does (NaN stays NaN)
        avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).clamp_(min=0).sqrt_()
    else:
        avg = square_avg.sqrt()
    avg.add_(eps)
    rms_step(p, g, avg, buf, lr=lr, momentum=momentum, lr_in_momentum=False, settle=settle)


def rms_step(p, g, rms, buf, *, lr, momentum, lr_in_momentum, settle) -> None:
    """``p -= lr * g / rms``, through the momentum buffer ``buf`` when momentum > 0.

    ``lr_in_momentum`` (TF): the buffer accumulates ``lr * g / rms`` and is subtracted as is.
    """
    if momentum <= 0:
        p.addcdiv_(g, rms, value=-lr)
    elif lr_in_momentum:
        buf.mul_(momentum).addcdiv_(g, rms, value=lr)
        settle(buf)
        p.sub_(buf)
    else:
        buf.mul_(momentum).addcdiv_(g, rms)
        settle(buf)
        p.add_(buf, alpha=-lr)


class RMSpropFamily(CombinedOptimizer):
    """What torch's RMSprop and the TF variant share: state layout and kernel slots."""

    _gather_grads = True  # the kernel reads grads only through OptArgs

    def _state_names(self, group: dict) -> List[str]:
        names = ["square_avg"]
        if group["momentum"] > 0:
            names.append("momentum_buffer")
        if group["centered"]:
            names.append("grad_avg")
        return names

    def _bind_slots(self, s: FlatSet, a) -> None:
        a.s0, a.s1, a.s2 = (s.flat_s[n].data_ptr() if n in s.flat_s else 0 for n in _SLOTS)

    @staticmethod
    def _hp(group: dict) -> List[float]:
        """The kernels' hyperparameters: lr, alpha, eps, weight_decay, momentum."""
        return [float(group[k]) for k in ("lr", "alpha", "eps", "weight_decay", "momentum")]

    def _validate_group(self, group: dict) -> None:
        _check_range("learning rate", group["lr"], 0.0)
        _check_range("epsilon value", group["eps"], 0.0)
        _check_range("momentum value", group["momentum"], 0.0)
        _check_range("weight_decay value", group["weight_decay"], 0.0)
        _check_range("alpha value", group["alpha"], 0.0)

    #: the torch executor's math (rmsprop_math's arguments, plus what `_math_options` adds)
    _math = staticmethod(rmsprop_math)

    def _math_options(self, group: dict) -> dict:
        return {}

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        hp = dict(zip(("lr", "alpha", "eps", "weight_decay", "momentum"), self._hp(group)))
        hp.update(self._math_options(group), grad_scale=self._grad_scale(), settle=settler(s.dtype))

        def update(p, g, states, _):
            self._math(p, g, *states, **hp)

        self._update_runs(s, _SLOTS, update)
        self.last_executor = "torch"


class NpuFusedRMSprop(RMSpropFamily):
    """RMSprop with torch.optim.RMSprop's semantics, fused over combined buffers.

    Args: params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False.
    State: step, square_avg, momentum_buffer (momentum > 0), grad_avg (centered), as torch.
    """

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False):
        defaults = dict(
            lr=lr, momentum=momentum, alpha=alpha, eps=eps, centered=centered, weight_decay=weight_decay,
            capturable=False, foreach=None, maximize=False, differentiable=False,
        )
        self._validate_group(defaults)
        super().__init__(params, defaults)

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        a = self._prepare_args(s, self._hp(group), _core.ext.FLAG_CENTERED if group["centered"] else 0)
        self._bind_slots(s, a)
        _core.ext._raw_rmsprop_step(a)
