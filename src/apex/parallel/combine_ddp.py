"""amp's ``combine_ddp``: data parallelism on the combined gradient buffers, without wrapping the model.

``amp.initialize(..., combine_grad=True, combine_ddp=True, ddp_replica_count=N)``
creates one `CombineDDP` for the session (through ``apex.amp._ddp``). It:

* at initialize: checks that every rank holds the same model (names, shapes and
  dtypes of the state_dict entries; a mismatch raises on every rank, naming the
  first differing entry) and broadcasts params and buffers from rank 0;
* at the first ``scale_loss`` exit (when amp has built the flat grad buffers) and
  whenever amp rebuilds them: checks that every rank has the same buffer layout
  (slot offsets and lengths; the error names the first differing parameter);
* splits each flat buffer into buckets of numel / ddp_replica_count elements
  (at most 24M for 4-byte, 48M for 2-byte elements, at least 1M); under O2 the
  buckets cover the low-precision model-grad buffers, so grads are reduced in
  the dtype they were computed in;
* in a backward under ``scale_loss`` (not ``delay_unscale``), all-reduces each
  bucket, pre-divided by the world size, as soon as its grads are complete
  (``register_post_accumulate_grad_hook``), overlapping the rest of the backward,
  and waits for all of them when the backward ends; a backward with
  ``delay_unscale=True`` reduces nothing (the accumulated grads are reduced with
  the last backward of the step), and an exit whose backward did not run armed
  reduces the buffers right there;
* agrees on overflow: the inf/nan flag of the unscale is all-reduced, so every
  rank skips the same steps.

The all-reduce is linear, so reducing grads that already hold reduced values
(accumulation without ``delay_unscale``) is still exact up to rounding.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._comm import (
    agree_layout,
    any_across_ranks,
    broadcast_tensors,
    check_device_backend,
    collective,
    layout_of,
    require_initialized,
    world_size,
)
from .reducer import BucketedAllReduce, GradSlots, combine_ddp_bucket_elems, plan_buckets

__all__ = ["CombineDDP"]

logger = logging.getLogger("apex.parallel")

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_WHAT = "amp combine_ddp"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class _Plan:
    """Buckets, slots and hook routing for one optimizer's combined grad buffers (amp's CombinedGrads)."""

    def __init__(self, owner: CombineDDP, combined: Any) -> None:
        self.owner = owner
        self.combined = combined
        self.buffers = list(combined.buffers)
        self.flats = [b.flat for b in self.buffers]
        tensors: List[torch.Tensor] = []
        flats: List[torch.Tensor] = []
        offsets: List[int] = []
        views: List[Optional[torch.Tensor]] = []
        self.main_slots: List[Tuple[int, Any, int]] = []  # (slot, buffer, index) of params that are own masters
        buckets: List[List[torch.Tensor]] = []
        slot_buckets: List[List[int]] = []
        bucket_pos: List[int] = []
        entries = []
        for k, b in enumerate(self.buffers):
            total = b.flat.numel()
            reduced = [b.flat] + [low.flat for low in b.lows.values()]
            size = min(t.element_size() for t in reduced)
            elems = combine_ddp_bucket_elems(total, owner.replicas, size)
            ranges, sb = plan_buckets(total, [(off, p.numel()) for p, off in zip(b.params, b.offsets)], elems)
            base = len(buckets)
            for lo, hi in ranges:
                parts = []
                for kind, rlo, rhi in b.runs:
                    a, z = max(lo, rlo), min(hi, rhi)
                    if a < z:
                        src = b.flat if kind is None else b.lows[kind].flat
                        parts.append(src[a:z])
                buckets.append(parts)
                bucket_pos.append(-1)
            for i, (p, off) in enumerate(zip(b.params, b.offsets)):
                model = b.models[i]
                if model is None:
                    t, flat, view = p, b.flat, b.views[i]
                    self.main_slots.append((len(tensors), b, i))
                else:
                    low = b.lows[model.dtype]
                    t, flat, view = model, low.flat, low.views[i]
                pos = owner.position(t)
                slot_buckets.append([base + j for j in sb[i]])
                for j in sb[i]:
                    cur = bucket_pos[base + j]
                    bucket_pos[base + j] = pos if cur < 0 else min(cur, pos)
                tensors.append(t)
                flats.append(flat)
                offsets.append(off)
                views.append(view)
                # slot lengths in order fix the offsets too (plan_layout)
                entries.append((f"buffer {k}: {owner.name(t)}", (p.numel(),), _dtype_name(flat.dtype)))
            entries.append((f"end of buffer {k}", (total,), _dtype_name(b.flat.dtype)))
        order = sorted(range(len(buckets)), key=lambda j: (-bucket_pos[j], -j))
        self.entries = entries
        self.slots = GradSlots(tensors, flats, offsets, views)
        self.engine = BucketedAllReduce(buckets, slot_buckets, order, predivide=float(owner.world), what=_WHAT)
        self.armed = False
        self.queued = False
        self.reduced = False

    def matches(self, combined: Any) -> bool:
        bufs = combined.buffers
        return (bufs is not None and len(bufs) == len(self.buffers)
                and all(a is b and a.flat is f for a, b, f in zip(bufs, self.buffers, self.flats)))

    def refresh_views(self) -> None:
        """Follow amp's current view objects (an apex optimizer may have re-bound its grads)."""
        views = self.slots.views
        for slot, b, i in self.main_slots:
            v = b.views[i]
            if v is not None:
                views[slot] = v

    def arm(self) -> None:
        if self.engine.active:
            self.engine.abandon()  # an earlier backward raised before it ended
        self.refresh_views()
        self.engine.begin()
        self.armed = True
        self.queued = False
        self.reduced = False

    def on_grad(self, slot: int) -> None:
        self.slots.bind(slot)
        self.engine.ready(slot)
        if not self.queued:
            self.queued = True
            _queue_callback(self.end_of_backward)

    def end_of_backward(self) -> None:
        try:
            missing = self.slots.settle(self.engine.seen())
            self.engine.finish()
            self.slots.agree_usage(missing, None, _WHAT)
            self.reduced = True
        finally:
            self.armed = False
            self.queued = False
            self.engine.abandon()

    def reduce_now(self) -> None:
        self.refresh_views()
        missing = self.slots.settle(None)
        self.engine.run()
        self.slots.agree_usage(missing, None, _WHAT)

    def reduce_stashes(self) -> None:
        """fp16 buffers whose earlier grads amp keeps aside in fp32 (see amp._combined): reduce those too."""
        for b in self.buffers:
            stash = getattr(b, "stash", None)
            if stash is not None:
                stash.div_(self.owner.world)
                with collective(f"{_WHAT}: the all-reduce of a stashed gradient buffer ({stash.numel()} elements)"):
                    dist.all_reduce(stash)


class CombineDDP:
    """The combine_ddp backend of one amp session (see the module docstring and ``apex.amp._ddp``)."""

    def __init__(self, session: Any) -> None:
        require_initialized("amp.initialize(combine_ddp=True)")
        self.world = world_size()
        self.replicas = int(session.ddp_replica_count)
        models = list(session.models)
        prefix = len(models) > 1
        named: List[Tuple[str, torch.Tensor]] = []
        self._names: Dict[int, str] = {}
        self._positions: Dict[int, int] = {}
        for m, model in enumerate(models):
            for name, t in model.state_dict(keep_vars=True).items():
                if torch.is_tensor(t):
                    named.append((f"model{m}.{name}" if prefix else name, t))
            for name, p in model.named_parameters():
                if id(p) not in self._names:
                    self._names[id(p)] = f"model{m}.{name}" if prefix else name
                    self._positions[id(p)] = len(self._positions)
        if named:
            check_device_backend(named[0][1], None, "amp.initialize(combine_ddp=True)")
        with torch.no_grad():
            agree_layout(layout_of(named), "amp.initialize(combine_ddp=True)", noun="state_dict entry",
                         hint=" (same parameters and buffers, in the same order)")
            broadcast_tensors([t.detach() for _, t in named], 0, None,
                              what="amp.initialize(combine_ddp=True): broadcasting params and buffers from rank 0")
        self._plans: Dict[int, _Plan] = {}
        self._route: Dict[int, List[Tuple[_Plan, int]]] = {}
        self._hooks: Dict[int, Any] = {}

    # ------------------------------------------------------------------ names, plans, hooks
    def name(self, t: torch.Tensor) -> str:
        return self._names.get(id(t), f"<unnamed {tuple(t.shape)} {_dtype_name(t.dtype)}>")

    def position(self, t: torch.Tensor) -> int:
        return self._positions.get(id(t), -1)

    def _plan_for(self, combined: Any) -> _Plan:
        plan = self._plans.get(id(combined))
        if plan is not None and plan.matches(combined):
            return plan
        new = _Plan(self, combined)
        agree_layout(new.entries, f"{_WHAT}: the combined gradient buffers", noun="gradient slot",
                     hint=" and give its optimizers the same param groups")
        if plan is not None:
            for t in plan.slots.tensors:
                routes = self._route.get(id(t), [])
                self._route[id(t)] = [r for r in routes if r[0] is not plan]
        self._plans[id(combined)] = new
        for slot, t in enumerate(new.slots.tensors):
            self._route.setdefault(id(t), []).append((new, slot))
            if id(t) not in self._hooks and t.requires_grad:
                self._hooks[id(t)] = t.register_post_accumulate_grad_hook(self._on_grad)
        return new

    def _on_grad(self, t: torch.Tensor) -> None:
        for plan, slot in self._route.get(id(t), ()):
            if plan.armed:
                plan.on_grad(slot)

    # ------------------------------------------------------------------ amp protocol (apex.amp._ddp)
    def before_backward(self, combined: Sequence[Any], delay_unscale: bool) -> None:
        """scale_loss entry, after amp prepared the grads: arm the buckets of these optimizers' buffers."""
        for c in combined:
            if c is None or not c.built:
                continue  # the first backward's grads are combined at its exit, and reduced there
            plan = self._plan_for(c)
            if delay_unscale:
                plan.armed = False
            else:
                plan.arm()

    def before_unscale(self, combined: Any) -> None:
        """scale_loss exit, grads combined, before the unscale: make sure the buffers are reduced."""
        plan = self._plan_for(combined)
        if not plan.reduced:
            if plan.engine.active:
                plan.engine.abandon()
            plan.reduce_now()
        plan.reduced = False
        plan.armed = False
        plan.reduce_stashes()

    def agree_overflow(self, found: bool) -> bool:
        """True on every rank if any rank found inf/nan: all ranks skip the step together."""
        return any_across_ranks(found, None, f"{_WHAT}: agreeing on gradient overflow")

    def teardown(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._route.clear()
        self._plans.clear()
