"""combine_grad: an optimizer's gradients live in flat buffers; unscale + check is one pass per buffer.

Who owns the buffers: an apex optimizer (``combined_grad_buffers()`` of the
optimizer <-> amp protocol, docs/DESIGN-NOTES.md) owns its grad buffers and amp
only reads their layout; for torch.optim optimizers amp combines the grads
itself (one buffer per param group x dtype x device, layout of
``apex.contrib.combine_tensors.plan_layout``). Buffers are built when the grads
need their flat form: at a ``scale_loss`` exit whose grads cannot be read where
they are (O2 twins, combine_ddp, ``check_combined_tensors``, sparse grads), or
before a backward onto grads that are present (kept between steps, or fp16
grads being accumulated); they are rebuilt when the optimizer re-combines
(``recombine_count``), gains a param group or loads a state_dict. With torch's
default ``zero_grad()`` (grads set to None) no buffer is ever made.

Gradient accumulation without a stash: upstream amp moves existing grads aside
before each backward and adds them back, unscaled, at exit. Here the grads stay
in place and carry a known scale (``pending``): before a backward that adds to
non-zero grads, the buffer is multiplied by ``new_scale / pending`` (scales are
powers of two, so this is exact), and the exit divides the whole buffer by the
new scale. When the grads are known to be zero (zero_grad went through amp's
patched methods, or every grad is None), nothing is done before the backward.
fp16 buffers, whose range could overflow when scaled up, keep an fp32 copy of
the old grads instead and add it back after the unscale.

O2: the optimizer steps on fp32 masters; their grad buffer ``M`` has one
low-precision twin ``L`` (same layout) per model dtype holding the model's
grads. The exit writes ``M = L / scale`` (or ``M += L / scale`` while
accumulating) in one pass over each run of master slots; fp32 model params
(batchnorm under keep_batchnorm_fp32) are their own masters and are handled
like O1 grads. A model param that once had a gradient keeps its (zeroed) slot in
``L``; which model params a backward wrote is recorded by a post-accumulate-grad
hook per model param (``used``), so the master of one no backward wrote since
the last step gets None, as without combine_grad, and the optimizer skips it.

Grads left where autograd put them (``zero_grad(set_to_none=True)`` /
``model.zero_grad()`` before the backward): when no buffer needs its flat form
at this exit (no O2 twin, no fp32 stash, no combine_ddp hook, no
``check_combined_tensors``), the exit unscales and checks the grads where they
are (`_unscale.unscale_`: one apex_C call over their address table on CPU,
torch's fused unscale elsewhere) and copies nothing; the optimizer then reads
them in place too. Existing buffers are then "detached" (``gathered``): their
flat form is stale until grads present before a later backward are copied back
into their slots. Accumulating onto detached grads rescales them where they
are (`_prepare_in_place`).

Sharing checks otherwise: grads that are not the expected view objects (``p.grad = None``
then backward, ``p.grad = t``) are adopted at exit; with
``check_combined_tensors`` every view's data pointer is verified as well (this
also catches ``p.grad.data = t``), before the backward and at exit.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
from typing import Dict, List, Optional

import torch

from .. import _core
from .._tensor_utils import get_grad
from ..contrib.combine_tensors import plan_layout
from . import _ddp
from ._unscale import unscale_


def _slot(flat: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``flat`` at element ``offset`` shaped like ``like`` (its dense strides, e.g. channels_last)."""
    stride = torch.empty_like(like, device="meta").stride()
    return flat.as_strided(like.shape, stride, flat.storage_offset() + offset)


def _points_at(t: torch.Tensor, flat: torch.Tensor, offset: int) -> bool:
    if t.numel() == 0:
        return True
    return t.data_ptr() == flat.data_ptr() + offset * flat.element_size()


class _Low:
    """Model-side (low-precision) twin of a master grad buffer (O2)."""

    def __init__(self, flat: torch.Tensor, slots: List[int], views: Dict[int, torch.Tensor],
                 models: List[torch.Tensor]):
        self.flat = flat
        self.slots = slots
        self.views = views
        self.models = models  # aligned with slots
        self.view_list = [views[i] for i in slots]  # aligned with slots
        self.expected = [m.grad if m.grad is views[i] else None for m, i in zip(models, slots)]


class _Buffer:
    def __init__(self, flat: torch.Tensor, params: List[torch.Tensor], offsets: List[int],
                 views: List[Optional[torch.Tensor]], owner: str):
        self.flat = flat
        self.params = params
        self.offsets = offsets
        self.views = views  # the tensor each p.grad is expected to be (None: no grad)
        self.slot_views: Optional[List[torch.Tensor]] = None  # amp-owned: the view to bind for each slot
        self.owner = owner  # "amp" or "optimizer"
        self.models: List[Optional[torch.Tensor]] = [None] * len(params)
        self.lows: Dict[torch.dtype, _Low] = {}
        self.main_idx = list(range(len(params)))
        self.main_ids = frozenset(map(id, params))
        self.master_idx: List[int] = []  # O2: slots of masters (their model param is in ``models``)
        self.unbound: List[int] = []  # master slots whose grad amp set to None until the next exit writes them
        self.runs = [(None, 0, flat.numel())]
        self.known_zero = False
        self.stash: Optional[torch.Tensor] = None
        self._stash_buf: Optional[torch.Tensor] = None

    def zero_slot(self, i: int) -> None:
        self.flat.narrow(0, self.offsets[i], self.params[i].numel()).zero_()

    def finish_layout(self) -> None:
        self.main_idx = [i for i, m in enumerate(self.models) if m is None]
        self.main_ids = frozenset(id(self.params[i]) for i in self.main_idx)
        self.master_idx = [i for i, m in enumerate(self.models) if m is not None]
        runs = []
        for i, p in enumerate(self.params):
            kind = None if self.models[i] is None else self.models[i].dtype
            lo, hi = self.offsets[i], self.offsets[i] + p.numel()
            if runs and runs[-1][0] == kind:
                runs[-1][2] = hi
            else:
                runs.append([kind, lo, hi])
        self.runs = [tuple(r) for r in runs]

    def stash_buffer(self) -> torch.Tensor:
        if self._stash_buf is None:
            self._stash_buf = torch.zeros(self.flat.numel(), dtype=torch.float32, device=self.flat.device)
        return self._stash_buf


def _expected_sets(optimizer) -> List[List[torch.Tensor]]:
    """The params behind each of an apex optimizer's flat buffers: per group, per (dtype, device), in order."""
    sets = []
    for group in optimizer.param_groups:
        kinds: Dict[tuple, List[torch.Tensor]] = {}
        for p in group["params"]:
            kinds.setdefault((p.dtype, p.device), []).append(p)
        sets.extend(kinds.values())
    return sets


class CombinedGrads:
    """Flat grad buffers of one optimizer and the per-step logic around them."""

    def __init__(self, stash) -> None:
        self.stash = stash
        self.optimizer = stash.optimizer
        self.check_full = stash.check_combined_tensors
        self.buffers: Optional[List[_Buffer]] = None
        self.recombine_seen: Optional[int] = None
        self.pending = 1.0  # scale the models-are-masters grads carry
        self.masters_have_grads = False  # O2: master grads hold values to accumulate onto
        self.discard = False  # grads are garbage (skipped step): zero them before the next backward
        self.folded = False  # last exit left the grads scaled for the optimizer to unscale
        self.low_dirty = False  # O2: model grads were consumed by an exit; zero them before the next backward
        self.low_pending: Optional[float] = None  # O2: scale the model grads carry
        self.exited = False  # a scale_loss exit has unscaled (or folded) grads: ``pending`` means something
        # zero_grad(set_to_none=False) while there are no buffers: which grads are known to be zero (all, or
        # the params of the modules zeroed), so that the buffers built before the next backward skip the
        # rescale pass over them
        self.zeroed_all = False
        self.zeroed_ids: set = set()
        self.gathered = False  # the main grads were unscaled where they are: the flat buffers are stale
        # O2: ids of the model params a backward wrote since the masters last dropped their grads (filled by a
        # post-accumulate-grad hook per model param, which is a C-level call: a partial of dict.__setitem__)
        self.used: Dict[int, torch.Tensor] = {}
        self._hooks: list = []
        self._hooked: set = set()
        self._left_out: List[torch.Tensor] = []  # frozen params the amp-owned buffers have no slot for

    # ------------------------------------------------------------ structure
    @property
    def built(self) -> bool:
        return self.buffers is not None

    def invalidate(self) -> None:
        self.buffers = None
        self.gathered = False
        self.remove_hooks()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._hooked = set()

    def flat_buffers(self) -> List[torch.Tensor]:
        return [] if self.buffers is None else [b.flat for b in self.buffers]

    def _build(self, scale: float, at_first_exit: bool = False) -> None:
        """``at_first_exit``: built at the exit of a backward no hook watched (see `_attach_lows`)."""
        self.remove_hooks()
        stash, opt = self.stash, self.optimizer
        model_of = {id(m): model for m, model in stash.pairs}
        with torch.no_grad():
            for group in opt.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is not None and (g.is_sparse or g.layout != torch.strided):
                        raise RuntimeError("combine_grad does not support sparse gradients")
            if stash.ours:
                buffers = self._adopt_optimizer_buffers(model_of)
            else:
                buffers = self._make_buffers(model_of)
            for b in buffers:
                self._attach_lows(b, model_of, at_first_exit)
        if self.low_pending is None:
            self.low_pending = scale  # first build: the model grads are this backward's
        self.buffers = buffers
        self.gathered = False

    def _adopt_optimizer_buffers(self, model_of) -> List[_Buffer]:
        opt = self.optimizer
        for master, model in self.stash.pairs:
            # The optimizer combines grads that exist; the exit pass fills these in.
            if master.grad is None and model.grad is not None:
                master.grad = torch.zeros_like(master)
        flats = opt.combined_grad_buffers()
        sets = _expected_sets(opt)
        name = type(opt).__name__
        if len(flats) != len(sets):
            raise RuntimeError(
                f"apex.amp: {name}.combined_grad_buffers() returned {len(flats)} buffers; the layout contract "
                f"(one per param group x dtype x device) expects {len(sets)}"
            )
        buffers = []
        for k, (flat, ps) in enumerate(zip(flats, sets)):
            offsets, total = plan_layout(ps)
            if flat.numel() != total or flat.dtype != ps[0].dtype:
                raise RuntimeError(
                    f"apex.amp: buffer {k} of {name}.combined_grad_buffers() has {flat.numel()} {flat.dtype} "
                    f"elements; plan_layout of its params gives {total} {ps[0].dtype}"
                )
            views = []
            for i, (p, off) in enumerate(zip(ps, offsets)):
                g = p.grad
                if g is not None and not _points_at(g, flat, off):
                    raise RuntimeError(
                        f"apex.amp: grad of param {i} in buffer {k} of {name} is not at its planned slot"
                    )
                views.append(g)
            buffers.append(_Buffer(flat, ps, offsets, views, "optimizer"))
        self.recombine_seen = opt.recombine_count
        return buffers

    def _make_buffers(self, model_of) -> List[_Buffer]:
        """amp-owned buffers (torch.optim optimizers): slots for the params that can get a grad. A master counts
        by its model param (it was made with the model's requires_grad, and does not follow a later change); the
        frozen ones left out are watched (`_unfrozen`), and unfreezing one rebuilds the buffers."""
        buffers = []
        self._left_out = []
        for group in self.optimizer.param_groups:
            kinds: Dict[tuple, List[torch.Tensor]] = {}
            for p in group["params"]:
                model = model_of.get(id(p))
                if p.requires_grad if model is None else model.requires_grad:
                    kinds.setdefault((p.dtype, p.device), []).append(p)
                else:
                    self._left_out.append(p if model is None else model)
            for ps in kinds.values():
                offsets, total = plan_layout(ps)
                flat = torch.zeros(total, dtype=ps[0].dtype, device=ps[0].device)
                slot_views = [_slot(flat, p, off) for p, off in zip(ps, offsets)]
                for p, v in zip(ps, slot_views):
                    g = p.grad
                    if g is not None:
                        v.copy_(g)
                        p.grad = v
                    elif id(p) in model_of and model_of[id(p)].grad is not None:
                        p.grad = v  # a master whose grad the exit pass is about to write
                b = _Buffer(flat, ps, offsets, [p.grad for p in ps], "amp")
                b.slot_views = slot_views
                buffers.append(b)
        return buffers

    def _attach_lows(self, b: _Buffer, model_of, at_first_exit: bool = False) -> None:
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for i, p in enumerate(b.params):
            model = model_of.get(id(p))
            if model is not None:
                b.models[i] = model
                by_dtype.setdefault(model.dtype, []).append(i)
        mark = functools.partial(dict.__setitem__, self.used)
        for dtype, slots in by_dtype.items():
            flat = torch.zeros(b.flat.numel(), dtype=dtype, device=b.flat.device)
            views = {}
            for i in slots:
                model = b.models[i]
                v = _slot(flat, model, b.offsets[i])
                if model.grad is not None:
                    v.copy_(model.grad)
                    model.grad = v
                    if at_first_exit:  # written by the backward(s) before any hook was there; later, the hooks tell
                        self.used[id(model)] = model
                views[i] = v
                if model.requires_grad:  # (a frozen param takes no hook; see _unbind_unused)
                    self._hooks.append(model.register_post_accumulate_grad_hook(functools.partial(mark, id(model))))
                    self._hooked.add(id(model))
            b.lows[dtype] = _Low(flat, slots, views, [b.models[i] for i in slots])
        b.finish_layout()

    # ------------------------------------------------------------ checks
    def _views_valid(self, b: _Buffer) -> bool:
        for i, v in enumerate(b.views):
            if v is not None and not _points_at(v, b.flat, b.offsets[i]):
                return False
        return True

    def _heal_pointers(self, b: _Buffer) -> None:
        """check_combined_tensors: grads whose data was rebound elsewhere are copied back into their slot."""
        for i, v in enumerate(b.views):
            if v is not None and not _points_at(v, b.flat, b.offsets[i]):
                slot = _slot(b.flat, b.params[i], b.offsets[i])
                slot.copy_(v)
                v.data = slot
        for low in b.lows.values():
            for i, v in low.views.items():
                if not _points_at(v, low.flat, b.offsets[i]):
                    slot = _slot(low.flat, b.models[i], b.offsets[i])
                    slot.copy_(v)
                    v.data = slot

    def _optimizer_grads_in_place(self) -> bool:
        """Every grad of an apex optimizer is still the view object it was (identity only: cheap)."""
        if self.optimizer.recombine_count != self.recombine_seen:
            return False
        for b in self.buffers:
            if not all(map(operator.is_, map(get_grad, b.params), b.views)):
                return False
        return True

    def _main_grads_bound(self) -> bool:
        """Every main grad is the view object the buffers expect (nothing to gather)."""
        return all(all(map(operator.is_, map(get_grad, b.params), b.views)) for b in self.buffers)

    def _sync_main_at_exit(self, b: _Buffer) -> None:
        grads = list(map(get_grad, b.params))
        if all(map(operator.is_, grads, b.views)):
            return
        for i, g in enumerate(grads):
            if g is b.views[i]:
                continue
            if g is None:
                b.zero_slot(i)  # no grad this time: keep the whole-buffer pass clean of stale values
                b.views[i] = None
            elif b.owner == "optimizer":
                b.views[i] = g  # the optimizer adopted it into its slot
            else:
                v = b.slot_views[i]
                if v is not g:
                    v.copy_(g)
                    b.params[i].grad = v
                b.views[i] = v

    def _sync_lows(self, b: _Buffer, before_backward: bool) -> None:
        """Model grads (O2) back into their slots; a model grad that appears binds its master's grad too."""
        unbound_masters = []
        for low in b.lows.values():
            if all(map(operator.is_, map(get_grad, low.models), low.expected)):
                continue
            for k, i in enumerate(low.slots):
                model, v = low.models[k], low.views[i]
                g = model.grad
                if g is low.expected[k]:
                    continue
                if g is None:
                    v.zero_()
                    if before_backward:  # dropped by zero_grad(set_to_none=True): keep the slot bound
                        model.grad = v
                    else:
                        low.expected[k] = None
                    continue
                if g is not v:
                    v.copy_(g)
                    model.grad = v
                low.expected[k] = v
                if b.params[i].grad is None:
                    unbound_masters.append(i)
        if unbound_masters:
            self._bind_masters(b, unbound_masters)

    def _bind_masters(self, b: _Buffer, slots: List[int]) -> None:
        """Masters whose model param got its first gradient: give them a grad in the master buffer."""
        if b.unbound:
            self._rebind_masters()
            slots = [i for i in slots if b.params[i].grad is None]
            if not slots:
                return
        if b.owner == "amp":
            for i in slots:
                b.params[i].grad = b.views[i] = b.slot_views[i]
            return
        for i in slots:
            b.params[i].grad = torch.zeros_like(b.params[i])
        self.optimizer.combined_grad_buffers()  # the optimizer adopts them into its buffer
        self.recombine_seen = self.optimizer.recombine_count
        for i in slots:
            b.views[i] = b.params[i].grad

    # ------------------------------------------------------------ per step
    def prepare(self, scale: float) -> None:
        """Before a backward whose loss is multiplied by ``scale``."""
        discard = self.discard
        pairs = self.stash.pairs
        if self.buffers is None and (pairs or not self.exited):
            # O2 masters, or the first backward. Grads to discard (an overflow, a block that raised) are still
            # plain tensors here: let them all go (masters', fp32 params', the model's). So do model grads an exit
            # already consumed (the buffers were dropped since: a loaded state_dict, a new param group), which
            # would otherwise be counted again by the rebuilt buffers.
            if discard:
                for p in [*(m for _, m in pairs), *(p for g in self.optimizer.param_groups for p in g["params"])]:
                    p.grad = None
                self.discard = False
                self.masters_have_grads = False
                self._forget_used()
                self.low_dirty = False
            elif self.low_dirty and pairs:
                for _, model in pairs:
                    model.grad = None
                self.low_dirty = False
            if not (pairs and self.exited):
                return  # the first backward: its grads are combined (or read in place) at its exit
            # O2 after a re-layout: the buffers are built now, so the grads held (fp32 params' at their pending
            # scale, masters' accumulated ones) are carried into them as the bound ones are
        elif self.gathered or self.buffers is None:
            with torch.no_grad():
                if self._prepare_in_place(scale, discard):
                    self._after_prepare(scale, discard)
                    return
        if self._unfrozen():
            self.invalidate()
        with torch.no_grad():
            if self.buffers is None or (self.stash.ours and self.optimizer.recombine_count != self.recombine_seen):
                # New param group, loaded state_dict, or the optimizer re-combined: map the grads again now,
                # so grads accumulated so far keep their known scale.
                self._build(scale)
                for b in self.buffers:
                    b.known_zero = self.zeroed_all or b.main_ids <= self.zeroed_ids
            low_dirty = self.low_dirty or discard
            if self.gathered:
                self._reattach(scale)
            for b in self.buffers:
                if self.check_full and not self._views_valid(b):
                    self._heal_pointers(b)
                if discard:
                    _core.fill_(b.flat, 0.0)
                    b.known_zero = True
                    b.stash = None
                for low in b.lows.values():
                    if low_dirty:
                        _core.fill_(low.flat, 0.0)
                    elif self.low_pending != scale:
                        _core.scale_(low.flat, scale / self.low_pending, check=False)
                self._sync_lows(b, before_backward=True)
                if not b.known_zero and self.pending != scale:
                    if any(b.params[i].grad is not None for i in b.main_idx):
                        self._rescale_main(b, scale)
                b.known_zero = False
        self._after_prepare(scale, discard)

    def _unfrozen(self) -> bool:
        """A param left out of the amp-owned buffers as frozen requires grad now: its next grads need a slot."""
        return bool(self._left_out) and any(p.requires_grad for p in self._left_out)

    def _after_prepare(self, scale: float, discard: bool) -> None:
        self.zeroed_all = False
        self.zeroed_ids = set()
        if discard:
            self.masters_have_grads = False
            self._forget_used()
            self.discard = False
        self.low_dirty = False
        self.low_pending = scale
        self.pending = scale

    def _prepare_in_place(self, scale: float, discard: bool) -> bool:
        """Grads no buffer holds (unscaled where autograd left them, or no buffers since a re-layout): prepare
        them for this backward where they are, if that needs no flat form; False if they are to be combined.

        None present (torch's default ``zero_grad()``): nothing to do, and no buffer is ever made. Present and
        known to be zero (``zero_grad(set_to_none=False)``: kept between steps): False, they are combined once, as
        an apex optimizer adopts kept grads, and later exits find them bound. Otherwise they are being
        accumulated: a skipped step's are zeroed, and grads that carry another scale are multiplied by
        ``scale / pending`` in place (powers of two: exact, the bits of the flat pass), except fp16 ones
        growing, which could overflow and keep their old values in the buffers' fp32 stash instead.
        """
        params = ([p for group in self.optimizer.param_groups for p in group["params"]] if self.buffers is None
                  else [p for b in self.buffers for p in b.params])
        present = [p for p in params if p.grad is not None]
        if not present:
            return True
        if self.zeroed_all or self.zeroed_ids.issuperset(map(id, present)):
            return False
        gs = [p.grad for p in present]
        if any(g.layout != torch.strided for g in gs):
            return False  # the buffers' build refuses them, with its message
        if discard:
            torch._foreach_zero_(gs)
            return True
        factor = scale / self.pending
        if factor == 1.0:
            return True
        if factor > 1.0 and any(g.dtype == torch.float16 for g in gs):
            return False
        unscale_(gs, factor, check=False)
        return True

    def _reattach(self, scale: float) -> None:
        """Before a backward onto grads that were unscaled where they are: present ones (kept by
        ``zero_grad(set_to_none=False)``, or being accumulated) go back into the flat buffers, where this
        backward's bookkeeping (rescale, zeroing a skipped step's grads) works and later exits find them bound;
        grads set to None stay unbuffered (see `_prepare_in_place`).
        """
        if not any(g is not None for b in self.buffers for g in map(get_grad, b.params)):
            return
        if self.stash.ours:
            flats = self.optimizer.combined_grad_buffers()  # the optimizer copies them into its slots
            self.recombine_seen = self.optimizer.recombine_count
            if len(flats) != len(self.buffers) or any(f is not b.flat for f, b in zip(flats, self.buffers)):
                self._build(scale)
        for b in self.buffers:
            self._sync_main_at_exit(b)
        self.gathered = False

    def _gather_ready(self) -> bool:
        """This exit may unscale the grads where they are (see the module docstring); before any buffer exists,
        only without O2 masters (whose grads are written from the model's, through the buffers)."""
        if self.check_full or self.stash.session.ddp is not None:
            return False
        if self.buffers is None:
            return not self.stash.pairs
        return all(not b.lows and b.stash is None for b in self.buffers)

    def _unscale_gathered(self, scale: float, check: bool, fold: bool) -> Optional[bool]:
        """Unscale + non-finite check over the grads where they are; None if they cannot be used so (a sparse
        grad, which the buffers' build refuses with its message, or one tensor bound as the grad of two params,
        which a second scale would corrupt)."""
        if self.buffers is None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
        else:
            params = [p for b in self.buffers for p in b.params]
        gs = [g for g in map(get_grad, params) if g is not None]
        if any(g.layout != torch.strided for g in gs):
            return None
        ptrs = [g.data_ptr() for g in gs if g.numel()]
        if len(set(ptrs)) != len(ptrs):
            return None
        found = unscale_(gs, 1.0 if fold else 1.0 / scale, check)
        self.pending = scale if fold else 1.0
        self.folded = fold
        self.gathered = True
        for b in self.buffers or ():
            b.known_zero = False
        return bool(found)

    def _rescale_main(self, b: _Buffer, scale: float) -> None:
        factor = scale / self.pending
        # Grads that are not their slot's view (a delay_unscale backward after zero_grad(set_to_none=True) made
        # fresh ones; the exit copies them into their slots) carry the scale too: rescaled where they are.
        fresh = [g for i in b.main_idx if (g := b.params[i].grad) is not None and g is not b.views[i]]
        if fresh:
            unscale_(fresh, factor, check=False)
        if not b.lows:
            if b.flat.dtype == torch.float16 and factor > 1.0:
                # fp16 could overflow when scaled up: keep the old grads aside in fp32 instead.
                b.stash = b.stash_buffer()
                _core.scale_(b.flat, 1.0 / self.pending, out=b.stash, check=False)
                _core.fill_(b.flat, 0.0)
            else:
                _core.scale_(b.flat, factor, check=False)
            return
        for kind, lo, hi in b.runs:
            if kind is None:
                _core.scale_(b.flat[lo:hi], factor, check=False)

    def unscale(self, scale: float, check: bool, fold: bool) -> bool:
        """At scale_loss exit: unscale (unless folded) and report whether any grad is inf/nan."""
        self.exited = True
        self.zeroed_all = False
        self.zeroed_ids = set()
        self._rebind_masters()
        with torch.no_grad():
            if self.buffers is None:
                found = self._unscale_gathered(scale, check, fold) if self._gather_ready() else None
                if found is not None:
                    return found
                self._build(scale, at_first_exit=True)
            else:
                in_place = self.stash.ours and self._optimizer_grads_in_place()
                if not in_place and self._gather_ready() and not self._main_grads_bound():
                    found = self._unscale_gathered(scale, check, fold)
                    if found is not None:
                        return found
                self.gathered = False  # the adoption below brings every grad back into the buffers
                if self.stash.ours and not in_place:
                    # Fresh grads (after set_to_none) or a re-combine: the optimizer adopts them into its buffers.
                    flats = self.optimizer.combined_grad_buffers()
                    self.recombine_seen = self.optimizer.recombine_count
                    if len(flats) != len(self.buffers) or any(f is not b.flat for f, b in zip(flats, self.buffers)):
                        self._build(scale)
                for b in self.buffers:
                    if self.check_full and not self._views_valid(b):
                        self._heal_pointers(b)
                    if not in_place:
                        self._sync_main_at_exit(b)
                    if b.lows:
                        self._sync_lows(b, before_backward=False)
            _ddp.call(self.stash.session.ddp, "before_unscale", self)  # combine_ddp: all-reduce hook point
            if self.stash.session.ddp is not None:
                for b in self.buffers:
                    if b.lows:  # O2: a model param unused here got the reduced grad: its master needs one too
                        self._sync_lows(b, before_backward=False)
            found = self._unscale_pass(scale, check, fold)
            self._unbind_unused()
            return found

    def _unscale_pass(self, scale: float, check: bool, fold: bool) -> bool:
        inv = 1.0 / scale
        fold_now = fold and all(b.stash is None and not b.lows for b in self.buffers)
        found = False
        for b in self.buffers:
            if b.lows:
                for kind, lo, hi in b.runs:
                    dst = b.flat[lo:hi]
                    if kind is None:
                        found |= _core.scale_(dst, inv, check=check)
                    elif self.masters_have_grads:
                        found |= _core.axpy_(b.lows[kind].flat[lo:hi], dst, inv, check=check)
                    else:
                        found |= _core.scale_(b.lows[kind].flat[lo:hi], inv, out=dst, check=check)
                self.low_dirty = True
            elif fold_now:
                if check:
                    found |= _core.has_nonfinite(b.flat)
            else:
                if check or inv != 1.0:
                    found |= _core.scale_(b.flat, inv, check=check)
                if b.stash is not None:
                    _core.axpy_(b.stash, b.flat, 1.0, check=False)
                    b.stash = None
        if any(b.lows for b in self.buffers):
            self.masters_have_grads = True
        self.pending = scale if fold_now else 1.0
        self.folded = fold_now
        return bool(found)

    def delayed_exit(self) -> None:
        """delay_unscale: the grads keep the scale of this backward."""
        self.folded = False

    # ------------------------------------------------------------ zeroing, steps
    def mark_zeroed(self, param_ids=None) -> None:
        """All models-are-masters grads (or those of the given params) were zeroed in place."""
        if param_ids is None:
            self.zeroed_all = True
        else:
            self.zeroed_ids |= param_ids
        if self.buffers is None:
            return
        for b in self.buffers:
            if param_ids is None or b.main_ids <= param_ids:
                b.known_zero = True
                b.stash = None

    def drop_master_grads(self, model_ids: frozenset) -> None:
        """O2 ``model.zero_grad()`` between backwards: the masters of those model params lose what they
        accumulated since the last step. When every master's model param is among them, the next exit writes the
        master buffer instead of adding to it (one flag); otherwise their master slots are zeroed, so the next
        exit adds this backward's grads to zero there and to the accumulated grads of the models not zeroed.
        Nothing to do when the masters hold no grads yet (after a step, the usual place for ``zero_grad``)."""
        self._forget_used(model_ids)  # (also when no exit came yet: a delayed block's backward may have marked them)
        if not self.masters_have_grads:
            return
        if self.buffers is None:
            self._unbind_masters(model_ids)
            return
        slots = [(b, i) for b in self.buffers for i in b.master_idx]
        dropped = [(b, i) for b, i in slots if id(b.models[i]) in model_ids]
        if len(dropped) == len(slots):
            self._masters_emptied()
            return
        with torch.no_grad():
            for b, i in dropped:
                b.zero_slot(i)
        self._unbind_masters(model_ids)

    def _unbind_masters(self, model_ids: Optional[frozenset] = None) -> None:
        """O2: masters whose grads were consumed (a step), dropped (``zero_grad``) or discarded (a skipped step)
        hold no grad until the next exit writes theirs, as without combine_grad: a ``step()`` or a clip before
        that exit must not see the buffer's stale values. Their grads are set to None; the view objects are kept
        and bound again at that exit (`_rebind_masters`), so the optimizer still finds its own views there. With no
        buffers (dropped by a re-layout until the next backward) the masters' grads are plain tensors: set to None,
        as without combine_grad."""
        if self.buffers is None:
            for master, model in self.stash.pairs:
                if model_ids is None or id(model) in model_ids:
                    master.grad = None
            return
        for b in self.buffers:
            idx = b.master_idx if model_ids is None else [i for i in b.master_idx if id(b.models[i]) in model_ids]
            if not idx:
                continue
            ps, views = [b.params[i] for i in idx], [b.views[i] for i in idx]
            if all(map(operator.is_, map(get_grad, ps), views)) and None not in views:
                # the usual case, at every step: one C-level pass (an O2 run with many small params steps often)
                collections.deque(map(setattr, ps, itertools.repeat("grad"), itertools.repeat(None)), maxlen=0)
                b.unbound.extend(idx)
                continue
            for i, p, v in zip(idx, ps, views):
                if v is not None and p.grad is v:
                    p.grad = None
                    b.unbound.append(i)

    def _masters_emptied(self) -> None:
        """The masters' grads were consumed or dropped (a step, a skipped step, ``zero_grad``): the next exit writes
        the master buffer instead of adding to it, the record of written params starts again, and the masters have
        no grad until then."""
        self.masters_have_grads = False
        self._forget_used()
        self._unbind_masters()

    def _unbind_unused(self) -> None:
        """O2, after an exit wrote the master buffer: masters whose model param no backward wrote since the masters
        last dropped their grads get None, as without combine_grad (the model's grad view stays bound, zero, for
        the next backward). Their slots in the buffer are zero, so an exit that accumulates later adds to zero.
        Not with combine_ddp: the all-reduce gives every param this rank left unused the other ranks' grads. Nor
        for a param frozen when the buffers were built and unfrozen since: it has no hook to tell, so its master
        keeps a (zero) grad when unused rather than risk dropping grads it did get."""
        if self.buffers is None or self.stash.session.ddp is not None:
            return
        unused = self._hooked.difference(self.used)
        if unused:
            self._unbind_masters(frozenset(unused))

    def _forget_used(self, model_ids: Optional[frozenset] = None) -> None:
        if model_ids is None:
            self.used.clear()
        else:
            for k in model_ids:
                self.used.pop(k, None)

    def _rebind_masters(self) -> None:
        """The masters `_unbind_masters` left without a grad get their views back; the exit that follows writes
        their values. A grad the user gave a master meanwhile is accumulated onto, as without combine_grad: it is
        copied into the master's slot, and the exit adds to the master buffer (zeroed first where nothing else was
        held) instead of writing it."""
        user = []
        for b in self.buffers or ():
            if b.unbound:
                ps = [b.params[i] for i in b.unbound]
                if all(map(operator.is_, map(get_grad, ps), itertools.repeat(None))):
                    collections.deque(map(setattr, ps, itertools.repeat("grad"), [b.views[i] for i in b.unbound]),
                                      maxlen=0)
                else:
                    for i, p in zip(b.unbound, ps):
                        g = p.grad
                        if g is None:
                            p.grad = b.views[i]
                        elif g is not b.views[i]:
                            user.append((b, i, g))
                b.unbound = []
        if not user:
            return
        with torch.no_grad():
            if not self.masters_have_grads:
                for b in self.buffers:
                    for kind, lo, hi in b.runs:
                        if kind is not None:
                            _core.fill_(b.flat[lo:hi], 0.0)
                self.masters_have_grads = True
            for b, i, g in user:
                b.views[i].copy_(g)
                b.params[i].grad = b.views[i]

    def zero_o2(self, set_to_none: bool) -> None:
        """O2 optimizer.zero_grad: model grads zeroed, masters marked empty, fp32 params as torch does."""
        with torch.no_grad():
            for b in self.buffers:
                for low in b.lows.values():
                    _core.fill_(low.flat, 0.0)
                    # model grads not (yet) bound to their views, e.g. made by the first backward after a
                    # re-layout: zeroed or dropped as torch's zero_grad would, or a later exit adds them back
                    if not all(map(operator.is_, map(get_grad, low.models), low.view_list)):
                        for m, v in zip(low.models, low.view_list):
                            if m.grad is not None and m.grad is not v:
                                if set_to_none:
                                    m.grad = None
                                else:
                                    m.grad.zero_()
                for i in b.main_idx:
                    p = b.params[i]
                    if p.grad is None:
                        continue
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
                if not set_to_none:
                    b.known_zero = True
        self.low_dirty = False
        self._masters_emptied()  # either way, as upstream's O2 zero_grad drops master grads

    def folded_scale(self) -> Optional[float]:
        """The scale the grads still carry for the optimizer to divide out, or None."""
        if not self.folded or self.pending == 1.0:
            return None
        return self.pending

    def after_step(self, unscaled_in_place: bool) -> None:
        self._masters_emptied()
        if unscaled_in_place:  # torch's fused kernels write the unscaled grads back
            self.pending = 1.0
            self.folded = False

    def after_skip(self) -> None:
        self.discard = True
        self.folded = False
        self._masters_emptied()
