"""Combined (flat) storage for one param group x dtype x device.

A `FlatSet` owns one flat buffer each for params, grads and every optimizer
state, laid out by `plan_layout`. Params, grads and ``optimizer.state[p]``
entries are rebound as views into those buffers, so a kernel can update every
tensor of the group in one pass while user code and ``state_dict`` keep seeing
ordinary per-parameter tensors.

The flat grad buffer is made on demand. A step whose grads autograd just made (after
``zero_grad(set_to_none=True)``, torch's default) reads them where they are, so in that pattern no flat grad
buffer exists and the optimizer holds no second copy of the grads. The buffer appears when grads must live in it:
the grads a step read in place are still the params' grads at the next step (they were kept:
``zero_grad(set_to_none=False)``, or no zero_grad), which the set sees from a mark on one of them
(`kept_since_gather`); amp, clipping and global norms, which work on the flat buffer (`sync_grads`); executors
that cannot read grads in place. From then on a step whose grads are still the slot views reads the buffer.

Sharing can be broken from outside (``p.data = ...``, ``p.grad = new``,
``model.to(...)``, ``zero_grad(set_to_none=True)`` followed by backward,
``p.grad.data = ...`` or ``p.grad.set_(...)``). The optimizer checks, before
every update, that each param and each grad still lives at its slot (one
``data_ptr`` per param and per grad, run as ``map()`` over the params, without
a Python-level loop). Params that moved force a re-combine. Grads that moved
are either read where they are by the kernel (`scan_grads` / `plan_gather` /
`use_gather`: a per-slot grad address table, no copy, ``p.grad`` untouched) or,
for callers that need the flat grad buffer (amp, clipping, global norms), copied
into their slots and rebound (`sync_grads`).

Not detected (a documented limit, outside ordinary torch usage): replacing an
entry of ``group["params"]`` in place by another object that shares the same
memory (a new list, or an appended param, is detected).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import _core, _device, _meta_guard
from .._tensor_utils import (
    READ_IN_PLACE_MARK,
    YIELDS_GRADS,
    data_ptr,
    get_device,
    get_dtype,
    get_grad,
    get_is_cpu,
    get_layout,
    get_shape,
    is_contiguous,
    is_neg,
    stride,
)
from ..contrib.combine_tensors import combine_tensors, plan_layout
from ._state_check import check_step_value
from ._state_watch import bind

_repeat = itertools.repeat
_eq = operator.eq
_is = operator.is_

# `expected_grads` entry of a slot whose grad the last step read where autograd left it: that grad is not kept
# (no reference to a fresh grad outlives the step), only the fact that there was one
_GATHERED = object()

#: up to this many grads `FlatSet._clear_of` screens them in Python (sorting and scanning more costs more than the
#: tensor test's fixed dozen ops)
PY_SCAN_MAX = 1024


def view_like(flat: torch.Tensor, offset: int, ref: torch.Tensor) -> torch.Tensor:
    """A view of `flat` at element `offset` with `ref`'s shape and strides."""
    return torch.as_strided(flat, ref.shape, ref.stride(), flat.storage_offset() + offset)


def check_grad(k: int, p: torch.Tensor, g: torch.Tensor) -> None:
    """Raises if `g` cannot be the gradient of param `k` in a flat buffer of `p`'s dtype/device."""
    if g.layout != torch.strided:
        raise RuntimeError(
            f"apex fused optimizers do not support sparse gradients: param {k} has a grad with layout "
            f"{g.layout}; expected a dense (strided) grad"
        )
    if g.dtype != p.dtype or g.device != p.device:
        raise RuntimeError(
            f"grad of param {k} has dtype {g.dtype} on {g.device}; expected {p.dtype} on {p.device} (the param's)"
        )
    if g.shape != p.shape:
        raise RuntimeError(f"grad of param {k} has shape {tuple(g.shape)}; expected the param's {tuple(p.shape)}")


_NO_STATE = object()


def check_states(params: Sequence[torch.Tensor], state: Dict[torch.Tensor, dict], names: Sequence[str]) -> None:
    """Raises if an existing state entry cannot be copied into its param's slot (e.g. a bad checkpoint)."""
    for k, p in enumerate(params):
        st = state.get(p, _NO_STATE)
        if st is _NO_STATE:
            continue
        if not isinstance(st, dict):  # the step binds views into it
            raise TypeError(f"state of param {k} must be a dict of state entries (optimizer.state[param]), got "
                            f"{type(st).__name__}")
        if not st:
            continue
        for name in names:
            if name not in st:
                continue  # a missing entry starts fresh, as torch's lazy init
            old = st[name]
            if not isinstance(old, torch.Tensor) or not old.is_floating_point():
                got = f"a {old.dtype} tensor" if isinstance(old, torch.Tensor) else type(old).__name__
                raise TypeError(f"state {name!r} of param {k} must be a floating-point tensor, got {got}")
            if old.device.type == "meta" and p.device.type != "meta":
                raise ValueError(f"state {name!r} of param {k} is a meta tensor, which holds no values")
            if old.numel() != p.numel():
                raise ValueError(
                    f"state {name!r} of param {k} has {old.numel()} elements; expected {p.numel()} "
                    f"(param shape {tuple(p.shape)})"
                )
        if "step" in st:
            check_step_value(st["step"], f"state 'step' of param {k}")


def _copy_many(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i, in one torch call where torch has it."""
    if not dst:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dst, src)
    else:  # torch < 2.1
        for d, s in zip(dst, src):
            d.copy_(s)


class FlatSet:
    """Flat buffers and per-segment bookkeeping for the params of one group/dtype/device.

    Construction validates grads and existing states first and raises before
    any param is rebound. ``state_dtype``: the storage dtype of the state buffers (default: the params';
    float32 for fp16/bf16 params whose states are kept in fp32, NVIDIA FusedAdam's layout, which the Adam
    kernel updates under ``FLAG_F32_STATES``).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        state: Dict[torch.Tensor, dict],
        state_names: Sequence[str],
        state_fill: Dict[str, float],
        has_step: bool,
        state_dtype: Optional[torch.dtype] = None,
    ):
        self.params: List[torch.Tensor] = list(params)
        p0 = self.params[0]
        self.dtype, self.device = p0.dtype, p0.device
        self.state_dtype = self.dtype if state_dtype is None else state_dtype
        self.state_names = list(state_names)
        grads0 = list(map(get_grad, self.params))
        for k, (p, g) in enumerate(zip(self.params, grads0)):
            if g is not None:
                check_grad(k, p, g)
        check_states(self.params, state, self.state_names)

        self.offsets, self.total = plan_layout(self.params)
        self.nseg = len(self.params)
        self.has_step = has_step
        ends = [off + p.numel() for off, p in zip(self.offsets, self.params)]
        # padding = the alignment gaps between slots; it must stay zero (norms and checks run over whole buffers)
        self.has_padding = any(e != s for e, s in zip(ends, self.offsets[1:]))
        self._pad_index: Optional[torch.Tensor] = None
        self._numels: Optional[torch.Tensor] = None
        self._slot_numels = [e - off for e, off in zip(ends, self.offsets)]  # for `_clear_of`
        self._max_numel = max(self._slot_numels)  # the largest slot
        self.step_grads: Optional[List[Optional[torch.Tensor]]] = None

        # params: rebound in place, values kept
        self.flat_p = combine_tensors(self.params, require_copy_value=True)

        # grads: left where they are; the optimizer's first step reads them in place or adopts them (`use_gather`,
        # `sync_grads`), and the flat grad buffer is made when a grad is first adopted (`flat_g`)
        self._flat_g: Optional[torch.Tensor] = None
        self._grad_views: Optional[List[torch.Tensor]] = None
        self._grad_ptrs: Optional[List[int]] = None
        self.expected_grads: List[object] = [None] * self.nseg
        self._token = object()  # what `READ_IN_PLACE_MARK` holds on a grad this set read in place
        self._probe: Optional[int] = None  # the slot whose grad carries the mark, if any
        self._all_gathered = [_GATHERED] * self.nseg  # `expected_grads` when every slot's grad was read in place

        # states: values of existing entries (from earlier steps or a loaded state_dict) are kept
        self.flat_s: Dict[str, torch.Tensor] = {}
        self.state_views: Dict[str, List[torch.Tensor]] = {}
        self.exposed = [bool(state.get(p)) for p in self.params]
        first = [0] * self.nseg
        for name in self.state_names:
            fill = state_fill.get(name, 0.0)
            flat = torch.full((self.total,), fill, dtype=self.state_dtype, device=self.device)
            if fill != 0.0:
                self.zero_padding((flat,))
            self.flat_s[name] = flat
            views = [view_like(flat, off, p) for p, off in zip(self.params, self.offsets)]
            self.state_views[name] = views
            for k, p in enumerate(self.params):
                st = state.get(p) if self.exposed[k] else None
                old = st.get(name) if st else None
                if isinstance(old, torch.Tensor):
                    views[k].copy_(old.reshape(p.shape))
                else:
                    first[k] = 1  # never written: the optimizer's first-update rule applies
                if st is not None:
                    bind(st, name, views[k])

        self.seg = torch.tensor([*self.offsets, self.total], dtype=torch.int64)
        self.seg_end = torch.tensor(ends, dtype=torch.int64)  # kernels stop each slot here: padding untouched
        self.steps = torch.zeros(self.nseg, dtype=torch.float32)
        if has_step:
            for k, p in enumerate(self.params):
                st = state.get(p) if self.exposed[k] else None
                if st and "step" in st:
                    self.steps[k] = float(st["step"])
                if st is not None:
                    bind(st, "step", self.steps[k])
        self.skip = torch.zeros(self.nseg, dtype=torch.uint8)
        self._spans: Optional[tuple] = None  # (buffers, their addresses, their spans): `_write_spans`
        self.first = torch.tensor(first, dtype=torch.uint8)
        self._n_first = sum(first)
        self._n_unexposed = self.nseg - sum(self.exposed)

        self.param_ptrs = list(map(data_ptr, self.params))
        self.strides = list(map(stride, self.params))
        # What a grad must show (see `_check_grad_meta`): the set's dtype and device, and its slot's shape.
        self._on_cpu = self.device.type == "cpu"  # is_cpu: cheaper than building and comparing a device
        self._shapes = list(map(get_shape, self.params))
        # Slots of contiguous params: a grad has their element layout iff it is contiguous (also when strides of
        # size-1 dims differ), which is cheaper to ask than comparing stride tuples.
        self._dense = all(map(is_contiguous, self.params))
        # the metadata of the last grads `plan_gather` validated with nothing to fix, keyed by (slots with a grad,
        # expected dtype): grads like them pass the same validation (see `apex._meta_guard`)
        self._validated_grads = _meta_guard.LastValidated()
        # gather mode (`gathered`): the kernel reads each grad where it is, through this per-slot address table
        # (see plan_gather), which stays alive here until the next step
        self.gtab: Optional[torch.Tensor] = None
        self.n_skipped = 0
        self._refresh_skip()
        self.uses_kernel = self.total > 0 and _core.uses_kernel(self.flat_p)  # an all-empty set has no buffer address
        self.args = self._make_args() if self.uses_kernel else None

        # O2: low-precision model copies written by the same pass (see attach_out)
        self.partial_out: Optional[List[tuple]] = None
        self.out_params: Optional[List[torch.Tensor]] = None
        self.flat_out: Optional[torch.Tensor] = None
        self.out_ptrs: Optional[List[int]] = None

    # -- the flat grad buffer, made on demand ------------------------------------
    @property
    def has_grad_buffer(self) -> bool:
        return self._flat_g is not None

    @property
    def flat_g(self) -> torch.Tensor:
        """The flat grad buffer (zeros where no grad was adopted), made at the first use."""
        if self._flat_g is None:
            self._make_grad_buffer()
        return self._flat_g

    @property
    def grad_views(self) -> List[torch.Tensor]:
        """One view of `flat_g` per slot, with its param's shape and strides (what adopted grads are bound to)."""
        if self._grad_views is None:
            self._make_grad_buffer()
        return self._grad_views

    @property
    def grad_ptrs(self) -> List[int]:
        if self._grad_ptrs is None:
            self._make_grad_buffer()
        return self._grad_ptrs

    def _make_grad_buffer(self) -> None:
        # zeros: the gaps between slots must read zero (norms and checks run over whole buffers), and so must
        # the slots of params that never had a grad
        flat = torch.zeros(self.total, dtype=self.dtype, device=self.device)
        self._grad_views = [view_like(flat, off, p) for p, off in zip(self.params, self.offsets)]
        self._grad_ptrs = list(map(data_ptr, self._grad_views))
        self._flat_g = flat
        args = getattr(self, "args", None)
        if args is not None:
            args.g = flat.data_ptr()

    # -- construction helpers -------------------------------------------------
    def zero_padding(self, flats: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Re-zeroes the gaps between slots in `flats` (default: the param and state buffers).

        The kernels never write there (``seg_end``); torch executors update whole runs of slots,
        gaps included, where math on zeros can give NaN (0/0 with eps=0), so they call this after.
        """
        if not self.has_padding:
            return
        if self._pad_index is None:
            ends = [off + p.numel() for off, p in zip(self.offsets, self.params)]
            gaps = [torch.arange(a, b) for a, b in zip(ends, self.offsets[1:]) if b > a]
            self._pad_index = torch.cat(gaps).to(self.device)
        if flats is None:
            flats = (self.flat_p, *self.flat_s.values())
        for flat in flats:
            flat.index_fill_(0, self._pad_index, 0)

    def _adopt(self, todo: List[Tuple[int, torch.Tensor]]) -> None:
        """Copies validated foreign grads into their slots and rebinds ``p.grad`` to the slot views."""
        if not todo:
            return
        lo = self.flat_g.data_ptr()
        hi = lo + self.flat_g.numel() * self.flat_g.element_size()
        # a grad that is itself (a view of) one of our slots may be overwritten by another copy: read it first
        src = [g.clone() if lo <= g.data_ptr() < hi else g for _, g in todo]
        for k, g in todo:
            v = self.grad_views[k]
            # our view object whose storage was swapped (p.grad.data = ...): it views the caller's memory now,
            # whether it is still p.grad or was replaced since, so the slot gets a new view
            if g is v or v.data_ptr() != self._grad_ptrs[k]:
                self.grad_views[k] = view_like(self.flat_g, self.offsets[k], self.params[k])
        _copy_many([self.grad_views[k] for k, _ in todo], src)
        for k, _ in todo:
            gv = self.grad_views[k]
            self.params[k].grad = gv
            self.expected_grads[k] = gv

    def _make_args(self):
        a = _core.ext.OptArgs()
        code = _core.DTYPE_CODES[self.dtype]
        a.p = self.flat_p.data_ptr()
        a.g = self._flat_g.data_ptr() if self._flat_g is not None else 0  # set when the buffer is made
        a.pdt = a.gdt = code
        a.sdt = _core.DTYPE_CODES[self.state_dtype]
        names = self.state_names
        a.s0 = self.flat_s[names[0]].data_ptr() if len(names) > 0 else 0
        a.s1 = self.flat_s[names[1]].data_ptr() if len(names) > 1 else 0
        a.s2 = self.flat_s[names[2]].data_ptr() if len(names) > 2 else 0
        a.seg = self.seg.data_ptr()
        a.seg_end = self.seg_end.data_ptr()
        a.nseg = self.nseg
        a.steps = self.steps.data_ptr()
        a.first = self.first.data_ptr()
        return a

    def _refresh_skip(self) -> None:
        """After `expected_grads` changed: skip flags, and the bound grads with their slot addresses (None when a
        slot's grad was read in place: the set's grads cannot be intact then)."""
        self._bound = [g for g in self.expected_grads if g is not None]
        if any(map(_is, self._bound, _repeat(_GATHERED))):
            self._bound_ptrs = None
        elif self._bound:
            self._bound_ptrs = [ptr for ptr, g in zip(self.grad_ptrs, self.expected_grads) if g is not None]
        else:
            self._bound_ptrs = []
        skipped = [g is None for g in self.expected_grads]
        self.n_skipped = sum(skipped)
        if self.n_skipped:
            self.skip.copy_(_core.int_table(skipped, torch.uint8))
        else:
            self.skip.zero_()
        self._advance = (self.skip == 0).to(torch.float32)  # what `advance_steps` adds: 1, or 0 for a skipped slot

    # -- per-step checks ------------------------------------------------------
    def buffers_moved(self) -> bool:
        """Whether a buffer whose address the kernel holds was reallocated since it was recorded.

        ``resize_`` that grows a view a user holds (a state entry, ``p.grad`` bound to its slot, ``state['step']``)
        moves the whole storage it shares with the other slots; the kernel would then read and write freed
        memory. Found here by the buffers' own addresses (one data_ptr per buffer, not per param), the group is
        re-combined, which validates every state entry first (a resized one is refused, naming the param and the
        key). Torch executors use the buffer tensors themselves, which follow their storage."""
        a = self.args
        if a is None:
            return False
        if self.flat_p.data_ptr() != a.p or self.steps.data_ptr() != a.steps:
            return True
        if self._flat_g is not None and self._flat_g.data_ptr() != a.g:
            return True
        names = self.state_names
        recorded = (a.s0, a.s1, a.s2)
        return any(self.flat_s[n].data_ptr() != recorded[i] for i, n in enumerate(names[:3]))

    def params_intact(self) -> bool:
        """Every param still lives at its slot (catches p.data = ..., model.to(...))."""
        return list(map(data_ptr, self.params)) == self.param_ptrs and (
            self.params[0].dtype == self.dtype and self.params[0].device == self.device
        )

    def grads_intact(self) -> bool:
        """Every ``p.grad`` still lives at its slot (None where it was None at the last sync)."""
        if not self.n_skipped:
            if self._grad_ptrs is None:
                return False
            try:
                return list(map(data_ptr, map(get_grad, self.params))) == self._grad_ptrs
            except (TypeError, RuntimeError):  # a grad became None (or sparse): data_ptr does not apply
                return False
        if self._bound_ptrs is None or not all(map(_is, map(get_grad, self.params), self.expected_grads)):
            return False
        return list(map(data_ptr, self._bound)) == self._bound_ptrs

    def pending_grads(self) -> List[Tuple[int, torch.Tensor]]:
        """(k, grad) for every grad that does not live at its slot, validated; changes nothing.

        Validation is one map() per property over all grads (the zero_grad(set_to_none=True)
        pattern adopts every grad at every step); the per-grad check only runs to name a culprit.
        """
        live = [(k, g) for k, g in enumerate(map(get_grad, self.params)) if g is not None]
        gs = [g for _, g in live]
        ks = [k for k, _ in live]
        if set(map(get_layout, gs)) - {torch.strided}:
            for k, g in live:
                check_grad(k, self.params[k], g)
        self._check_grad_meta(ks, gs)
        views, ptrs = self.grad_views, self.grad_ptrs
        return [(k, g) for k, g in live if g is not views[k] or g.data_ptr() != ptrs[k]]

    # -- grads read where they are (gather) -------------------------------------
    def scan_grads(self, of: Optional[Sequence[torch.Tensor]] = None
                   ) -> Tuple[List[Optional[torch.Tensor]], Optional[List[int]]]:
        """The current grads of the params (or of ``of``) and, when none is None or sparse, their addresses
        (one map each)."""
        gs = list(map(get_grad, self.params if of is None else of))
        try:
            return gs, list(map(data_ptr, gs))
        except (TypeError, RuntimeError):  # a None (or sparse) grad: data_ptr does not apply
            return gs, None

    def scanned_intact(self, gs: List[Optional[torch.Tensor]], ptrs: Optional[List[int]]) -> bool:
        """`grads_intact()` from a `scan_grads()` result (no second walk over the params)."""
        if not self.n_skipped:
            return ptrs is not None and self._grad_ptrs is not None and ptrs == self._grad_ptrs
        if self._bound_ptrs is None or not all(map(_is, gs, self.expected_grads)):
            return False
        return list(map(data_ptr, self._bound)) == self._bound_ptrs

    def planned_grads(self):
        """This step's grads and their `plan_gather` plan when the set's owner planned them before the step's checks
        (`ShadowSet`: the model params' grads), else None."""
        return None

    def kept_since_gather(self, gs: List[Optional[torch.Tensor]]) -> bool:
        """Whether the grad the last in-place read marked is still its param's grad (in ``gs``): grads are kept
        between steps, so they are worth adopting into the flat buffer once instead of being read in place
        (and checked) at every step."""
        k = self._probe
        if k is None:
            return False
        g = gs[k]
        return g is not None and getattr(g, READ_IN_PLACE_MARK, None) is self._token

    def plan_gather(self, gs: List[Optional[torch.Tensor]], ptrs: Optional[List[int]],
                    of: Optional[Sequence[torch.Tensor]] = None):
        """Validates the grads of one step for reading them in place; changes nothing but the record of the last
        validated grads' metadata (`_validated_grads`).

        ``of``: the tensors whose dtype, device and shape grad k must have (default: the set's params;
        the fp32 shadows of low-precision params read their model params' grads, in the model dtype).

        Returns (table, todo, has_none): ``table`` holds one grad address per slot (0 where there is
        no grad: skipped), ``todo`` the (k, grad) pairs that cannot be read in place and are copied
        into their slots instead (an element layout other than the slot's, an address not aligned to the
        element size, or memory overlapping what the kernel writes), ``has_none``: some grad is None.
        Raises (sparse, dtype, device or shape mismatch) as `pending_grads` does.
        """
        of = self.params if of is None else of
        if ptrs is None:
            live = [k for k, g in enumerate(gs) if g is not None]
            for k in live:
                if gs[k].layout != torch.strided:
                    check_grad(k, of[k], gs[k])
            lgs = [gs[k] for k in live]
            lptrs = list(map(data_ptr, lgs))
        else:
            live, lgs, lptrs = None, gs, ptrs
        key = (live, of[0].dtype if of else self.dtype)
        if self._validated_grads.like(key, lgs):
            bad_layout = False
        else:
            self._check_grad_meta(live, lgs, of)
            if self._dense:
                bad_layout = not all(map(is_contiguous, lgs))
            else:
                bad_layout = list(map(stride, lgs)) != (self.strides if live is None
                                                        else [self.strides[k] for k in live])
            # a grad with torch's lazy negation bit (x.conj().imag) holds the negated values: copied, which
            # resolves it
            bad_layout = bad_layout or any(map(is_neg, lgs))
            if not bad_layout:
                self._validated_grads.record(key, lgs)
        table = _core.int_table(lptrs)
        todo_idx = self._not_readable(table, live, lgs, bad_layout, of[0].element_size() if of else 1, lptrs)
        if live is not None:
            full = torch.zeros(self.nseg, dtype=torch.int64)
            full[_core.int_table(live)] = table
            table = full
        todo = [(k, gs[k]) for k in todo_idx]
        for k, _ in todo:
            table[k] = self.grad_ptrs[k]
        return table, todo, live is not None

    def _check_grad_meta(self, ks: Optional[Sequence[int]], gs: Sequence[torch.Tensor],
                         of: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Raises as `check_grad` (naming the first culprit) unless grad gs[j] has the dtype, device and shape of
        slot ks[j] (ks None: slot j), for every j; the per-grad check only runs when the bulk test fails. The
        dtype is that of ``of`` (default: the set's params; all of one dtype).

        One map() per property, none of which builds a tuple per grad: a (dtype, device, shape) tuple per
        grad made 5000 small grads allocate 5000 garbage-collected containers per step, and the collections
        they triggered tripled the check's cost (3.1 ms against 1.5 ms, warm).
        """
        of = self.params if of is None else of
        dtype = of[0].dtype if of else self.dtype
        shapes = self._shapes if ks is None else [self._shapes[k] for k in ks]
        if not (
            all(map(_is, map(get_dtype, gs), _repeat(dtype)))
            and (all(map(get_is_cpu, gs)) if self._on_cpu else all(map(_eq, map(get_device, gs),
                                                                          _repeat(self.device))))
            and list(map(get_shape, gs)) == shapes
        ):
            for k, g in zip(range(len(gs)) if ks is None else ks, gs):
                check_grad(k, of[k], g)

    def _layout_ok(self, k: int, g: torch.Tensor) -> bool:
        """Whether grad `g` has the element layout of slot `k` (see ``_dense``), its values as stored."""
        return not g.is_neg() and (g.is_contiguous() if self._dense else g.stride() == self.strides[k])

    def _not_readable(self, table: torch.Tensor, live: Optional[List[int]], lgs: List[torch.Tensor],
                      bad_layout: bool, elem: int, ptrs: Optional[List[int]] = None) -> List[int]:
        """Slots whose grad must be copied: an element layout unlike the param's slot, an address not aligned to
        the grads' element size `elem`, or memory the update writes (params, states, the O2 copy): the kernel
        assumes those disjoint. ``ptrs``: the addresses in ``table`` as a list (for `_clear_of`)."""
        idx = set()
        if bad_layout:
            slots = range(len(lgs)) if live is None else live
            idx.update(j for j, (k, g) in enumerate(zip(slots, lgs)) if not self._layout_ok(k, g))
        spans = self._write_spans()
        if self._numels is None:
            self._numels = torch.tensor(self._slot_numels, dtype=torch.int64)
        if ptrs is None or not self._clear_of(ptrs, live, spans, elem):
            nbytes = (self._numels if live is None else self._numels[_core.int_table(live)]) * elem
            # every grad against every written buffer at once: one (buffers x grads) comparison
            bounds = torch.tensor(spans, dtype=torch.int64)
            hit = ((table < bounds[:, 1:]) & (table + nbytes > bounds[:, :1])).any(0)
            if elem > 1:
                # element sizes are powers of two: the low address bits tell the misaligned ones
                hit |= (table.bitwise_and(elem - 1) if elem & (elem - 1) == 0 else table.remainder(elem)) != 0
            if bool(hit.any()):
                idx.update(hit.nonzero().flatten().tolist())
        if idx and self._flat_g is not None:
            # a copy into a slot would change what a grad viewing that slot reads: copy those too
            glo = self._flat_g.data_ptr()
            in_g = (table >= glo) & (table < glo + self._flat_g.numel() * self._flat_g.element_size())
            idx.update(in_g.nonzero().flatten().tolist())
        return sorted(idx) if live is None else [live[j] for j in sorted(idx)]

    def _write_spans(self) -> List[Tuple[int, int]]:
        """(start, end) addresses of every buffer the update writes: params, states, the O2 copy. Their sizes are
        fixed; only a storage move changes an address, so the spans are kept while the same buffers stay at the
        same addresses."""
        writes = [self.flat_p, *self.flat_s.values()]
        if self.flat_out is not None:
            writes.append(self.flat_out)
        key = list(map(data_ptr, writes))
        cached = self._spans
        if cached is not None and cached[1] == key and all(map(operator.is_, cached[0], writes)):
            return cached[2]
        spans = [(a, a + w.numel() * w.element_size()) for a, w in zip(key, writes)]
        self._spans = (writes, key, spans)
        return spans

    def _clear_of(self, ptrs: List[int], live: Optional[List[int]], spans: List[Tuple[int, int]],
                  elem: int) -> bool:
        """Whether no grad at ``ptrs`` (of the slots ``live``, None: all) is misaligned or meets a written span,
        in Python for up to `PY_SCAN_MAX` grads: the low address bits, then, over the sorted addresses, the grads
        starting in (span start - the largest slot's bytes, span end), the only starts from which a grad can
        reach into the span, each compared with the span by its own size. Some tens of microseconds for a
        model's params, where the tensor test costs a dozen small ops; False sends the grads to that test, which
        names the culprits. Exact for the candidates: small sets' buffers and grads come from the same
        allocator pools, so a grad often starts just below a buffer without reaching it (one-param groups
        took the tensor test at most steps)."""
        if len(ptrs) > PY_SCAN_MAX:
            return False
        if elem > 1 and any(map((elem - 1).__and__, ptrs) if elem & (elem - 1) == 0 else (p % elem for p in ptrs)):
            return False
        sizes = self._slot_numels if live is None else [self._slot_numels[k] for k in live]
        if len(ptrs) == 1:
            lo_g = ptrs[0]
            hi_g = lo_g + sizes[0] * elem
            return all(hi_g <= lo or lo_g >= hi for lo, hi in spans)
        order = sorted(range(len(ptrs)), key=ptrs.__getitem__)
        starts = [ptrs[j] for j in order]
        reach = self._max_numel * elem
        for lo, hi in spans:
            for j in order[bisect.bisect_right(starts, lo - reach):bisect.bisect_left(starts, hi)]:
                if ptrs[j] + sizes[j] * elem > lo:  # starts below hi (the bisection), ends past lo
                    return False
        return True

    def use_gather(self, gs: List[Optional[torch.Tensor]], plan, keep: bool = False) -> None:
        """Makes the next kernel call read grads through `table` (from `plan_gather`); ``p.grad`` is kept.

        The slots' bookkeeping (`expected_grads`) records which slots have a grad this step (`_GATHERED`): no
        reference to a fresh grad is kept beyond the step. One grad read in place gets the set's mark
        (`kept_since_gather`). ``keep``: the update is a torch call over grad lists, which then reads this
        step's grads from `step_grads` (the adopted ones as their slot views) instead of every ``p.grad`` again;
        the update releases them (`grads_for`).
        """
        table, todo, has_none = plan
        self._adopt(todo)
        self.gtab = table
        if self.args is not None:
            self.args.gtab = table.data_ptr()
        self._mark_probe(gs, todo)
        if keep:
            self.step_grads = list(gs)
            for k, _ in todo:
                self.step_grads[k] = self.grad_views[k]
        if not has_none:
            if self.n_skipped or self.expected_grads is not self._all_gathered:
                self.expected_grads = self._all_gathered
                self._refresh_skip()
            return
        self.expected_grads = [None if g is None else _GATHERED for g in gs]
        self._refresh_skip()

    def grads_for(self, ks: List[int]) -> List[torch.Tensor]:
        """The grads of slots ``ks`` for this step's torch call: the ones `use_gather` kept (then released, so
        that no reference outlives the step), else each param's ``.grad``."""
        gs, self.step_grads = self.step_grads, None
        if gs is None:
            return [self.params[k].grad for k in ks]
        return gs if len(ks) == len(gs) else [gs[k] for k in ks]

    def _mark_probe(self, gs: List[Optional[torch.Tensor]], todo: List[Tuple[int, torch.Tensor]]) -> None:
        """Marks the first grad read in place (adopted ones are copies: not what the next step will see).

        None when that grad is a view into memory another owner keeps (torch DDP's buckets with
        ``gradient_as_bucket_view=True``, a framework's contiguous grad buffer): the owner binds its view
        to ``p.grad`` again at every backward, so adopting it would add a copy on our side at every other
        step and one on the owner's (it copies a foreign grad back into its bucket); such grads are read
        in place at every step instead. An owner that reduces in our buffer once the grads live there
        (apex's DistributedDataParallel, which marks its buffers `YIELDS_GRADS`) is the exception: its
        grads are adopted, and both then share one buffer."""
        adopted = {k for k, _ in todo}
        self._probe = None
        for k, g in enumerate(gs):
            if g is not None and k not in adopted:
                base = g._base
                if base is not None and base is not self._flat_g and not getattr(base, YIELDS_GRADS, False):
                    return
                try:
                    setattr(g, READ_IN_PLACE_MARK, self._token)
                except (AttributeError, TypeError, RuntimeError):  # a tensor type refusing attributes: no probe
                    return
                self._probe = k
                return

    def flat_call_ok(self) -> bool:
        """Whether torch's fused op may update the whole flat buffers in one call instead of one call per slot:
        the grads are the flat buffer's own views, every slot has one, and the device's fused kernels compute
        an element the same way wherever it sits (`_device.FUSED_POSITION_FREE_DEVICES`), so the bits match the
        per-slot calls. The gaps between slots hold zeros, which the fused updates keep zero. Callers add their
        own conditions (one step count, one first-update flag)."""
        return (
            self.device.type in _device.FUSED_POSITION_FREE_DEVICES
            and not self.gathered
            and not self.n_skipped
            and self.has_grad_buffer
            and self.total > 0
        )

    @property
    def n_first(self) -> int:
        """How many slots have never been updated (their next update applies the first-update rule)."""
        return self._n_first

    @property
    def gathered(self) -> bool:
        """Whether the next update reads grads where they are (`use_gather`), not from the flat grad buffer."""
        return self.gtab is not None

    def updated_slots(self) -> List[int]:
        """Slots with a grad this step (not skipped)."""
        if not self.n_skipped:
            return list(range(self.nseg))
        return [k for k, g in enumerate(self.expected_grads) if g is not None]

    def use_flat(self) -> None:
        """The next kernel call reads the flat grad buffer (grads are our slot views)."""
        self.step_grads = None
        if self.gathered:
            self.gtab = None
            if self.args is not None:
                self.args.gtab = 0

    def sync_grads(self, todo: Optional[List[Tuple[int, torch.Tensor]]] = None) -> int:
        """Re-binds grads that are not our views (values copied in); returns how many were adopted.

        Raises (sparse, dtype, device or shape mismatch) before anything is changed. `todo`: what
        `pending_grads()` returned just before, when nothing can have changed since (saves a pass).
        """
        self.use_flat()
        if todo is None:
            if self.grads_intact():
                return 0
            todo = self.pending_grads()
        self._adopt(todo)
        self.expected_grads = list(map(get_grad, self.params))
        self._refresh_skip()
        return len(todo)

    def out_intact(self) -> bool:
        return self.out_params is None or list(map(data_ptr, self.out_params)) == self.out_ptrs

    def attach_out(self, models: Optional[List[torch.Tensor]]) -> None:
        """Combine low-precision model copies of the params (same layout) for fused O2 copies."""
        self.out_params, self.flat_out, self.out_ptrs = None, None, None
        self.partial_out: Optional[List[tuple]] = None
        if self.args is not None:
            self.args.out = 0
        if models is None:
            return
        if any(m is None for m in models):
            # Only some params have a low-precision model copy (O2 keeps e.g. batchnorm in fp32, where the
            # master is the model param itself): copy just those after each step, with torch ops.
            self.partial_out = [(k, m) for k, m in enumerate(models) if m is not None and m is not self.params[k]]
            return
        self.out_params = list(models)
        self.flat_out = combine_tensors(self.out_params, require_copy_value=True)
        self.out_ptrs = list(map(data_ptr, self.out_params))
        code = _core.DTYPE_CODES.get(self.flat_out.dtype)
        if (
            self.args is not None
            and self.dtype == torch.float32
            and code in (1, 2)
            and self.flat_out.device.type == "cpu"
        ):
            self.args.out = self.flat_out.data_ptr()
            self.args.odt = code

    def copy_out(self, fused: bool = True) -> None:
        """Model copies for executors that could not fuse them (`fused`: the kernel wrote them)."""
        if self.flat_out is not None and (not fused or self.args is None or self.args.out == 0):
            self.flat_out.copy_(self.flat_p)
        elif self.partial_out:
            torch._foreach_copy_([m for _, m in self.partial_out], [self.params[k] for k, _ in self.partial_out])

    # -- after a step -----------------------------------------------------------
    def advance_steps(self) -> None:
        """+1 to the step count of every slot with a grad. With apex_C, one call over the host table (``steps +=
        advance``; an exact 0 or 1 added, the bits of torch's add): a torch op costs several microseconds of
        dispatch, which with one group per param was a tenth of the step."""
        ext = _core.ext
        if ext is not None and self.nseg:
            ext._raw_axpy_(self._advance.data_ptr(), ext.DTYPE_F32, self.steps.data_ptr(), ext.DTYPE_F32, self.nseg,
                           1.0, False, 1)
        else:
            self.steps.add_(self._advance)

    def expose_new_states(self, state: Dict[torch.Tensor, dict]) -> None:
        """After an update: state[p] entries for params updated for the first time (torch's lazy init),
        and the first-update flags of updated segments cleared."""
        if self._n_first:
            if self.n_skipped:
                self.first.mul_(self.skip)  # skipped segments keep their flag
            else:
                self.first.zero_()
            self._n_first = int(self.first.sum())
        if not self._n_unexposed:
            return
        for k, p in enumerate(self.params):
            if self.exposed[k] or self.expected_grads[k] is None:
                continue
            st = state[p]
            if self.has_step:
                bind(st, "step", self.steps[k])
            for name in self.state_names:
                bind(st, name, self.state_views[name][k])
            self.exposed[k] = True
            self._n_unexposed -= 1

    def active_runs(self):
        """(lo, hi, step, k, j) element ranges of consecutive updated segments k..j-1 sharing one step count."""
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
