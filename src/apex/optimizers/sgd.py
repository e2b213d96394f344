"""NpuFusedSGD: torch.optim.SGD's math (momentum, dampening, Nesterov, L2 decay) on combined buffers."""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.optim.optimizer import required

from .. import _core
from ._base import CombinedOptimizer, _check_range, check_flags
from ._flat import FlatSet
from ._functional import l2_grad, settler

# devices whose torch has a fused SGD kernel (CPU since torch 2.4); used by the torch executor
_FUSED_SGD = getattr(torch, "_fused_sgd_", None)


def sgd_math(p, g, buf, *, lr, momentum, dampening, weight_decay, nesterov, first, grad_scale, settle):
    """One SGD update on fp32 tensors (in place); torch.optim.SGD's formulas.

    ``buf`` is the momentum buffer (None when momentum is 0); ``first`` means it
    has never been written, and torch then starts it as the gradient itself,
    without dampening. ``settle(t)`` rounds a state tensor through its storage
    dtype in place, so the update reads the buffer as stored (as the kernel does).
    """
    d = l2_grad(g, p, grad_scale, weight_decay)
    if buf is not None:
        if first:
            buf.copy_(d)
        else:
            buf.mul_(momentum).add_(d, alpha=1 - dampening)
        settle(buf)
        d = d.add(buf, alpha=momentum) if nesterov else buf
    p.add_(d, alpha=-lr)


def split_by_first(s: FlatSet, k: int, j: int):
    """(lo, hi, first) element ranges of segments k..j-1 grouped by their first-update flag."""
    first = s.first[k:j].tolist()
    out, a = [], 0
    while a < len(first):
        b = a + 1
        while b < len(first) and first[b] == first[a]:
            b += 1
        out.append((s.offsets[k + a], s.offsets[k + b] if k + b < s.nseg else s.total, bool(first[a])))
        a = b
    return out


class NpuFusedSGD(CombinedOptimizer):
    """SGD with torch.optim.SGD's semantics, fused over combined buffers.

    Args: params, lr (required), momentum=0, dampening=0, weight_decay=0, nesterov=False
    (the NPU patch's signature). ``state[p]`` holds ``momentum_buffer`` only when momentum
    is non-zero; its first value is the (decayed) gradient itself, as in torch.
    """

    _gather_grads = True  # the kernel reads grads only through OptArgs

    _has_step = False  # torch's SGD keeps no step count

    def __init__(self, params, lr=required, momentum=0, dampening=0, weight_decay=0, nesterov=False):
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
            maximize=False, foreach=None, differentiable=False, fused=None,
        )
        self._validate_group(defaults)
        super().__init__(params, defaults)

    def _validate_group(self, group: dict) -> None:
        if group["lr"] is not required:  # a missing lr is reported by torch.optim.Optimizer
            _check_range("learning rate", group["lr"], 0.0)
        _check_range("momentum value", group["momentum"], 0.0)
        _check_range("dampening value", group["dampening"], float("-inf"))
        _check_range("weight_decay value", group["weight_decay"], 0.0)
        check_flags(group)  # nesterov is read just below
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(
                "Nesterov momentum requires a momentum and zero dampening: expected momentum > 0 and "
                f"dampening == 0, got momentum={group['momentum']}, dampening={group['dampening']}"
            )

    def _state_names(self, group: dict) -> List[str]:
        return ["momentum_buffer"] if group["momentum"] != 0 else []

    def _hp(self, group: dict) -> List[float]:
        return [float(group[k]) for k in ("lr", "momentum", "dampening", "weight_decay")]

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        flags = _core.ext.FLAG_NESTEROV if group["nesterov"] else 0
        _core.ext._raw_sgd_step(self._prepare_args(s, self._hp(group), flags))

    def _torch_fused_ok(self, s: FlatSet) -> bool:
        return _FUSED_SGD is not None and super()._torch_fused_ok(s)

    def _torch_gather_ok(self, s: FlatSet, group: dict) -> bool:
        return self._torch_fused_ok(s)

    def _torch_gather_step(self, s: FlatSet, group: dict) -> None:
        """torch's fused SGD over the updated slots (param/buffer views, each grad where it is: read in place or
        the slot view), one call per value of the first-update flag; one call over the whole flat buffers where
        that is the same arithmetic (`FlatSet.flat_call_ok`, and every slot has the same flag)."""
        lr, momentum, dampening, weight_decay = self._hp(group)
        bufs = s.state_views.get("momentum_buffer")
        hp = dict(weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
                  nesterov=bool(group["nesterov"]), maximize=False)
        uniform = s.n_first in (0, s.nseg)  # every slot on the same side of its first update
        if uniform and s.flat_call_ok():
            flat_buf = s.flat_s.get("momentum_buffer")
            _FUSED_SGD([s.flat_p], [s.flat_g], [] if flat_buf is None else [flat_buf],
                       is_first_step=bool(s.n_first) and flat_buf is not None, **hp)
            return
        ks = s.updated_slots()
        grads = s.grads_for(ks)
        if uniform:  # one call
            parts = [(bool(s.n_first), list(range(len(ks))))]
        else:
            first = s.first.tolist()
            parts = [(f, [j for j, k in enumerate(ks) if bool(first[k]) == f]) for f in (False, True)]
        for is_first, sel in parts:
            if not sel:
                continue
            _FUSED_SGD(
                [s.params[ks[j]] for j in sel], [grads[j] for j in sel],
                [] if bufs is None else [bufs[ks[j]] for j in sel],
                is_first_step=is_first and bufs is not None, **hp,
            )

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        lr, momentum, dampening, weight_decay = self._hp(group)
        flat_buf: Optional[torch.Tensor] = s.flat_s.get("momentum_buffer")
        parts = [part for _, _, _, k, j in s.active_runs() for part in split_by_first(s, k, j)]
        # (where torch has a fused SGD for the set, `_update` runs `_torch_gather_step` instead)
        settle = settler(s.dtype)
        for lo, hi, first in parts:
            p = self._f32(s.flat_p[lo:hi])
            buf = None if flat_buf is None else self._f32(flat_buf[lo:hi])
            sgd_math(
                p, self._f32(s.flat_g[lo:hi]), buf, lr=lr, momentum=momentum, dampening=dampening,
                weight_decay=weight_decay, nesterov=group["nesterov"], first=first, grad_scale=self._grad_scale(),
                settle=settle,
            )
            self._write_back(s.flat_p[lo:hi], p)
            if buf is not None:
                self._write_back(flat_buf[lo:hi], buf)

    def state_dict(self) -> dict:
        """torch's layout: without momentum SGD keeps no per-param state, so no empty entries are saved."""
        sd = super().state_dict()
        sd["state"] = {k: v for k, v in sd["state"].items() if v}
        return sd
