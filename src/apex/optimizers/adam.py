"""NpuFusedAdam / NpuFusedAdamW: torch.optim.Adam(W) math on combined buffers.

Executors: the apex_C kernel on CPU (one pass); elsewhere torch's own fused
Adam(W) op for fp32 sets where the device has one (`fused_adam`: one call over
the updated slots, or over the whole flat buffers where that is the same
arithmetic), else the torch ops of `adam_math`.
Low-precision sets never use torch's fused op: it updates the param from its
fp32 moments before rounding them, while torch.optim's for-loop and foreach
paths (and our kernel) read the moments back as stored; results would differ
by more than an ulp for small params.
"""

from __future__ import annotations

from typing import List

import torch

from .. import _core, _device
from ._base import CombinedOptimizer, _check_adam_group
from ._flat import FlatSet
from ._functional import adam_math, settler


def fused_adam(s: FlatSet, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               amsgrad: bool, decoupled: bool) -> None:
    """torch's fused Adam(W) over the updated slots of `s`, at the step counts in ``s.steps``: param and state
    views, each grad where it is (read in place, or the slot view).

    Where `FlatSet.flat_call_ok` and every slot is at one step count, it is one call over the whole flat
    buffers: the same arithmetic on every element, with the host cost of one tensor instead of one per param
    (`FlatSet.zero_padding` re-zeroes the gaps after it anyway).
    """
    op = torch._fused_adamw_ if decoupled else torch._fused_adam_
    hp = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=False)
    ks = s.updated_slots()
    if not ks:
        return
    steps = s.steps[ks] if s.n_skipped else s.steps
    if bool((steps == steps[0]).all()):
        # one step count (the usual case): one device scalar serves every slot, which torch's op only reads
        step = _device.host_scalars_to(steps[:1], s.device).reshape(())
        if s.flat_call_ok():
            fs = s.flat_s
            op([s.flat_p], [s.flat_g], [fs["exp_avg"]], [fs["exp_avg_sq"]],
               [fs["max_exp_avg_sq"]] if amsgrad else [], [step], **hp)
            return
        step_list = [step] * len(ks)
    else:
        step_list = list(_device.host_scalars_to(steps, s.device).unbind())
    views = s.state_views
    op(
        [s.params[k] for k in ks], s.grads_for(ks), [views["exp_avg"][k] for k in ks],
        [views["exp_avg_sq"][k] for k in ks], [views["max_exp_avg_sq"][k] for k in ks] if amsgrad else [],
        step_list, **hp,
    )


class NpuFusedAdam(CombinedOptimizer):
    """Adam (Kingma & Ba) with torch.optim.Adam's semantics, fused over combined buffers.

    Args: params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False.
    Params: float32, float16 or bfloat16 (states in the param dtype, math in float32).
    Complex params raise TypeError (torch.optim.Adam views them as real pairs: pass
    ``torch.view_as_real(p)`` to get the same math). maximize/capturable/differentiable
    are not implemented and rejected when a loaded state_dict sets them.
    """

    _gather_grads = True  # the kernel reads grads only through OptArgs

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
            decoupled_weight_decay=self._decoupled,
        )
        self._validate_group(defaults)
        super().__init__(params, defaults)

    def _validate_group(self, group: dict) -> None:
        _check_adam_group(group)
        if bool(group.get("decoupled_weight_decay", self._decoupled)) != self._decoupled:
            other = "NpuFusedAdamW" if not self._decoupled else "NpuFusedAdam"
            raise ValueError(
                f"{type(self).__name__} has decoupled_weight_decay={self._decoupled}; got "
                f"{group.get('decoupled_weight_decay')!r} (use {other})"
            )

    def _state_names(self, group: dict) -> List[str]:
        names = ["exp_avg", "exp_avg_sq"]
        if group["amsgrad"]:
            names.append("max_exp_avg_sq")
        return names

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        b1, b2 = group["betas"]
        flags = (_core.ext.FLAG_AMSGRAD if group["amsgrad"] else 0) | (
            _core.ext.FLAG_DECOUPLED if self._decoupled else 0
        )
        a = self._prepare_args(s, [float(group["lr"]), b1, b2, group["eps"], group["weight_decay"]], flags)
        _core.ext._raw_adam_step(a)

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        # (where torch has a fused Adam for the set, `_update` runs `_torch_gather_step` instead)
        b1, b2 = group["betas"]
        amsgrad = group["amsgrad"]
        lr = float(group["lr"])
        settle = settler(s.dtype)

        def update(p, g, states, step):
            adam_math(
                p, g, *states, lr=lr, beta1=b1, beta2=b2, eps=group["eps"],
                weight_decay=group["weight_decay"], step=step, amsgrad=amsgrad, decoupled=self._decoupled,
                grad_scale=self._grad_scale(), settle=settle,
            )

        self._update_runs(s, ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"], update)

    def _torch_gather_ok(self, s: FlatSet, group: dict) -> bool:
        return self._torch_fused_ok(s)

    def _torch_gather_step(self, s: FlatSet, group: dict) -> None:
        b1, b2 = group["betas"]
        fused_adam(s, lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"],
                   weight_decay=group["weight_decay"], amsgrad=group["amsgrad"], decoupled=self._decoupled)


class NpuFusedAdamW(NpuFusedAdam):
    """AdamW (decoupled weight decay) with torch.optim.AdamW's semantics and defaults (weight_decay=1e-2)."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
