"""Optimizer side of amp: master weights, per-instance method patches, unscaling at scale_loss exit.

Each optimizer passed to ``amp.initialize`` gets an ``_amp_stash`` (upstream's
name; its presence is how "passed twice" is detected) and instance attributes
shadowing ``step``, ``zero_grad`` and ``add_param_group`` (plus ``state_dict`` /
``load_state_dict`` under master weights), removed again on teardown.

Without combine_grad the gradient bookkeeping is upstream's: before a scaled
backward the existing grads are moved aside (stashed) and ``p.grad`` set to
None, so the backward produces only the new, scaled grads; at exit those are
unscaled and checked, and the stashed grads are added back. Under master
weights (O2) the fp32 master grads are the accumulators: the model's
low-precision grads are dropped before each backward and, at exit, unscaled
into the master grads (created, or added to).
"""

from __future__ import annotations

import types
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from .._checkpoint_keys import AMP_MASTERS_KEY as MASTER_KEY
from .._checkpoint_keys import AMP_SCALERS_KEY as SCALER_KEY
from .._tensor_utils import zero_grad_
from ._amp_state import _amp_state, logger, maybe_log
from ._combined import CombinedGrads
from ._model import InstancePatch, master_where_kept
from ._unscale import unscale_
from .scaler import check_scaler_states, scaler_states

_LOW_DTYPES = (torch.float16, torch.bfloat16)


def _zero(p: torch.Tensor, set_to_none: bool) -> None:
    """One param's grad as torch's ``zero_grad`` treats it: dropped, or zeroed in place."""
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
    else:
        zero_grad_(p.grad)


# ---------------------------------------------------------------- the stash


class AmpStash:
    """amp's per-optimizer state."""

    def __init__(self, optimizer: torch.optim.Optimizer, session: Any) -> None:
        props = session.properties
        self.optimizer = optimizer
        self.session = session
        self.master_weights = bool(props.master_weights)
        self.check_combined_tensors = bool(props.check_combined_tensors)
        self.params_have_scaled_gradients = False
        # (loss_id, scaler, scale) of the open delay_unscale chain: the grads carry that scale until an exit
        # without delay_unscale (or the next step(), see `close_delayed_chain`) unscales them
        self.delayed_chain: Optional[Tuple[int, Any, float]] = None
        self.open_block: Optional[Any] = None  # the innermost scale_loss block open on this optimizer (handle.py)
        # O2: a backward outside scale_loss reached the model params since the last exit (`watch_model_backward`)
        self.outside_backward = False
        self._backward_probe: Optional[Any] = None
        self.skip_pending: Optional[Tuple[int, Any]] = None  # (loss_id, scaler) of the overflow to report
        self.skip_after_error = False  # a combined scale_loss block raised: its grads are dropped, not stepped on
        self.carried_overflow = False  # a delay_overflow_check exit found inf/nan in these grads (see scale_loss)
        self.drop_at_next_backward = False  # the grads overflowed: the next backward starts from none
        self.pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (fp32 master, low-precision model param)
        self.master_ids: set = set()
        self.model_versions: List[int] = []
        # apex optimizers (the DESIGN-NOTES protocol) vs anything else
        self.ours = callable(getattr(optimizer, "combined_grad_buffers", None)) and hasattr(
            optimizer, "apex_grad_scale"
        )
        self.attached = False  # master -> model copy done inside the optimizer's step
        self.attach_checked = False  # the first real step verified that the optimizer really copies
        self.combined: Optional[CombinedGrads] = None
        self.fold = False
        self.patches: List[InstancePatch] = []
        self._stash_params: Optional[List[torch.Tensor]] = None
        self._grad_stash: Optional[List[Optional[torch.Tensor]]] = None
        self.torn_down = False
        # Upstream's flags, read and set by checkpoint code written for it (see `lazy_init`). The masters exist
        # from initialize on, so the lazy initialization counts as done; setting the flags changes nothing.
        self.lazy_init_called = True
        self.already_patched = False
        # loss_id -> (scale, unskipped) from this optimizer's checkpoint, for the losses it has not been scaled
        # with since (see `take_pending_scaler`)
        self.pending_scalers: Dict[int, Tuple[float, int]] = {}

    # ------------------------------------------------------------ capability
    @property
    def torch_fused(self) -> bool:
        """A torch.optim optimizer whose fused kernel unscales and skips in-kernel (grad_scale/found_inf)."""
        opt = self.optimizer
        return (not self.ours and bool(getattr(opt, "_step_supports_amp_scaling", False))
                and all(g.get("fused") for g in opt.param_groups))

    def plain_params(self) -> List[torch.Tensor]:
        """Params that are their own masters (all of them without master weights)."""
        ids = self.master_ids
        return [p for g in self.optimizer.param_groups for p in g["params"] if id(p) not in ids]

    @property
    def holds_stashed_grads(self) -> bool:
        """Grads are set aside for the next real exit (see `prepare_backward`)."""
        return self._grad_stash is not None

    # ------------------------------------------------------------ masters
    def make_masters(self) -> None:
        opt = self.optimizer
        for gi, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                if p.dtype not in _LOW_DTYPES and p.dtype != torch.float32:
                    raise TypeError(
                        f"Optimizer's parameters must be float32, float16 or bfloat16 for master weights; "
                        f"param {i} of group {gi} is {p.dtype}"
                    )
        # masters of an O2 checkpoint loaded into an apex optimizer before amp.initialize: exact resume
        loaded = getattr(opt, "loaded_amp_masters", None)
        if loaded is not None:
            opt.loaded_amp_masters = None
            flat = [p for g in opt.param_groups for p in g["params"]]
            if len(loaded) != len(flat):
                loaded = None
        if loaded is None and any(opt.state.get(p) for g in opt.param_groups for p in g["params"]):
            logger.warning(
                "apex.amp: %s has state before amp.initialize (e.g. a checkpoint loaded first); its fp32 master "
                "weights are made from the model's %s weights, so a resumed O2 run is not bit-identical to the "
                "saved one. Load the optimizer state after amp.initialize (or use an apex optimizer, which keeps "
                "the checkpoint's masters) for an exact resume.", type(opt).__name__, self.session.low_dtype)
        index = 0
        for group in opt.param_groups:
            n = len(group["params"])
            group["params"] = self._masters_for(group["params"], loaded[index:index + n] if loaded else None)
            index += n
        # Recast per-param state (e.g. from a loaded checkpoint) to the masters' dtype.
        opt.load_state_dict(opt.state_dict())
        self._attach()
        self.watch_model_backward()

    def watch_model_backward(self) -> None:
        """Under master weights only a scale_loss exit brings the model's grads to the masters the optimizer
        updates: a backward run outside any scale_loss block (``loss.backward()`` with amp left out) reaches no
        master, and the step would silently leave those params alone. A post-accumulate-grad hook on one model
        param (the first that takes grads: one call per backward, whatever the model's size) notes such a
        backward; the step warns (`step`). The hook holds the stash weakly and is removed on teardown."""
        if self._backward_probe is not None or not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            return
        model = next((m for _, m in self.pairs if m.requires_grad), None)
        if model is None:
            return
        ref = weakref.ref(self)

        def saw_backward(param: torch.Tensor) -> None:
            stash = ref()
            if stash is not None and stash.open_block is None and not stash.torn_down:
                stash.outside_backward = True

        self._backward_probe = model.register_post_accumulate_grad_hook(saw_backward)

    def _masters_for(self, params, loaded: Optional[List[Optional[torch.Tensor]]] = None) -> List[torch.Tensor]:
        out = []
        opt = self.optimizer
        for i, p in enumerate(params):
            if p.dtype in _LOW_DTYPES:
                saved = loaded[i] if loaded else None
                master = saved.clone() if saved is not None else p.detach().clone().float()
                master.requires_grad_(p.requires_grad)
                if p in opt.state:
                    opt.state[master] = opt.state.pop(p)
                self.pairs.append((master, p))
                self.master_ids.add(id(master))
                self.model_versions.append(p._version)
                out.append(master)
            else:
                out.append(p)
        return out

    def _attach(self) -> None:
        if self.ours and self.pairs:
            self.optimizer.attach_model_params(list(self.pairs))
            self.attached = True
            self.attach_checked = False

    def sync_masters(self) -> None:
        """Before a backward: masters follow model weights changed since amp last wrote or read them (a checkpoint
        loaded after amp.initialize, ``model.load_state_dict`` mid-run, an in-place edit under no_grad), found by
        the params' version counters. Elements where the model still holds its master rounded to the model dtype
        keep the master (its precision: a checkpoint that restored both, in either order, agrees there).

        (Upstream created masters lazily before the first backward, and followed no later change.)
        """
        changed = [i for i, ((_, model), seen) in enumerate(zip(self.pairs, self.model_versions))
                   if model._version != seen]
        if not changed:
            return
        with torch.no_grad():
            for i in changed:
                master, model = self.pairs[i]
                master.copy_(master_where_kept(master, model))
        self.record_model_versions()

    def drop_master_grads(self, model_ids: frozenset) -> None:
        """``model.zero_grad()`` under master weights: the masters of those model params lose the grads they
        accumulated since the last step, as the model params lost theirs, including what a delayed block set
        aside for the next exit. Combined grads: see `CombinedGrads.drop_master_grads`."""
        if not self.pairs:
            return
        if any(id(model) in model_ids for _, model in self.pairs):
            self.outside_backward = False  # the grads a backward outside scale_loss left there are gone too
        if self.combined is not None:
            self.combined.drop_master_grads(model_ids)
            return
        for master, model in self.pairs:
            if id(model) in model_ids:
                master.grad = None

    def drop_stashed_grads(self, param_ids: Optional[frozenset] = None) -> None:
        """Grads zeroed (``zero_grad``) while earlier grads are set aside for the next real exit (inside a
        ``delay_unscale`` chain, or inside a block after its backward): the set-aside grads of those params (all
        with None) are dropped too, so the exit does not add back what the user zeroed."""
        if self._grad_stash is None:
            return
        self._grad_stash = [None if param_ids is None or id(p) in param_ids else g
                            for p, g in zip(self._stash_params, self._grad_stash)]

    def record_model_versions(self) -> None:
        """The model params' version counters after amp's own writes (or reads) of them: later changes are the
        user's (see `sync_masters`)."""
        self.model_versions = [model._version for _, model in self.pairs]

    def check_attached_copy(self) -> None:
        """Once, after the first real step: did the optimizer copy every master into its model param?

        A protocol implementation that misses some pairs would otherwise train the masters while the model
        keeps its old weights, silently. amp then falls back to copying itself.
        """
        self.attach_checked = True
        with torch.no_grad():
            missed = sum(not torch.equal(model, master.to(model.dtype)) for master, model in self.pairs)
        if missed:
            logger.warning(
                "apex.amp: %s.attach_model_params() did not update %d of %d model params after step(); "
                "amp copies the master weights itself from now on", type(self.optimizer).__name__, missed,
                len(self.pairs),
            )
            self.attached = False

    def copy_masters_to_model(self, force: bool = False) -> None:
        """After a step: the masters into their model params, unless the optimizer did it (``attached``);
        ``force`` copies anyway."""
        if not self.pairs or (self.attached and not force):
            return
        with torch.no_grad():
            models = [m for _, m in self.pairs]
            masters = [m for m, _ in self.pairs]
            torch._foreach_copy_(models, masters)

    # ------------------------------------------------------------ upstream's internal names
    # Resume and logging code written for upstream's amp calls ``optimizer._lazy_init_maybe_master_weights()`` (or
    # ``_amp_lazy_init()``), loads the optimizer, then copies its saved masters into ``amp.master_params``; other
    # code maps masters to param names through ``_amp_stash.all_fp16_params`` / ``all_fp32_from_fp16_params``.
    # "fp16" in these names means the session's low-precision dtype (bf16 on CPU unless APEX_AMP_DTYPE says).
    def lazy_init(self) -> None:
        """Upstream built the fp32 masters from the model's weights here (before the first backward). They exist
        from initialize on, so what that build would have read, a model changed since (a checkpoint loaded into
        it), reaches them now, under the rule of the next backward (`sync_masters`)."""
        if self.master_weights and not self.torn_down:
            self.sync_masters()
        self.lazy_init_called = True

    def masters_to_model(self) -> None:
        """Upstream's ``_master_params_to_model_params``: every model param takes its master's value now (a step
        does this itself; code calls it after writing the masters, e.g. to evaluate a resumed model)."""
        if not self.pairs or self.torn_down:
            return
        self.copy_masters_to_model(force=True)
        self.record_model_versions()

    def _split_groups(self) -> List[Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]]:
        """Per param group, in group order: (low-precision model params, their fp32 masters, the other params,
        which are their own masters). Without master weights the low-precision params have no master."""
        model_of = {id(master): model for master, model in self.pairs}
        out = []
        for group in self.optimizer.param_groups:
            low: List[torch.Tensor] = []
            masters: List[torch.Tensor] = []
            other: List[torch.Tensor] = []
            for p in group["params"]:
                model = model_of.get(id(p))
                if model is not None:
                    low.append(model)
                    masters.append(p)
                elif p.dtype in _LOW_DTYPES:
                    low.append(p)
                else:
                    other.append(p)
            out.append((low, masters, other))
        return out

    @property
    def fp16_groups(self) -> List[List[torch.Tensor]]:
        return [low for low, _, _ in self._split_groups()]

    @property
    def fp32_from_fp16_groups(self) -> List[List[torch.Tensor]]:
        return [masters for _, masters, _ in self._split_groups()]

    @property
    def fp32_from_fp32_groups(self) -> List[List[torch.Tensor]]:
        return [other for _, _, other in self._split_groups()]

    @property
    def all_fp16_params(self) -> List[torch.Tensor]:
        return [p for group in self.fp16_groups for p in group]

    @property
    def all_fp32_from_fp16_params(self) -> List[torch.Tensor]:
        return [p for group in self.fp32_from_fp16_groups for p in group]

    @property
    def all_fp32_from_fp32_params(self) -> List[torch.Tensor]:
        return [p for group in self.fp32_from_fp32_groups for p in group]

    all_fp32_params = all_fp32_from_fp32_params  # upstream's name without master weights

    # ------------------------------------------------------------ backward bookkeeping
    def overflowed(self) -> None:
        """An exit found inf/nan in the grads of the step to come, which will be skipped. The next backward (a
        later micro-batch before that step) starts from no grads instead of adding to the overflowed ones, with or
        without combine_grad: accumulated onto, they would be found again by combined grads' whole-buffer check
        (a second back-off for one overflow), and a clip before the skipped step would see them."""
        if self.combined is not None:
            self.combined.discard = True
        else:
            self.drop_at_next_backward = True

    def prepare_backward(self, scale: float) -> None:
        """Before a scaled backward (not called while grads are already scaled from delay_unscale)."""
        if self.master_weights:
            self.sync_masters()
        if self.combined is not None:
            self.combined.prepare(scale)  # before the first exit: nothing (the fresh grads are combined there)
            return
        params = self.plain_params()
        self._stash_params = params
        if self.drop_at_next_backward:
            self.drop_at_next_backward = False
            self._grad_stash = [None] * len(params)
            for master, _ in self.pairs:
                master.grad = None
        else:
            self._grad_stash = [p.grad for p in params]
        for p in params:
            p.grad = None
        for _, model in self.pairs:
            model.grad = None

    def restore_after_error(self) -> None:
        """The scale_loss block raised (in its backward or after it): every grad is put back as it was before the
        block, so the failed iteration's grads (scaled, maybe partial) are dropped, not left for the next step.

        Combined grads: the backward added into the flat buffer in place, and taking its part out again would need
        a copy of the buffer before every backward. The buffer is dropped at the next backward instead, and a
        step() before another scale_loss exit is skipped: no scaled or partial grad reaches an update."""
        if self.combined is not None:
            self.combined.after_skip()
            self.skip_after_error = True
            self._end_chain()  # the chain's grads go with the buffer
            return
        if self._stash_params is None:
            return
        for p, g in zip(self._stash_params, self._grad_stash):
            p.grad = g
        for _, model in self.pairs:
            model.grad = None  # prepare_backward cleared them: they hold only the failed backward's grads
        self._stash_params = self._grad_stash = None
        # Inside a delay_unscale chain the failed backward added onto the chain's scaled grads, which cannot be
        # told apart: they are dropped with it (the grads set aside at the chain's start are back), so nothing
        # held now is scaled and the chain is over.
        self._end_chain()

    def rescale_chain(self, scale: float) -> None:
        """Without combine_grad, before a backward that continues a delay_unscale chain: the chain's grads (the
        only ones in ``p.grad`` since its start set the earlier ones aside) are brought from the chain's scale to
        ``scale``, so a chain that goes on under another loss's scaler is unscaled by what each grad carries.
        (Combined grads do the same on their buffers, `CombinedGrads.prepare`.)"""
        chain = self.delayed_chain
        if chain is None or chain[2] == scale:
            return
        params = self._stash_params if self._stash_params is not None else self.plain_params()
        grads = [g for g in (p.grad for p in params) if g is not None]
        grads += [g for g in (model.grad for _, model in self.pairs) if g is not None]
        with torch.no_grad():
            unscale_(grads, scale / chain[2], check=False)
        self.delayed_chain = (chain[0], chain[1], scale)

    def end_chain_if_zeroed(self, param_ids: frozenset) -> None:
        """``model.zero_grad()`` inside a delay_unscale chain: when the model holds every param this optimizer
        updates (the model params under master weights), no scaled grad is left and the chain is over."""
        if self.delayed_chain is None:
            return
        models = [model for _, model in self.pairs]
        if param_ids.issuperset(map(id, [*models, *self.plain_params()])):
            self._end_chain()

    def _end_chain(self) -> None:
        chain = self.delayed_chain
        self.params_have_scaled_gradients = False
        self.delayed_chain = None
        if chain is not None and self.session.overflow_flag:
            self.session.release_flag_overflows((chain[0],))  # the chain's overflow flag went with its grads

    def post_backward(self, scale: float, check: bool, fold: bool) -> bool:
        """At scale_loss exit: unscale this backward's grads; True if any was inf/nan."""
        self.outside_backward = False  # the exit brings every model grad to the masters, that backward's too
        if self.combined is not None:
            return self.combined.unscale(scale, check, fold and self.fold and self._folds_now())
        inv = 1.0 / scale
        found = False
        with torch.no_grad():
            if self._stash_params is None:  # prepare was skipped (grads were already scaled): unscale all
                self._stash_params = self.plain_params()
                self._grad_stash = [None] * len(self._stash_params)
            new, acc, stashed = [], [], []
            for p, old in zip(self._stash_params, self._grad_stash):
                g = p.grad
                if g is None:
                    if old is not None:
                        p.grad = old
                elif old is None:
                    new.append(g)
                else:
                    acc.append(g)
                    stashed.append(old)
            found |= unscale_(new + acc, inv, check)
            if acc:
                torch._foreach_add_(acc, stashed)
            self._stash_params = self._grad_stash = None
            if self.pairs:
                found |= self._post_backward_masters(inv, check)
        return found

    def _post_backward_masters(self, inv: float, check: bool) -> bool:
        fresh_masters, fresh, acc_dst, acc = [], [], [], []
        for master, model in self.pairs:
            g = model.grad
            if g is None:
                continue
            if master.grad is None:
                fresh_masters.append(master)
                fresh.append(g.float() if g.dtype != torch.float32 else g.clone())
            else:
                acc_dst.append(master.grad)
                acc.append(g.float())
        found = unscale_(fresh + acc, inv, check)
        for master, g in zip(fresh_masters, fresh):
            master.grad = g
        if acc:
            torch._foreach_add_(acc_dst, acc)
        return found

    def _folds_now(self) -> bool:
        """Whether this step's update takes the scale at no extra cost (an apex optimizer says, through
        ``folds_grad_scale()``; torch's fused ones always do); where not, the exit unscales as without folding."""
        query = getattr(self.optimizer, "folds_grad_scale", None) if self.ours else None
        return query is None or bool(query())

    def after_delayed_exit(self, loss_id: int, scaler: Any, scale: float) -> None:
        self.params_have_scaled_gradients = True
        self.delayed_chain = (loss_id, scaler, scale)
        if self.combined is not None:
            self.combined.delayed_exit()
        # Stashed grads (upstream: only when prepare ran) go back under the new scaled ones at the real exit.

    # ------------------------------------------------------------ step, zero_grad
    def step(self, orig_step, closure=None):
        if closure is not None:
            raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
        if self.open_block is not None:
            from .handle import close_open_block  # (handle imports the stash's module)

            close_open_block(self)
        if self.delayed_chain is not None:
            from .handle import close_delayed_chain

            close_delayed_chain(self)
        if self.outside_backward:
            self.outside_backward = False
            warnings.warn(
                "apex.amp: a backward outside `amp.scale_loss` reached the model's params since the last "
                f"scale_loss exit; under master weights (O2) only an exit brings model grads to the fp32 params "
                f"{type(self.optimizer).__name__} updates, so that backward's grads do not reach this step. Run it "
                "as `with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`.",
                RuntimeWarning, stacklevel=3)
        if self.skip_pending is not None:
            return self._skip()
        if self.skip_after_error:
            self.skip_after_error = False
            maybe_log("Skipping step: the last scale_loss block raised, and the grads it left were dropped")
            self.combined.after_skip()
            self._drop_skipped_grads()
            return None
        opt = self.optimizer
        scale = self.combined.folded_scale() if self.combined is not None else None
        fused_torch = scale is not None and not self.ours
        if scale is not None:
            if self.ours:
                opt.apex_grad_scale = 1.0 / scale
            else:
                self._set_torch_scale(scale)
        try:
            result = orig_step()
        finally:
            if scale is not None:
                if self.ours:
                    opt.apex_grad_scale = None
                else:
                    self._clear_torch_scale()
        if self.attached and not self.attach_checked:
            self.check_attached_copy()
        self.copy_masters_to_model()
        if self.pairs:
            self.record_model_versions()  # the step wrote the model params (here, or through attach_model_params)
        if self.combined is not None:
            self.combined.after_step(unscaled_in_place=fused_torch)
        else:
            for master, _ in self.pairs:
                master.grad = None  # not zeroed by model.zero_grad(): upstream clears them here
        return result

    def _set_torch_scale(self, scale: float) -> None:
        """torch's fused-optimizer contract: the scale the grads carry, and no overflow (an overflow step never
        reaches the optimizer, see `_skip`)."""
        opt = self.optimizer
        device = next((p.device for g in opt.param_groups for p in g["params"]), torch.device("cpu"))
        opt.grad_scale = torch.full((), scale, dtype=torch.float32, device=device)
        opt.found_inf = torch.zeros((), dtype=torch.float32, device=device)

    def _clear_torch_scale(self) -> None:
        for name in ("grad_scale", "found_inf"):
            if name in self.optimizer.__dict__:
                delattr(self.optimizer, name)

    def _skip(self):
        loss_id, scaler = self.skip_pending
        self.skip_pending = None
        maybe_log("Gradient overflow. Skipping step, loss scaler %d reducing loss scale to %s",
                  loss_id, scaler.loss_scale())
        combined = self.combined
        # The overflow is known here, so a torch fused optimizer is not called with found_inf = 1 (as torch's
        # GradScaler does) but skipped like any other: its first call creates state even when it skips, and
        # torch 2.13's fused SGD leaves that momentum buffer uninitialised, which the next step then reads.
        if combined is not None:
            combined.after_skip()
        self._drop_skipped_grads()
        return None

    def _drop_skipped_grads(self) -> None:
        """A skipped step drops the grads it would have applied, as ``zero_grad()`` would: they hold the inf/nan
        the step was skipped for (unless the user zeroed since), and kept they would be added to by the next
        backward and applied by a later ``step()``, with or without combine_grad alike."""
        self.optimizer.zero_grad(set_to_none=True)
        self.drop_at_next_backward = False

    def zero_grad(self, orig_zero_grad, set_to_none: bool = True) -> None:
        combined = self.combined
        self.outside_backward = False
        self.drop_stashed_grads()
        self._end_chain()  # no scaled grad is left to unscale
        if not self.master_weights:
            orig_zero_grad(set_to_none=set_to_none)
            if combined is not None and not set_to_none:
                combined.mark_zeroed()
            return
        if combined is not None and combined.built:
            combined.zero_o2(set_to_none)
            return
        # Upstream O2: model grads and fp32 params' grads zeroed, master grads dropped.
        for _, model in self.pairs:
            _zero(model, set_to_none)
        for p in self.plain_params():
            _zero(p, set_to_none)
        for master, _ in self.pairs:
            master.grad = None

    def add_param_group(self, orig_add, param_group: dict) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        if self.master_weights:
            group = dict(param_group)
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            for i, p in enumerate(params):
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"optimizer can only optimize Tensors, but param {i} is {type(p).__name__}")
                if p.dtype not in _LOW_DTYPES and p.dtype != torch.float32:
                    raise TypeError(f"Optimizer's parameters must be float32, float16 or bfloat16 for master "
                                    f"weights; param {i} of the new group is {p.dtype}")
            n_pairs = len(self.pairs)
            group["params"] = self._masters_for(params)
            try:
                orig_add(group)
            except Exception:
                for master, _ in self.pairs[n_pairs:]:
                    self.master_ids.discard(id(master))
                del self.pairs[n_pairs:], self.model_versions[n_pairs:]
                raise
            self._attach()
        else:
            orig_add(param_group)
        if self.combined is not None:
            self.combined.invalidate()

    # ------------------------------------------------------------ checkpoints
    def state_dict(self, orig_state_dict) -> dict:
        sd = orig_state_dict()
        if self.master_weights:
            masters = {id(m) for m, _ in self.pairs}
            sd[MASTER_KEY] = [
                p.detach().clone() if id(p) in masters else None
                for g in self.optimizer.param_groups for p in g["params"]
            ]
        states = scaler_states(_amp_state.loss_scalers)
        for idx, (scale, unskipped) in self.pending_scalers.items():  # restored, not reached yet: still this run's
            states[f"loss_scaler{idx}"] = {"loss_scale": scale, "unskipped": unskipped}
        sd[SCALER_KEY] = states
        return sd

    def hold_scalers(self, entries: List[Tuple[int, str, float, int]]) -> None:
        """A checkpoint's loss scalers (`check_scaler_states` entries), kept until this optimizer is first scaled
        with each loss (`take_pending_scaler`)."""
        self.pending_scalers = {idx: (scale, unskipped) for idx, _, scale, unskipped in entries}

    def take_pending_scaler(self, loss_id: int) -> Optional[Tuple[float, int]]:
        return self.pending_scalers.pop(loss_id, None)

    def load_state_dict(self, orig_load, state_dict: dict) -> None:
        """The optimizer's own load, then amp's loss scalers from the checkpoint's `SCALER_KEY` (a checkpoint
        without it leaves them alone); every part is checked before anything is set."""
        scalers = None
        if isinstance(state_dict, dict) and SCALER_KEY in state_dict:
            scalers = check_scaler_states(state_dict[SCALER_KEY],
                                          f"{type(self.optimizer).__name__}.load_state_dict: '{SCALER_KEY}'")
            state_dict = {k: v for k, v in state_dict.items() if k != SCALER_KEY}
        if self.master_weights:
            self._load_with_masters(orig_load, state_dict)
        else:
            orig_load(state_dict)
            if self.combined is not None:
                self.combined.invalidate()
        # applied when this optimizer is first scaled with each loss, not here: the scalers are process-wide, and
        # another run in this process may be using a loss this checkpoint also saved. A checkpoint without them
        # drops what an earlier load held.
        self.hold_scalers(scalers or [])

    def _load_with_masters(self, orig_load, state_dict: dict) -> None:
        saved = state_dict.get(MASTER_KEY) if isinstance(state_dict, dict) else None
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if saved is not None:
            if not isinstance(saved, (list, tuple)) or len(saved) != len(params):
                raise ValueError(
                    f"loaded state_dict has {len(saved) if isinstance(saved, (list, tuple)) else saved!r} "
                    f"'{MASTER_KEY}' entries, the optimizer has {len(params)} params"
                )
            for i, (p, m) in enumerate(zip(params, saved)):
                if m is not None and (not isinstance(m, torch.Tensor) or m.shape != p.shape):
                    raise ValueError(f"'{MASTER_KEY}' entry {i} does not match param {i} of shape {tuple(p.shape)}")
            state_dict = {k: v for k, v in state_dict.items() if k != MASTER_KEY}
        orig_load(state_dict)
        model_of = {id(m): model for m, model in self.pairs}
        with torch.no_grad():
            for i, p in enumerate(params):
                model = model_of.get(id(p))
                if model is None:
                    continue
                if saved is not None and saved[i] is not None:
                    p.copy_(saved[i])
                else:  # a checkpoint without masters: take them from the (loaded) model
                    p.copy_(model)
        self.record_model_versions()
        if self.combined is not None:
            self.combined.invalidate()

    # ------------------------------------------------------------ teardown
    def teardown(self) -> None:
        for patch in reversed(self.patches):
            patch.restore()
        self.patches.clear()
        if self.attached:
            self.optimizer.attach_model_params(None)
            self.attached = False
        if self.combined is not None:
            self.combined.remove_hooks()  # the model params outlive amp
        if self._backward_probe is not None:
            self._backward_probe.remove()
            self._backward_probe = None
        self.torn_down = True


def process_optimizer(optimizer: torch.optim.Optimizer, session: Any) -> AmpStash:
    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
    stash = AmpStash(optimizer, session)
    props = session.properties
    if stash.master_weights:
        stash.make_masters()
    if props.combine_grad:
        stash.combined = CombinedGrads(stash)
        if props.fold_unscale:
            stash.fold = not stash.master_weights and (stash.ours or stash.torch_fused)
            if not stash.fold:
                logger.info(
                    "apex.amp: fold_unscale does not apply to %s (needs an apex optimizer or a fused torch one, "
                    "without master weights); its grads are unscaled at scale_loss exit", type(optimizer).__name__
                )

    def patch(name: str, make):
        # Bound methods, as upstream installs them: LR schedulers wrap ``optimizer.step.__func__``.
        orig = getattr(optimizer, name, None)  # None: one of upstream's internal names, new here
        stash.patches.append(InstancePatch(optimizer, name, types.MethodType(make(orig), optimizer)))

    def make_step(orig):
        def step(self, closure=None):
            if stash.torn_down:
                return orig() if closure is None else orig(closure)
            return stash.step(orig, closure)
        if hasattr(orig, "_wrapped_by_lr_sched"):
            # an LR scheduler built before initialize wrapped step to record that it ran; this step runs that
            # wrapper whenever it steps, so the record stays true, and the scheduler need not warn that step was
            # "overridden after learning rate scheduler initialization" (transformers' Trainer builds the
            # scheduler first)
            step._wrapped_by_lr_sched = True
        return step

    def make_zero_grad(orig):
        def zero_grad(self, set_to_none=True):
            if stash.torn_down:
                return orig(set_to_none=set_to_none)
            return stash.zero_grad(orig, set_to_none)
        return zero_grad

    def make_add_param_group(orig):
        def add_param_group(self, param_group):
            if stash.torn_down:
                return orig(param_group)
            return stash.add_param_group(orig, param_group)
        return add_param_group

    def make_state_dict(orig):
        def state_dict(self):
            return orig() if stash.torn_down else stash.state_dict(orig)
        return state_dict

    def make_load_state_dict(orig):
        def load_state_dict(self, state_dict):
            if stash.torn_down:
                return orig(state_dict)
            return stash.load_state_dict(orig, state_dict)
        return load_state_dict

    patch("step", make_step)
    patch("zero_grad", make_zero_grad)
    patch("add_param_group", make_add_param_group)
    patch("state_dict", make_state_dict)
    patch("load_state_dict", make_load_state_dict)
    # upstream's per-optimizer internals that user code calls (see `AmpStash.lazy_init`)
    patch("_lazy_init_maybe_master_weights", lambda orig: lambda self: stash.lazy_init())
    patch("_amp_lazy_init", lambda orig: lambda self: None if stash.lazy_init_called else stash.lazy_init())
    if stash.master_weights:
        patch("_master_params_to_model_params", lambda orig: lambda self: stash.masters_to_model())
    optimizer._amp_stash = stash
    return stash
