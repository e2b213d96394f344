"""Bucketed all-reduce of flat gradient storage, and upstream's manual ``Reducer``.

`BucketedAllReduce` is the engine under both ``DistributedDataParallel`` and
amp's ``combine_ddp``. Gradients live in flat buffers; a *bucket* is an element
range of one buffer (a range may be made of several *parts* when one range
spans tensors of different dtypes, as under amp O2). Each gradient *slot* (one
parameter) overlaps one or more buckets; when every slot of a bucket has
reported ready during a backward pass, the bucket is all-reduced
asynchronously while the rest of the backward runs.

Buckets are launched in one fixed order on every rank (a bucket waits for the
buckets before it in that order even if it is ready earlier): collectives are
matched by the order they are issued, so this is what keeps ranks from reducing
different buckets against each other when grads arrive in a different order.
The order is the expected arrival order (grads of the last parameters first).
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._tensor_utils import forget_read_in_place
from ._comm import check_device_backend, collective, flat_dist_call, group_or_world

__all__ = ["BucketedAllReduce", "GradSlots", "Reducer", "combine_ddp_bucket_elems", "plan_buckets",
           "plan_param_buckets"]

#: the Ascend patch's caps of a combine_ddp bucket, in elements, and its floor
_CAP_4BYTE = 24 * 2**20
_CAP_2BYTE = 48 * 2**20
_MIN_BUCKET = 2**20


def combine_ddp_bucket_elems(numel: int, replica_count: int, element_size: int) -> int:
    """combine_ddp bucket length: numel / ddp_replica_count, at most 24M (4-byte) / 48M (2-byte), at least 1M."""
    cap = _CAP_2BYTE if element_size <= 2 else _CAP_4BYTE
    return max(_MIN_BUCKET, min(cap, math.ceil(numel / max(1, replica_count))))


def plan_buckets(total: int, slots: Sequence[Tuple[int, int]], bucket_elems: int
                 ) -> Tuple[List[Tuple[int, int]], List[List[int]]]:
    """Split [0, total) into ranges of ``bucket_elems``; for each (offset, numel) slot, the buckets it overlaps."""
    if bucket_elems < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_elems}")
    ranges = [(lo, min(lo + bucket_elems, total)) for lo in range(0, total, bucket_elems)]
    slot_buckets = []
    for offset, numel in slots:
        if numel == 0:
            slot_buckets.append([])
        else:
            slot_buckets.append(list(range(offset // bucket_elems, (offset + numel - 1) // bucket_elems + 1)))
    return ranges, slot_buckets


def plan_param_buckets(total: int, slots: Sequence[Tuple[int, int]], min_elems: Optional[int] = None,
                       close_after: Optional[Sequence[int]] = None
                       ) -> Tuple[List[Tuple[int, int]], List[List[int]]]:
    """Buckets of whole slots, in expected arrival order (the last slot first), as element ranges of [0, total).

    ``slots`` are (offset, numel) in layout order (ascending offsets). Walking
    them from the last, a bucket closes once it holds at least ``min_elems``
    elements, or right after a slot whose index is in ``close_after``; what is
    left forms the last bucket. ``min_elems=None`` and no ``close_after``: one
    bucket. A slot is never split, so a slot larger than ``min_elems`` is one
    bucket by itself and there are at most ``len(slots)`` buckets. Each range
    runs from its lowest slot's offset to the next bucket's start (padding
    between slots included; the lowest bucket starts at 0).
    Returns (ranges, per slot the one bucket it is in, ``[]`` for empty slots).
    """
    if min_elems is not None and min_elems < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {min_elems}")
    closing = frozenset(close_after or ())
    groups: List[List[int]] = []
    current: List[int] = []
    size = 0
    for i in range(len(slots) - 1, -1, -1):
        current.append(i)
        size += slots[i][1]
        if (min_elems is not None and size >= min_elems) or i in closing:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    ranges: List[Tuple[int, int]] = []
    slot_buckets: List[List[int]] = [[] for _ in slots]
    hi = total
    for b, group in enumerate(groups):
        lo = 0 if b == len(groups) - 1 else slots[group[-1]][0]
        ranges.append((lo, hi))
        hi = lo
        for i in group:
            if slots[i][1]:
                slot_buckets[i] = [b]
    if not groups and total:
        ranges.append((0, total))
    return ranges, slot_buckets


class BucketedAllReduce:
    """Ordered asynchronous all-reduce of buckets as their slots become ready.

    Args:
        buckets: per bucket, the tensors (contiguous views of flat buffers) to all-reduce.
        slot_buckets: per slot, the indices of the buckets it overlaps.
        order: bucket indices in launch order (a permutation).
        group: process group (None: the default group), or a list of groups used round-robin by bucket
            (upstream's ``num_allreduce_streams``: independent groups can reduce concurrently).
        predivide: each bucket is divided by this before the all-reduce (sum)...
        postscale: ...and multiplied by this after it (upstream DDP: predivide f, postscale f / world size).
        always_fp32: reduce a float32 copy of low-precision buckets (copied back after).
        what: name used in error messages.
        profile: wrap each bucket's launch in a ``torch.profiler.record_function`` range.

    One backward pass: ``begin()``, ``ready(slot)`` for each slot (buckets launch as
    they fill, in order), ``finish()`` (launches the rest and waits for all).
    """

    def __init__(self, buckets: List[List[torch.Tensor]], slot_buckets: List[List[int]], order: Sequence[int], *,
                 group: Any = None, predivide: float = 1.0, postscale: float = 1.0, always_fp32: bool = False,
                 what: str = "gradient all-reduce", profile: bool = False) -> None:
        if sorted(order) != list(range(len(buckets))):
            raise ValueError("order must be a permutation of the bucket indices")
        self.buckets = buckets
        self.slot_buckets = slot_buckets
        self.order = list(order)
        self.groups = list(group) if isinstance(group, (list, tuple)) else [group]
        if not self.groups:
            raise ValueError("at least one process group is needed")
        self.predivide = float(predivide)
        self.postscale = float(postscale)
        self.always_fp32 = always_fp32
        self.what = what
        self.profile = profile
        self._count = [0] * len(buckets)
        for bs in slot_buckets:
            for b in bs:
                self._count[b] += 1
        for parts in buckets:
            for t in parts:
                check_device_backend(t, self.groups[0], what)
        self.active = False
        self._pending: List[int] = []
        self._seen = bytearray()
        self._launched = bytearray()
        self._next = 0
        self._inflight: List[Tuple[int, List[Tuple[torch.Tensor, torch.Tensor, Any]]]] = []

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def begin(self) -> None:
        """Start a pass (any unfinished pass must have been finished)."""
        self._pending = list(self._count)
        self._seen = bytearray(len(self.slot_buckets))
        self._launched = bytearray(len(self.buckets))
        self._next = 0
        self._inflight = []
        self.active = True

    def ready(self, slot: int) -> bool:
        """Slot ``slot`` holds its final gradient for this pass; returns False if the pass is not active."""
        if not self.active:
            return False
        if self._seen[slot]:
            if any(self._launched[b] for b in self.slot_buckets[slot]):
                raise RuntimeError(
                    f"{self.what}: a gradient slot was written again after its bucket's all-reduce started "
                    "(a parameter received gradients twice in one backward pass, e.g. two backward calls over one "
                    "graph). Run one backward per pass, or reduce after all of them (delay_allreduce=True / "
                    "delay_unscale=True)."
                )
            return True
        self._seen[slot] = 1
        pending = self._pending
        for b in self.slot_buckets[slot]:
            pending[b] -= 1
        order, n = self.order, len(self.order)
        while self._next < n and pending[order[self._next]] == 0:
            self._launch(order[self._next])
            self._next += 1
        return True

    def finish(self) -> None:
        """Launch every bucket not launched yet (in order) and wait for all; post-scale the results."""
        if not self.active:
            self.begin()
        try:
            while self._next < len(self.order):
                self._launch(self.order[self._next])
                self._next += 1
            self._drain()
        finally:
            self.active = False
            self._inflight = []

    def run(self) -> None:
        """One whole pass at once: every bucket all-reduced now."""
        self.begin()
        self.finish()

    def launch_all(self) -> None:
        """Launch every bucket not launched yet, without waiting (``finish`` waits)."""
        while self.active and self._next < len(self.order):
            self._launch(self.order[self._next])
            self._next += 1

    def seen(self) -> bytearray:
        """Per slot, whether it reported ready in the current pass."""
        return self._seen

    def abandon(self) -> None:
        """Forget an unfinished pass (its backward raised): the next pass starts clean."""
        self.active = False
        self._inflight = []

    # ------------------------------------------------------------------ internals
    def _launch(self, b: int) -> None:
        self._launched[b] = 1
        group = self.groups[b % len(self.groups)]
        pg = group_or_world(group)
        works = []
        ctx = torch.profiler.record_function(f"apex.parallel allreduce bucket {b}") if self.profile else None
        if ctx is not None:
            ctx.__enter__()
        try:
            for t in self.buckets[b]:
                if t.numel() == 0:
                    continue
                src = t.float() if self.always_fp32 and t.dtype != torch.float32 else t
                if self.predivide != 1.0:
                    src.div_(self.predivide)
                with collective(f"{self.what}: starting the all-reduce of bucket {b} ({t.numel()} {t.dtype} "
                                "elements)", group):
                    work = dist.all_reduce(src, group=pg, async_op=True)
                works.append((t, src, work))
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        self._inflight.append((b, works))

    def _drain(self) -> None:
        for b, works in self._inflight:
            for t, src, work in works:
                with collective(f"{self.what}: the all-reduce of bucket {b} ({t.numel()} {t.dtype} elements)",
                                self.groups[b % len(self.groups)]):
                    work.wait()
                if self.postscale != 1.0:
                    src.mul_(self.postscale)
                if src is not t:
                    t.copy_(src)


def dense_view(flat: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``flat`` at element ``offset`` with ``like``'s shape and dense strides (e.g. channels_last)."""
    stride = torch.empty_like(like, device="meta").stride()
    return flat.as_strided(like.shape, stride, flat.storage_offset() + offset)


class GradSlots:
    """The tensors whose ``.grad`` a reducer owns, and the flat views those grads must be.

    ``bind(i)`` makes ``tensors[i].grad`` the slot view (copying a grad that lives
    elsewhere, e.g. a fresh one after ``zero_grad(set_to_none=True)``), so the
    bucket all-reduce works on the flat buffer in place.
    """

    def __init__(self, tensors: List[torch.Tensor], flats: List[torch.Tensor], offsets: List[int],
                 views: Optional[List[Optional[torch.Tensor]]] = None) -> None:
        self.tensors = tensors
        self.flats = flats
        self.offsets = offsets
        self.views: List[Optional[torch.Tensor]] = list(views) if views is not None else [None] * len(tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def view(self, i: int) -> torch.Tensor:
        v = self.views[i]
        if v is None:
            v = self.views[i] = dense_view(self.flats[i], self.tensors[i], self.offsets[i])
        return v

    def bind(self, i: int) -> bool:
        """``tensors[i].grad`` becomes the slot view (values kept); False if it has no grad."""
        t = self.tensors[i]
        g = t.grad
        if g is None:
            return False
        v = self.views[i]
        if g is not v:
            v = self.view(i)
            if g.data_ptr() != v.data_ptr() or g.stride() != v.stride():
                with torch.no_grad():
                    v.copy_(g)
            forget_read_in_place(v)  # bound again, not kept: an optimizer reads it in place rather than adopt it
            t.grad = v
        return True

    def settle(self, seen: Optional[bytearray]) -> List[int]:
        """Before the remaining buckets launch: bind the grads not reported this pass; zero the slots of
        tensors without a grad (their stale contents must not enter the sum). Returns those slots."""
        missing = []
        for i, t in enumerate(self.tensors):
            if seen is not None and seen[i]:
                continue
            if t.grad is None:
                if t.numel():
                    with torch.no_grad():
                        self.view(i).zero_()
                missing.append(i)
            else:
                self.bind(i)
        return missing

    def agree_usage(self, missing: List[int], group: Any, what: str) -> None:
        """A tensor without a grad here but with one on another rank gets the reduced slot as its grad,
        so every rank steps the same params; one that has no grad anywhere keeps ``grad is None``."""
        if dist.get_world_size(group_or_world(group)) == 1:
            return
        device = self.flats[0].device if self.flats else torch.device("cpu")
        used = torch.ones(len(self.tensors), dtype=torch.uint8, device=device)
        if missing:
            used[torch.tensor(missing, dtype=torch.long, device=device)] = 0
        with collective(f"{what}: agreeing which parameters received gradients", group):
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=group_or_world(group))
        if not missing:
            return
        flags = used.tolist()
        for i in missing:
            if flags[i]:
                self.tensors[i].grad = self.view(i)


class Reducer:
    """Manual all-reduce of gradients (upstream ``apex.parallel.Reducer``).

    ``Reducer(module)`` broadcasts the module's parameters from rank 0 at
    construction; ``reducer.reduce()`` then averages the grads of its
    parameters over the ranks. ``Reducer(list_of_grads)`` keeps the given
    tensors and averages them in place on ``reduce()`` (synchronising the
    parameters is then the caller's job). Tensors travel through flat buffers,
    one per dtype x device (split into chunks).
    """

    def __init__(self, module_or_grads_list: Any, process_group: Any = None) -> None:
        from ._comm import agree_layout, broadcast_tensors, check_process_group, layout_of, require_initialized

        check_process_group(process_group, "apex.parallel.Reducer: process_group")
        module: Optional[torch.nn.Module] = None
        grads: Optional[List[torch.Tensor]] = None
        if isinstance(module_or_grads_list, torch.nn.Module):
            module = module_or_grads_list
        else:
            try:
                grads = list(module_or_grads_list)
            except TypeError:
                raise TypeError(f"Reducer expects a torch.nn.Module or an iterable of gradient tensors, got "
                                f"{type(module_or_grads_list).__name__}") from None
            for i, g in enumerate(grads):
                if not isinstance(g, torch.Tensor):
                    raise TypeError(f"Reducer: entry {i} of the gradient list is {type(g).__name__}, not a tensor")
        require_initialized("apex.parallel.Reducer")
        # The flat buffers of the broadcast and of every reduce() are sized by these tensors: ranks holding
        # different ones would run collectives of different sizes, which gloo answers by terminating the process.
        if module is not None:
            named = list(module.named_parameters())
            noun = "parameter"
        else:
            named = [(f"tensor {i}", g) for i, g in enumerate(grads)]
            noun = "gradient tensor"
        agree_layout(layout_of(named), "apex.parallel.Reducer", noun=noun, group=process_group,
                     hint=" (the same parameters, or gradient tensors of the same shapes and dtypes, in the same "
                          "order)")
        self.process_group = process_group
        self.module = module
        self.grads = grads
        if module is not None:
            with torch.no_grad():
                broadcast_tensors([p.detach() for _, p in named], 0, process_group,
                                  what="apex.parallel.Reducer: broadcasting the parameters from rank 0")

    def reduce(self) -> None:
        """Average the gradients over all ranks (in place)."""
        from ._comm import agree_layout, layout_of

        if self.module is not None:
            named = [(name, p.grad) for name, p in self.module.named_parameters() if p.grad is not None]
            # which parameters have a gradient can differ between ranks (a branch taken on one rank only); the
            # reduced buffers would then differ in size, so the ranks compare them first (one small all-reduce)
            agree_layout(layout_of(named), "apex.parallel.Reducer.reduce", noun="gradient", group=self.process_group,
                         hint=" (every rank must produce gradients for the same parameters before reduce())")
            grads = [g for _, g in named]
        else:
            grads = self.grads
        with torch.no_grad():
            flat_dist_call([g.detach() for g in grads], dist.all_reduce, group=self.process_group,
                           what="apex.parallel.Reducer.reduce")
