"""NpuFusedAdadelta: torch.optim.Adadelta's math on combined buffers."""

from __future__ import annotations

from typing import List

from .. import _core
from ._base import CombinedOptimizer, _check_range
from ._flat import FlatSet
from ._functional import l2_grad, settler


def adadelta_math(p, g, square_avg, acc_delta, *, lr, rho, eps, weight_decay, grad_scale, settle):
    """One Adadelta update (Zeiler 2012) on fp32 tensors (in place); torch.optim.Adadelta's formulas.

    ``settle(t)`` rounds a state through its storage dtype in place: later terms read
    the averages as stored, as the kernel does.
    """
    g = l2_grad(g, p, grad_scale, weight_decay)
    square_avg.mul_(rho).addcmul_(g, g, value=1 - rho)
    settle(square_avg)
    std = square_avg.add(eps).sqrt_()
    delta = acc_delta.add(eps).sqrt_().div_(std).mul_(g)
    acc_delta.mul_(rho).addcmul_(delta, delta, value=1 - rho)
    settle(acc_delta)
    p.add_(delta, alpha=-lr)


class NpuFusedAdadelta(CombinedOptimizer):
    """Adadelta with torch.optim.Adadelta's semantics, fused over combined buffers.

    Args: params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0 (state: step, square_avg, acc_delta).
    """

    _gather_grads = True  # the kernel reads grads only through OptArgs

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0):
        defaults = dict(
            lr=lr, rho=rho, eps=eps, weight_decay=weight_decay,
            maximize=False, capturable=False, foreach=None, differentiable=False,
        )
        self._validate_group(defaults)
        super().__init__(params, defaults)

    def _validate_group(self, group: dict) -> None:
        _check_range("learning rate", group["lr"], 0.0)
        _check_range("rho value", group["rho"], 0.0, 1.0, hi_open=False)
        _check_range("epsilon value", group["eps"], 0.0)
        _check_range("weight_decay value", group["weight_decay"], 0.0)

    def _state_names(self, group: dict) -> List[str]:
        return ["square_avg", "acc_delta"]

    @staticmethod
    def _hp(group: dict) -> List[float]:
        return [float(group[k]) for k in ("lr", "rho", "eps", "weight_decay")]

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        _core.ext._raw_adadelta_step(self._prepare_args(s, self._hp(group)))

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        lr, rho, eps, weight_decay = self._hp(group)
        settle = settler(s.dtype)

        def update(p, g, states, _):
            adadelta_math(p, g, *states, lr=lr, rho=rho, eps=eps, weight_decay=weight_decay,
                          grad_scale=self._grad_scale(), settle=settle)

        self._update_runs(s, ["square_avg", "acc_delta"], update)
        self.last_executor = "torch"
