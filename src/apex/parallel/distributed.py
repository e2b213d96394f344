"""``apex.parallel.DistributedDataParallel``: upstream apex's DDP on torch.distributed, over flat grad buffers.

Semantics kept from upstream apex: parameters and buffers are broadcast from
rank 0 at construction; during backward, gradients are all-reduced in buckets as
soon as a bucket's gradients are complete (``delay_allreduce=True``: everything
after the backward instead). Buckets hold whole parameters, taken in expected
arrival order (the last parameters first); ``message_size`` is the *minimum*
bucket size: a bucket closes once it holds at least that many elements, so a
parameter is never split and there are at most as many buckets as parameters.
With ``allreduce_trigger_params`` the bucket boundaries are those params
instead (a bucket closes after each of them; the rest is reduced at the end of
the backward) and ``message_size`` is ignored. Each bucket is divided by
``gradient_predivide_factor`` before the all-reduce and, with
``gradient_average``, multiplied by ``gradient_predivide_factor / world_size``
after it; ``allreduce_always_fp32`` reduces a float32 copy of low-precision
buckets; ``num_allreduce_streams`` / ``allreduce_communicators`` spread buckets
over several process groups (upstream's CUDA streams; ``allreduce_different_streams``
is ``num_allreduce_streams > 1`` and, as upstream, cannot be combined with
``delay_allreduce``); ``enable_allreduce`` / ``disable_allreduce`` switch the
reduction off (e.g. for gradient accumulation).

Memory: grads are reduced in place in the flat buffers, so whatever
``message_size`` is, DDP holds one flat grad buffer per dtype x device (the
model's grads) plus, with ``allreduce_always_fp32``, float32 copies of the
low-precision buckets in flight (at most the model's grads again).

How it works here: the gradients of the wrapped module's trainable params are
kept as views into one flat buffer per dtype x device (layout of
``apex.contrib.combine_tensors.plan_layout``); a bucket is a range of such a
buffer and is all-reduced in place, with no flatten/unflatten copies. A grad
that arrives elsewhere (a fresh tensor after ``zero_grad(set_to_none=True)``) is
copied into its slot once. When the grads already live in a foreign flat buffer
with exactly this layout (an apex fused optimizer over ``model.parameters()``,
with ``zero_grad(set_to_none=False)``), that buffer is adopted and reduced in
place instead, so DDP and the optimizer share one buffer.

Beyond upstream: ``process_group``; ``no_sync()``; a parameter that gets no
gradient on some ranks in a pass receives the reduced value there (it still has
none when no rank produced one); every collective failure, including a rank that
died or missed the process-group timeout, raises
``apex.parallel.CollectiveError`` naming the operation.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._checks import check_bool, check_int, real_number
from .._flatten import flatten as flatten  # upstream's module-level helpers, kept here
from .._flatten import unflatten as unflatten
from .._tensor_utils import YIELDS_GRADS
from ..contrib.combine_tensors import plan_layout
from ._comm import (
    agree_layout,
    agree_values,
    broadcast_tensors,
    check_process_group,
    flat_dist_call,
    layout_of,
    require_initialized,
    world_size,
)
from .reducer import BucketedAllReduce, GradSlots, Reducer, dense_view, plan_param_buckets

__all__ = ["DistributedDataParallel", "Reducer", "flat_dist_call"]

logger = logging.getLogger("apex.parallel")

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class _FlatSet:
    """Flat grad storage of the trainable params of one dtype x device (in module order)."""

    def __init__(self, params: List[torch.Tensor], positions: List[int]) -> None:
        self.params = params
        self.positions = positions
        self.offsets, self.total = plan_layout(params)
        p0 = params[0]
        self.flat = torch.zeros(self.total, dtype=p0.dtype, device=p0.device)
        setattr(self.flat, YIELDS_GRADS, True)  # an apex optimizer may adopt these grads: we then adopt its buffer
        self.views = [dense_view(self.flat, p, off) for p, off in zip(params, self.offsets)]

    def grads_are_views(self) -> bool:
        return all(p.grad is v for p, v in zip(self.params, self.views))

    def foreign_flat(self) -> Optional[torch.Tensor]:
        """The flat buffer the current grads are views of, if it has exactly this layout (else None)."""
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            return None
        base = grads[0]._base
        if (base is None or base.dim() != 1 or not base.is_contiguous() or base.numel() != self.total
                or base.dtype != self.flat.dtype or base.device != self.flat.device):
            return None
        start = base.storage_offset()
        for g, v, off in zip(grads, self.views, self.offsets):
            if g._base is not base or g.storage_offset() - start != off or g.stride() != v.stride():
                return None
        return base

    def adopt(self, base: torch.Tensor) -> None:
        self.flat = base
        self.views = [p.grad for p in self.params]


#: float32's smallest normal value, and the largest factor whose reciprocal is still one: the buckets are divided by
#: the factor and multiplied by it again, in float32 or lower, so both it and 1 / factor must be normal float32s
_FACTOR_LOW = 2.0 ** -126
_FACTOR_HIGH = 2.0 ** 126


def _check_predivide_factor(value: Any, name: str) -> float:
    number = real_number(value)
    if number is None:
        raise TypeError(f"DistributedDataParallel: {name} must be a positive number, got {value!r:.80} "
                        f"({type(value).__name__})")
    try:
        factor = float(number)
    except OverflowError:  # an int beyond the float range
        factor = float("inf")
    if not _FACTOR_LOW <= factor <= _FACTOR_HIGH:
        raise ValueError(f"DistributedDataParallel: {name} must be a positive number that, like its reciprocal, is "
                         f"a normal float32 (in [{_FACTOR_LOW:.6g}, {_FACTOR_HIGH:.6g}]), got {number!r}")
    return factor


def _check_communicators(value: Any, n: int) -> Optional[List[Any]]:
    """``allreduce_communicators`` as a list of ``n`` process groups (None: DDP creates them)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"DistributedDataParallel: allreduce_communicators must be a list or tuple of "
                        f"torch.distributed process groups (or None), got {value!r:.80} ({type(value).__name__})")
    groups = list(value)
    for k, group in enumerate(groups):
        if group is None:
            raise TypeError(f"DistributedDataParallel: allreduce_communicators[{k}] must be a torch.distributed "
                            "process group, got None")
        check_process_group(group, f"DistributedDataParallel: allreduce_communicators[{k}]")
    if len(groups) != n:
        raise ValueError(f"DistributedDataParallel: allreduce_communicators has {len(groups)} groups, "
                         f"num_allreduce_streams is {n}")
    return groups


def _check_trigger_params(value: Any) -> frozenset:
    """The ids of the ``allreduce_trigger_params`` tensors (an iterable of them, not one tensor)."""
    if isinstance(value, torch.Tensor):
        raise TypeError("DistributedDataParallel: allreduce_trigger_params must be a list of parameters, got one "
                        "tensor (wrap it in a list)")
    try:
        params = list(value)
    except TypeError:
        raise TypeError(f"DistributedDataParallel: allreduce_trigger_params must be a list of parameters, got "
                        f"{type(value).__name__}") from None
    for k, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"DistributedDataParallel: allreduce_trigger_params[{k}] must be a parameter (tensor), "
                            f"got {type(p).__name__}")
    if not params:
        raise ValueError("allreduce_trigger_params must name at least one parameter")
    return frozenset(id(p) for p in params)


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel wrapper with upstream apex's arguments (see the module docstring).

    Args:
        module: the network; its params and buffers are broadcast from rank 0 now.
        message_size: minimum bucket size in elements (default 10,000,000); whole params, never split.
        delay_allreduce: all-reduce everything after the backward instead of overlapping it.
        shared_param: removed upstream; must be None.
        allreduce_trigger_params: bucket boundaries: a bucket closes after each of these params (in expected
            arrival order); the rest is reduced at the end of the backward; ``message_size`` is then ignored.
        retain_allreduce_buffers: accepted for compatibility; the flat buffers always persist
            (``allreduce_buffers``).
        allreduce_always_fp32: reduce float32 copies of fp16/bf16 buckets.
        num_allreduce_streams: number of process groups buckets are spread over (round-robin); more than one
            needs ``delay_allreduce=False``.
        allreduce_communicators: the process groups to use for that (default: new groups over all ranks).
        gradient_average: divide the sum by the world size.
        gradient_predivide_factor: divide before the all-reduce, multiply by factor / world size after; it and
            its reciprocal must be normal float32 values (``[2**-126, 2**126]``).
        gradient_average_split_factor: deprecated upstream name of gradient_predivide_factor.
        prof: profiler ranges (``torch.profiler.record_function``) around bucket all-reduces.
        process_group: the group to reduce over (default: the default group).

    The on/off options take bools (or 0/1). At construction the ranks compare the options that shape the
    collectives (bucket plan, reduction dtype, groups, scaling) and the state_dict layout; any difference raises
    the same RuntimeError on every rank, naming each rank's value.
    """

    _apex_parallel_wrapper = True  # amp.initialize refuses models already wrapped

    def __init__(self, module: torch.nn.Module, message_size: int = 10000000, delay_allreduce: bool = False,
                 shared_param: Any = None, allreduce_trigger_params: Optional[Sequence[torch.Tensor]] = None,
                 retain_allreduce_buffers: bool = False, allreduce_always_fp32: bool = False,
                 num_allreduce_streams: int = 1, allreduce_communicators: Optional[Sequence[Any]] = None,
                 gradient_average: bool = True, gradient_predivide_factor: float = 1.0,
                 gradient_average_split_factor: Optional[float] = None, prof: bool = False, *,
                 process_group: Any = None) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"DistributedDataParallel expects a torch.nn.Module, got {type(module).__name__}")
        if shared_param is not None:
            raise ValueError(
                "shared_param is no longer an option of apex.parallel.DistributedDataParallel (upstream removed "
                "it too): overlapping communication works with shared parameters; to reduce only after the "
                "backward, pass delay_allreduce=True"
            )
        message_size = check_int(message_size, "DistributedDataParallel: message_size (elements)", 1)
        num_allreduce_streams = check_int(num_allreduce_streams, "DistributedDataParallel: num_allreduce_streams", 1)
        delay_allreduce = check_bool(delay_allreduce, "DistributedDataParallel: delay_allreduce")
        retain_allreduce_buffers = check_bool(retain_allreduce_buffers,
                                              "DistributedDataParallel: retain_allreduce_buffers")
        allreduce_always_fp32 = check_bool(allreduce_always_fp32, "DistributedDataParallel: allreduce_always_fp32")
        gradient_average = check_bool(gradient_average, "DistributedDataParallel: gradient_average")
        prof = check_bool(prof, "DistributedDataParallel: prof")
        factor_name = "gradient_predivide_factor"
        if gradient_average_split_factor is not None:
            warnings.warn("gradient_average_split_factor is deprecated; use gradient_predivide_factor",
                          DeprecationWarning, stacklevel=2)
            gradient_predivide_factor = gradient_average_split_factor
            factor_name = "gradient_average_split_factor"
        factor = _check_predivide_factor(gradient_predivide_factor, factor_name)
        if num_allreduce_streams > 1 and delay_allreduce:
            raise ValueError("num_allreduce_streams > 1 (allreduce_different_streams) may only be used with "
                             "delay_allreduce=False")
        check_process_group(process_group, "DistributedDataParallel: process_group")
        communicators = _check_communicators(allreduce_communicators, num_allreduce_streams)
        trigger_ids = None
        if allreduce_trigger_params is not None:
            trigger_ids = _check_trigger_params(allreduce_trigger_params)
        require_initialized("apex.parallel.DistributedDataParallel")

        self.module = module
        self.process_group = process_group
        self.message_size = message_size
        self.delay_allreduce = delay_allreduce
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = factor
        self.retain_allreduce_buffers = retain_allreduce_buffers
        self.prof = prof
        self.num_allreduce_streams = num_allreduce_streams
        self.allreduce_different_streams = num_allreduce_streams > 1
        self.world_size = world_size(process_group)
        self._trigger_ids = trigger_ids
        # What shapes the buckets' collectives (their sizes, dtypes, groups) must be the same on every rank: a
        # bucket all-reduced with different sizes on two ranks terminates the process under gloo. The scaling
        # options are compared too: ranks that scale differently would drift apart without any error. Compared
        # before the groups are created, since creating them is itself a collective.
        options: List[Tuple[str, Any]] = [("num_allreduce_streams", num_allreduce_streams)]
        if trigger_ids is None:
            options.append(("message_size", message_size))
        else:
            options.append(("allreduce_trigger_params (positions in module.parameters())",
                            [i for i, p in enumerate(module.parameters()) if id(p) in trigger_ids]))
        options += [("allreduce_always_fp32", allreduce_always_fp32), ("gradient_average", gradient_average),
                    (factor_name, factor)]
        agree_values(options, "apex.parallel.DistributedDataParallel", group=process_group,
                     hint=". Every rank must pass the same options.")
        self._groups = self._reduce_groups(num_allreduce_streams, communicators)
        self._allreduce_enabled = True
        self._pass_active = False
        self._hooks: Dict[int, Any] = {}
        self._sets: List[_FlatSet] = []
        self._engine: Optional[BucketedAllReduce] = None
        self._slots: Optional[GradSlots] = None
        self._slot_of: Dict[int, int] = {}
        self._signature: Tuple = ()

        with torch.no_grad():
            state = [(name, t) for name, t in module.state_dict(keep_vars=True).items() if torch.is_tensor(t)]
            agree_layout(layout_of(state), "apex.parallel.DistributedDataParallel", noun="state_dict entry",
                         group=process_group, hint=" (same parameters and buffers, in the same order)")
            broadcast_tensors([t.detach() for _, t in state], 0, process_group,
                              what="apex.parallel.DistributedDataParallel: broadcasting params and buffers from "
                                   "rank 0")
        self._build()

    # ------------------------------------------------------------------ structure
    def _reduce_groups(self, n: int, communicators: Optional[List[Any]]) -> List[Any]:
        if communicators is not None:
            return communicators
        if n == 1:
            return [self.process_group]
        ranks = None if self.process_group is None else dist.get_process_group_ranks(self.process_group)
        return [dist.new_group(ranks=ranks) for _ in range(n)]

    def _trainable(self) -> List[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _current_signature(self) -> Tuple:
        return tuple((id(p), p.requires_grad, p.dtype, p.device) for p in self.module.parameters())

    def _build(self) -> None:
        """(Re)build flat grad buffers, buckets and hooks for the module's current trainable params."""
        params = self._trainable()
        by_kind: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
        for j, p in enumerate(params):
            by_kind.setdefault((p.dtype, p.device), []).append(j)
        old_grads = {id(p): p.grad for p in params}
        self._sets = [_FlatSet([params[j] for j in js], js) for js in by_kind.values()]
        for s in self._sets:  # grads that exist keep their values, now in the flat buffer
            for p, v in zip(s.params, s.views):
                g = old_grads[id(p)]
                if g is not None:
                    with torch.no_grad():
                        v.copy_(g)
                    p.grad = v
        self._make_engine()
        for handle in self._hooks.values():
            handle.remove()
        self._hooks = {id(p): p.register_post_accumulate_grad_hook(self._on_grad) for p in params}
        self._signature = self._current_signature()

    def _make_engine(self) -> None:
        tensors, flats, offsets, views, positions = [], [], [], [], []
        buckets: List[List[torch.Tensor]] = []
        slot_buckets: List[List[int]] = []
        bucket_pos: List[int] = []
        for s in self._sets:
            slots = [(off, p.numel()) for p, off in zip(s.params, s.offsets)]
            if self._trigger_ids is None:
                ranges, sb = plan_param_buckets(s.total, slots, self.message_size)
            else:
                closing = [k for k, p in enumerate(s.params) if id(p) in self._trigger_ids]
                ranges, sb = plan_param_buckets(s.total, slots, None, closing)
            base = len(buckets)
            buckets += [[s.flat[lo:hi]] for lo, hi in ranges]
            bucket_pos += [-1] * len(ranges)
            for p, off, v, pos, bs in zip(s.params, s.offsets, s.views, s.positions, sb):
                tensors.append(p)
                flats.append(s.flat)
                offsets.append(off)
                views.append(v)
                positions.append(pos)
                slot_buckets.append([base + b for b in bs])
                for b in bs:
                    bucket_pos[base + b] = pos if bucket_pos[base + b] < 0 else min(bucket_pos[base + b], pos)
        # expected arrival: grads of the last params first, so buckets whose earliest param is latest go first
        order = sorted(range(len(buckets)), key=lambda b: (-bucket_pos[b], -b))
        if self.gradient_average:
            post = self.gradient_predivide_factor / self.world_size
        else:
            post = 1.0
        self._engine = BucketedAllReduce(buckets, slot_buckets, order, group=self._groups,
                                         predivide=self.gradient_predivide_factor, postscale=post,
                                         always_fp32=self.allreduce_always_fp32,
                                         what="apex.parallel.DistributedDataParallel", profile=self.prof)
        self._slots = GradSlots(tensors, flats, offsets, views)
        self._slot_of = {id(t): i for i, t in enumerate(tensors)}

    @property
    def allreduce_buffers(self) -> List[torch.Tensor]:
        """The flat gradient buffers buckets are reduced in (one per dtype x device)."""
        return [s.flat for s in self._sets]

    # ------------------------------------------------------------------ switches
    def enable_allreduce(self) -> None:
        self._allreduce_enabled = True

    def disable_allreduce(self) -> None:
        """Backward passes leave the grads local (they accumulate) until enable_allreduce()."""
        self._allreduce_enabled = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate local grads; the first one outside reduces the sum."""
        was = self._allreduce_enabled
        self._allreduce_enabled = False
        try:
            yield
        finally:
            self._allreduce_enabled = was

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._current_signature() != self._signature:
            # params were added, frozen/unfrozen or changed dtype/device since the buckets were made
            with torch.no_grad():
                agree_layout(layout_of([(n, p) for n, p in self.module.named_parameters() if p.requires_grad]),
                             "apex.parallel.DistributedDataParallel (rebuilding buckets)", group=self.process_group)
            self._build()
        else:
            self._adopt_foreign_buffers()
        return self.module(*inputs, **kwargs)

    def _adopt_foreign_buffers(self) -> None:
        changed = False
        for s in self._sets:
            if s.grads_are_views():
                continue
            base = s.foreign_flat()
            if base is not None:
                s.adopt(base)
                changed = True
        if changed:
            logger.debug("apex.parallel.DistributedDataParallel: reducing in the flat grad buffers the grads live in")
            self._make_engine()

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._allreduce_enabled:
            return
        i = self._slot_of.get(id(p))
        if i is None:
            return
        engine = self._engine
        if not self._pass_active:
            self._pass_active = True
            engine.begin()
            _queue_callback(self._finish_pass)
        self._slots.bind(i)
        if self.delay_allreduce:
            engine.seen()[i] = 1
        else:
            engine.ready(i)

    def _finish_pass(self) -> None:
        """End of the backward pass: launch what is left, wait, agree on which params got grads."""
        engine = self._engine
        try:
            if engine.active:
                missing = self._slots.settle(engine.seen())
                engine.finish()
                self._slots.agree_usage(missing, self.process_group, "apex.parallel.DistributedDataParallel")
        finally:
            self._pass_active = False
            engine.abandon()

