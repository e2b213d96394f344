"""Combined (flat) storage for one param group x dtype x device.

A `FlatSet` owns one flat buffer each for params, grads and every optimizer
state, laid out by `plan_layout`. Params, grads and ``optimizer.state[p]``
entries are rebound as views into those buffers, so a kernel can update every
tensor of the group in one pass while user code and ``state_dict`` keep seeing
ordinary per-parameter tensors.

Sharing can be broken from outside (``p.data = ...``, ``p.grad = new``,
``model.to(...)``, ``zero_grad(set_to_none=True)`` followed by backward). Every
step starts with `FlatSet.check()`, which finds that cheaply (object identity of
grads, one data_ptr per param) and heals it before any update is made.
"""

from __future__ import annotations

import operator
from typing import Dict, List, Optional, Sequence

import torch

from .. import _core
from ..contrib.combine_tensors import combine_tensors, plan_layout

_get_grad = operator.attrgetter("grad")
_data_ptr = torch.Tensor.data_ptr


def view_like(flat: torch.Tensor, offset: int, ref: torch.Tensor) -> torch.Tensor:
    """A view of `flat` at element `offset` with `ref`'s shape and strides."""
    return torch.as_strided(flat, ref.shape, ref.stride(), flat.storage_offset() + offset)


class FlatSet:
    """Flat buffers and per-segment bookkeeping for the params of one group/dtype/device."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        state: Dict[torch.Tensor, dict],
        state_names: Sequence[str],
        state_fill: Dict[str, float],
        has_step: bool,
    ):
        self.params: List[torch.Tensor] = list(params)
        p0 = self.params[0]
        self.dtype, self.device = p0.dtype, p0.device
        self.offsets, self.total = plan_layout(self.params)
        self.nseg = len(self.params)
        self.has_step = has_step
        self.state_names = list(state_names)

        # params: rebound in place, values kept
        self.flat_p = combine_tensors(self.params, require_copy_value=True)

        # grads: params without a grad keep `grad is None` (torch's skip rule)
        self.flat_g = torch.zeros(self.total, dtype=self.dtype, device=self.device)
        self.grad_views = [view_like(self.flat_g, off, p) for p, off in zip(self.params, self.offsets)]
        for p, gv in zip(self.params, self.grad_views):
            if p.grad is not None:
                self._adopt_grad(p, gv)

        # states: values of existing entries (from earlier steps or a loaded state_dict) are kept
        self.flat_s: Dict[str, torch.Tensor] = {}
        self.exposed = [bool(state.get(p)) for p in self.params]
        for name in self.state_names:
            fill = state_fill.get(name, 0.0)
            flat = torch.full((self.total,), fill, dtype=self.dtype, device=self.device)
            if fill != 0.0:
                self._zero_padding(flat)
            self.flat_s[name] = flat
            for k, p in enumerate(self.params):
                st = state.get(p)
                view = view_like(flat, self.offsets[k], p)
                old = st.get(name) if st else None
                if isinstance(old, torch.Tensor):
                    view.copy_(old.reshape(p.shape))
                if self.exposed[k]:
                    st[name] = view

        seg = [*self.offsets, self.total]
        self.seg = torch.tensor(seg, dtype=torch.int64)
        self.steps = torch.zeros(self.nseg, dtype=torch.float32)
        if has_step:
            for k, p in enumerate(self.params):
                st = state.get(p)
                if st and "step" in st:
                    self.steps[k] = float(st["step"])
                if self.exposed[k]:
                    st["step"] = self.steps[k]
        self.skip = torch.zeros(self.nseg, dtype=torch.uint8)
        self.first = torch.tensor([0 if e else 1 for e in self.exposed], dtype=torch.uint8)

        self.param_ptrs = list(map(_data_ptr, self.params))
        self.expected_grads: List[Optional[torch.Tensor]] = list(map(_get_grad, self.params))
        self.n_skipped = sum(g is None for g in self.expected_grads)
        self._refresh_skip()
        self.uses_kernel = _core.uses_kernel(self.flat_p)
        self.args = self._make_args() if self.uses_kernel else None

        # O2: low-precision model copies written by the same pass (see attach_out)
        self.out_params: Optional[List[torch.Tensor]] = None
        self.flat_out: Optional[torch.Tensor] = None
        self.out_ptrs: Optional[List[int]] = None

    # -- construction helpers -------------------------------------------------
    def _zero_padding(self, flat: torch.Tensor) -> None:
        ends = [off + p.numel() for off, p in zip(self.offsets, self.params)]
        starts = [*self.offsets[1:], self.total]
        for a, b in zip(ends, starts):
            if b > a:
                flat[a:b].zero_()

    def _adopt_grad(self, p: torch.Tensor, gv: torch.Tensor) -> None:
        g = p.grad
        if g.is_sparse:
            raise RuntimeError("apex fused optimizers do not support sparse gradients")
        if g.shape != p.shape:
            raise RuntimeError(f"grad of shape {tuple(g.shape)} does not match param of shape {tuple(p.shape)}")
        gv.copy_(g)
        p.grad = gv

    def _make_args(self):
        a = _core.ext.OptArgs()
        code = _core.DTYPE_CODES[self.dtype]
        a.p, a.g = self.flat_p.data_ptr(), self.flat_g.data_ptr()
        a.pdt = a.gdt = a.sdt = code
        names = self.state_names
        a.s0 = self.flat_s[names[0]].data_ptr() if len(names) > 0 else 0
        a.s1 = self.flat_s[names[1]].data_ptr() if len(names) > 1 else 0
        a.s2 = self.flat_s[names[2]].data_ptr() if len(names) > 2 else 0
        a.seg = self.seg.data_ptr()
        a.nseg = self.nseg
        a.steps = self.steps.data_ptr()
        a.first = self.first.data_ptr()
        return a

    def _refresh_skip(self) -> None:
        if self.n_skipped:
            self.skip.copy_(torch.tensor([g is None for g in self.expected_grads], dtype=torch.uint8))
        else:
            self.skip.zero_()

    # -- per-step checks ------------------------------------------------------
    def params_intact(self) -> bool:
        """Every param still lives at its slot (catches p.data = ..., model.to(...))."""
        return list(map(_data_ptr, self.params)) == self.param_ptrs and all(
            p.dtype == self.dtype and p.device == self.device for p in (self.params[0], self.params[-1])
        )

    def sync_grads(self) -> int:
        """Re-binds grads that are not our views; returns how many were adopted.

        Fast path: every `p.grad` is the same object as after the previous step.
        """
        grads = list(map(_get_grad, self.params))
        if all(map(operator.is_, grads, self.expected_grads)):
            return 0
        adopted = 0
        for k, (p, g) in enumerate(zip(self.params, grads)):
            gv = self.grad_views[k]
            if g is None or g is gv:
                continue
            if g.dtype != self.dtype or g.device != self.device:
                raise RuntimeError(
                    f"grad of param {k} has dtype {g.dtype} on {g.device}; expected {self.dtype} on {self.device}"
                )
            self._adopt_grad(p, gv)
            adopted += 1
        self.expected_grads = list(map(_get_grad, self.params))
        self.n_skipped = sum(g is None for g in self.expected_grads)
        self._refresh_skip()
        return adopted

    def out_intact(self) -> bool:
        return self.out_params is None or list(map(_data_ptr, self.out_params)) == self.out_ptrs

    def attach_out(self, models: Optional[List[torch.Tensor]]) -> None:
        """Combine low-precision model copies of the params (same layout) for fused O2 copies."""
        self.out_params, self.flat_out, self.out_ptrs = None, None, None
        if self.args is not None:
            self.args.out = 0
        if models is None:
            return
        self.out_params = list(models)
        self.flat_out = combine_tensors(self.out_params, require_copy_value=True)
        self.out_ptrs = list(map(_data_ptr, self.out_params))
        code = _core.DTYPE_CODES.get(self.flat_out.dtype)
        if (
            self.args is not None
            and self.dtype == torch.float32
            and code in (1, 2)
            and self.flat_out.device.type == "cpu"
        ):
            self.args.out = self.flat_out.data_ptr()
            self.args.odt = code

    def copy_out(self) -> None:
        """Model copies for executors that could not fuse them."""
        if self.flat_out is not None and (self.args is None or self.args.out == 0):
            self.flat_out.copy_(self.flat_p)

    # -- after a step -----------------------------------------------------------
    def advance_steps(self) -> None:
        if self.n_skipped:
            self.steps.add_((self.skip == 0).to(torch.float32))
        else:
            self.steps.add_(1.0)

    def expose_new_states(self, state: Dict[torch.Tensor, dict]) -> None:
        """Creates state[p] entries for params updated for the first time (torch's lazy init)."""
        if all(self.exposed):
            return
        for k, p in enumerate(self.params):
            if self.exposed[k] or self.expected_grads[k] is None:
                continue
            st = state[p]
            if self.has_step:
                st["step"] = self.steps[k]
            for name in self.state_names:
                st[name] = view_like(self.flat_s[name], self.offsets[k], p)
            self.exposed[k] = True
            self.first[k] = 0

    def active_runs(self):
        """(lo, hi, step) element ranges of consecutive updated segments sharing one step count."""
        runs = []
        steps = self.steps.tolist()
        skip = self.skip.tolist() if self.n_skipped else None
        bounds = [*self.offsets, self.total]
        k = 0
        while k < self.nseg:
            if skip is not None and skip[k]:
                k += 1
                continue
            j = k + 1
            while j < self.nseg and (skip is None or not skip[j]) and steps[j] == steps[k]:
                j += 1
            runs.append((bounds[k], bounds[j], steps[k], k, j))
            k = j
        return runs
