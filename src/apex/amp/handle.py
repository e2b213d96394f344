"""``scale_loss`` (the loss-scaling context manager) and the handles of ``amp.init`` / ``amp.initialize``."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from typing import Any, List

import torch

from .. import _device
from .._checks import check_int, real_number
from . import _ddp
from ._amp_state import _amp_state, logger, maybe_log
from ._casts import disable_casts
from ._unscale import unscale_
from .scaler import LossScaler


def _optimizer_list(optimizers: Any) -> List[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    elif isinstance(optimizers, (list, tuple)):
        optimizers = list(optimizers)
    else:
        raise TypeError(
            f"scale_loss: optimizers must be an optimizer or a list of optimizers, got {type(optimizers).__name__}"
        )
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"scale_loss: optimizers[{i}] is {type(opt).__name__}, not a torch.optim.Optimizer")
        stash = getattr(opt, "_amp_stash", None)
        if stash is None:
            raise RuntimeError(
                f"scale_loss: optimizer {i} ({type(opt).__name__}) was not returned by the active amp.initialize"
            )
        if stash.torn_down:
            raise RuntimeError(
                f"scale_loss: optimizer {i} ({type(opt).__name__}) was not returned by the active amp.initialize: "
                "it left amp at amp.deinitialize(), or when a model it updates was passed to a later "
                "amp.initialize; an optimizer goes through amp.initialize once, so pass a new one with the model"
            )
        for j in range(i):
            if optimizers[j] is opt:
                raise ValueError(f"scale_loss: optimizers[{i}] is the same optimizer as optimizers[{j}]; list each "
                                 "optimizer once")
        # An exit unscales every grad the optimizer holds that carries the block's scale: an inner block's exit
        # would take the outer block's backward (before or after it) for its own, and the outer exit would
        # divide the inner's grads a second time. So blocks of one optimizer follow each other, never nest.
        block = stash.open_block
        if block is not None:
            raise RuntimeError(
                f"scale_loss: optimizer {i} ({type(opt).__name__}) already has a scale_loss block open (loss_id "
                f"{block.loss_id}); a block for the same optimizer cannot be nested inside it, as its exit cannot "
                "tell its grads from the outer block's. Exit the outer block first (blocks of different "
                "optimizers may nest)"
            )
    return optimizers


def _restore_held_scaler(stashes: list, loss_id: int, scaler: Any) -> None:
    """The first ``scale_loss`` of an optimizer loaded from a checkpoint, per loss: that loss's scaler takes the
    scale the checkpoint reached. Optimizer checkpoints carry every loss's scaler, but only the losses this
    optimizer is then scaled with are restored, so a second run in the same process (NVIDIA's checkpoint tests
    train a restored copy beside the original, on other loss ids) does not move the scale another one uses."""
    for stash in stashes:
        held = stash.take_pending_scaler(loss_id)
        if held is not None:
            scaler.load(*held)
            for other in stashes:
                other.take_pending_scaler(loss_id)
            return


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id: int = 0, model=None, delay_unscale: bool = False,
               delay_overflow_check: bool = False):
    """Yield ``loss.float() * loss_scale``; on exit unscale the grads, check for overflow, update the scale.

    On exit (unless ``delay_unscale``) the gradients of the params of
    ``optimizers`` that this backward produced are divided by the loss scale and
    added to the grads they already had (gradient accumulation), and checked for
    inf/nan. A dynamic scaler then backs off on overflow, and each optimizer in
    ``optimizers`` skips its next ``step()`` once; a static scale never skips.
    ``delay_unscale=True`` leaves the grads scaled, to be unscaled by the next
    exit without it (accumulation without the per-backward cost); a ``step()``
    reached first unscales and checks them itself, with a RuntimeWarning. So does
    a ``step()`` of one of ``optimizers`` inside the block: it does the exit's
    work first, and the exit then has none left. A backward that went through
    ``loss`` but not through the yielded scaled loss (``loss.backward()``) is
    divided by the scale all the same, with a RuntimeWarning at the exit.
    ``model`` is accepted for upstream compatibility.
    """
    props = _amp_state.opt_properties
    if props is None:
        raise RuntimeError(
            "Invoked 'with amp.scale_loss', but internal Amp state has not been initialized. "
            "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called before "
            "'with amp.scale_loss'."
        )
    if not props.enabled:
        yield loss
        return
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"scale_loss: loss must be a tensor, got {type(loss).__name__}")
    if loss.is_complex():  # loss.float() would drop the imaginary part (torch only warns)
        raise TypeError(f"scale_loss: loss must be a real tensor, got a {loss.dtype} one; backward needs a real "
                        "loss (take .real, .abs() or the loss you meant)")
    optimizers = _optimizer_list(optimizers)
    for name, flag in (("delay_unscale", delay_unscale), ("delay_overflow_check", delay_overflow_check)):
        if not isinstance(flag, (bool, int)):  # (upstream's scripts pass 0/1 too)
            raise TypeError(f"scale_loss: {name} must be a bool, got {type(flag).__name__}")
    scalers = _amp_state.loss_scalers
    loss_id = check_int(loss_id, "scale_loss: loss_id")
    if not 0 <= loss_id < len(scalers):
        raise ValueError(
            f"scale_loss: loss_id must be in [0, {len(scalers)}) (amp.initialize(num_losses={len(scalers)})), "
            f"got {loss_id}"
        )
    session = _amp_state.session
    scaler = scalers[loss_id]
    stashes = [opt._amp_stash for opt in optimizers]
    _restore_held_scaler(stashes, loss_id, scaler)
    scale = scaler.loss_scale()
    ddp = session.ddp if session is not None else None  # combine_ddp (apex.amp._ddp)

    if (not props.master_weights and not any(s.master_weights for s in stashes) and not scaler.dynamic
            and scale == 1.0 and ddp is None):
        # Nothing to unscale and never a skipped step: the grads accumulate as in plain torch. (An optimizer of
        # an earlier O2 session still needs its exit under a later O0/O3 one: only an exit brings the model's
        # grads to its masters.)
        yield loss.float()
        return

    for stash in stashes:
        if stash.combined is not None:
            stash.prepare_backward(scale)  # pending-scale bookkeeping handles delayed and accumulated grads
        elif not stash.params_have_scaled_gradients:
            # the first backward since the grads were last unscaled, delayed or not: unscaled grads (an earlier
            # block's) are set aside, to be added back unscaled at the next real exit, never divided again
            stash.prepare_backward(scale)
        else:
            # a delay_unscale chain goes on, maybe under another loss's scale: its grads are brought to this
            # backward's scale, so the exit that closes the chain divides every one by the scale it carries
            stash.rescale_chain(scale)
    if ddp is not None:
        _ddp.call(ddp, "before_backward", [stash.combined for stash in stashes], delay_unscale)
    use_flag = session is not None and session.overflow_flag
    if use_flag:
        # The register is global: cleared before every backward, read after it. A delay_unscale backward's
        # overflow is read at its own exit and kept per loss (below), so clearing here never loses it.
        _device.npu_clear_overflow_flag()
    watch = block = None
    try:
        scaled = loss.float() * scale
        watch = _BackwardWatch(loss, scaled)
        block = _OpenBlock(loss_id, scaler, scale, stashes, delay_overflow_check, use_flag)
        yield scaled
    except BaseException:
        if watch is not None:
            watch.remove()
        if block is None or not block.leave():  # (closed early by a step inside the block: that step used the grads)
            for stash in stashes:
                stash.restore_after_error()
        raise
    watch.check(loss_id, scale)
    if block.leave():
        return

    if delay_unscale:
        for stash in stashes:
            stash.after_delayed_exit(loss_id, scaler, scale)
        if use_flag and _device.npu_get_overflow_flag():
            session.pending_flag_overflow.add(loss_id)  # reported at this loss's next real exit
        return
    _unscale_at_exit(session, loss_id, scaler, scale, stashes, delay_overflow_check,
                     flag=_device.npu_get_overflow_flag() if use_flag else None)


def _unscale_at_exit(session, loss_id: int, scaler: LossScaler, scale: float, stashes, delay_overflow_check: bool,
                     flag) -> None:
    """A real exit: unscale the grads the stashes hold (at ``scale``), check them, update the scale and mark the
    steps to skip. ``flag``: the NPU float-status register read after the backward (None: values are checked)."""
    use_flag = flag is not None
    ddp = session.ddp if session is not None else None
    # flag mode: the losses whose delayed backwards this exit unscales (another loss's exit may close a chain)
    closing = {loss_id, *(s.delayed_chain[0] for s in stashes if s.delayed_chain is not None)} if use_flag else None
    scaler.clear_overflow_state()
    for stash in stashes:
        scaler.record_overflow(stash.post_backward(scale, check=not use_flag, fold=True))
        stash.params_have_scaled_gradients = False
        stash.delayed_chain = None
        stash.skip_after_error = False  # a block after a failed one: its grads (the failed ones dropped) step
    if use_flag:
        scaler.record_overflow(bool(flag) or not session.pending_flag_overflow.isdisjoint(closing))
        session.release_flag_overflows(closing)
    if ddp is not None:  # every rank skips together
        scaler.record_overflow(bool(_ddp.call(ddp, "agree_overflow", scaler.has_overflow())))
    # an overflow found at a delay_overflow_check exit is acted on at the next exit that checks, of this loss or of
    # another loss on the same optimizers: the grads that held it were unscaled and set aside, and the later exits'
    # checks only see their own backward's grads
    if delay_overflow_check:
        if scaler.has_overflow():
            scaler.carried_overflow = True
            for stash in stashes:
                stash.carried_overflow = True
        should_skip = False
    else:
        scaler.record_overflow(scaler.carried_overflow or any(stash.carried_overflow for stash in stashes))
        scaler.carried_overflow = False
        for stash in stashes:
            stash.carried_overflow = False
        should_skip = scaler.update_scale()
    if should_skip:
        for stash in stashes:
            if stash.skip_pending is None:
                stash.skip_pending = (loss_id, scaler)
            stash.overflowed()


class _BackwardWatch:
    """Tells whether a backward inside a ``scale_loss`` block went through the loss but not through the scaled loss
    the block yielded (``loss.backward()`` written for ``scaled_loss.backward()``): its grads carry no scale, and the
    exit divides them by the loss scale all the same, so training goes on with grads too small by that factor. One
    tensor hook on each (a few microseconds per block); none while torch.compile traces."""

    def __init__(self, loss: torch.Tensor, scaled: torch.Tensor) -> None:
        self.reached = set()
        self.handles = []
        if scaled.requires_grad and not torch.compiler.is_compiling():
            try:
                for name, t in (("loss", loss), ("scaled", scaled)):
                    self.handles.append(t.register_hook(functools.partial(self._mark, name)))
            except RuntimeError:  # a tensor that takes no hooks (e.g. under a torch.func transform): no watch
                self.remove()

    def _mark(self, name: str, grad: torch.Tensor) -> None:
        self.reached.add(name)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def check(self, loss_id: int, scale: float) -> None:
        self.remove()
        if "loss" in self.reached and "scaled" not in self.reached:
            warnings.warn(
                f"apex.amp: a backward inside `with amp.scale_loss(loss, ...) as scaled_loss` (loss_id {loss_id}) "
                f"went through the loss but not through scaled_loss; its grads carry no loss scale, and the exit "
                f"divides them by the scale ({scale:g}) all the same. Call scaled_loss.backward().", RuntimeWarning,
                stacklevel=4)


class _OpenBlock:
    """A ``scale_loss`` block between its entry and its exit, as its optimizers' stashes see it (``open_block``):
    what a ``step()`` inside the block needs to do the exit's work (`close_open_block`). A stash has at most one
    open block (`_optimizer_list` refuses a nested one); ``leave`` puts back what was there before all the same."""

    def __init__(self, loss_id: int, scaler: LossScaler, scale: float, stashes, delay_overflow_check: bool,
                 use_flag: bool) -> None:
        self.loss_id, self.scaler, self.scale, self.stashes = loss_id, scaler, scale, stashes
        self.delay_overflow_check, self.use_flag = delay_overflow_check, use_flag
        self.closed = False
        self.outer = [stash.open_block for stash in stashes]
        for stash in stashes:
            stash.open_block = self

    def leave(self) -> bool:
        """The stashes see the enclosing block again (if any); True when a step inside this block closed it."""
        for stash, outer in zip(self.stashes, self.outer):
            if stash.open_block is self:
                stash.open_block = outer
        return self.closed


def close_open_block(stash) -> None:
    """``step()`` inside a ``scale_loss`` block of its optimizer (the step indented into the block): the grads
    still carry the loss scale and have not been checked. The block's exit work is done now, for every optimizer of
    the block (unscale, check, scale update, skip on overflow), and the exit then does nothing. Upstream stepped on
    the scaled grads."""
    block = stash.open_block
    block.leave()
    block.closed = True
    warnings.warn(
        f"apex.amp: optimizer.step() was called inside its `with amp.scale_loss(...)` block (loss_id "
        f"{block.loss_id}), whose grads still carried the loss scale {block.scale:g}; amp unscaled and checked them "
        f"before this step, as the block's exit does. Call step() after the with block.", RuntimeWarning,
        stacklevel=4)
    session = stash.session
    _unscale_at_exit(session, block.loss_id, block.scaler, block.scale, block.stashes, block.delay_overflow_check,
                     flag=_device.npu_get_overflow_flag() if block.use_flag else None)


def close_delayed_chain(stash) -> None:
    """``step()`` while a delay_unscale chain is open (no exit without delay_unscale since its last backward):
    the grads still carry the loss scale. They are unscaled and checked now, as the missing closing exit would
    have (with every optimizer in the same chain, so the scaler is updated once), and the step then goes on or
    is skipped on overflow. Upstream stepped on the scaled grads."""
    chain = stash.delayed_chain
    loss_id, scaler, scale = chain
    session = stash.session
    stashes = [opt._amp_stash for opt in session.optimizers if opt._amp_stash.delayed_chain == chain]
    warnings.warn(
        f"apex.amp: optimizer.step() was called while the grads of a scale_loss(..., delay_unscale=True) block "
        f"(loss_id {loss_id}) still carried the loss scale {scale:g}; amp unscaled and checked them before this "
        f"step, as a closing scale_loss exit does. End gradient accumulation with a scale_loss block without "
        f"delay_unscale before step().", RuntimeWarning, stacklevel=4)
    _unscale_at_exit(session, loss_id, scaler, scale, stashes, False, flag=False if session.overflow_flag else None)


# ------------------------------------------------------------------------------------------------------------------
# Handles: what amp.init() returns, and what amp.initialize() records as _amp_state.handle.


def _params_of(optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class _GradStash:
    """Unscales only the grads one backward adds: earlier grads are set aside during it and added back after.

    Moving the earlier grad tensors (no copy) keeps gradient accumulation over
    several ``scale_loss`` blocks exact whatever the loss scale.
    """

    def __init__(self, params: List[torch.Tensor]) -> None:
        self.params = params
        self.saved: List[Any] = []

    def before_backward(self) -> None:
        self.saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def restore_after_error(self) -> None:
        for p, old in zip(self.params, self.saved):
            p.grad = old
        self.saved = []

    def after_backward(self, scale: float) -> bool:
        """Unscale the new grads, add the set-aside ones back; True when a new grad held inf/nan."""
        new = [p.grad for p in self.params if p.grad is not None]
        overflow = unscale_(new, 1.0 / scale, check=True)
        for p, old in zip(self.params, self.saved):
            if old is None:
                continue
            if p.grad is None:
                p.grad = old
            else:
                old.add_(p.grad.to(old.dtype))
                p.grad = old
        self.saved = []
        return overflow


@contextlib.contextmanager
def _scaled_backward(loss: torch.Tensor, scaler: LossScaler, optimizer):
    """Yields ``loss.float() * scale`` for one backward; afterwards that backward's grads are unscaled (earlier grads
    kept apart by `_GradStash`) and the scaler records whether they overflowed. The caller updates the scale."""
    scale = scaler.loss_scale()
    stash = _GradStash(_params_of(optimizer))
    stash.before_backward()
    try:
        yield loss.float() * scale
    except BaseException:
        stash.restore_after_error()
        raise
    scaler.clear_overflow_state()
    scaler.record_overflow(stash.after_backward(scale))


def _skip_next_step(optimizer, what: str) -> None:
    """Make the optimizer's next ``step()`` a no-op (once), then put its own step back."""
    had_own = "step" in optimizer.__dict__
    previous = optimizer.__dict__.get("step")

    def skip_step(*args, **kwargs):
        if had_own:
            optimizer.step = previous
        else:
            del optimizer.step
        maybe_log("apex.amp: gradient overflow in %s, skipping this optimizer step", what)
        return None

    optimizer.step = skip_step


def _check_loss_scale(loss_scale: Any) -> Any:
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        return loss_scale
    number = real_number(loss_scale)
    if number is None or not math.isfinite(number) or number <= 0:
        raise ValueError(f"amp.init: loss_scale must be 'dynamic' or a finite positive number, got {loss_scale!r}")
    return float(number)


class OptimWrapper:
    """An optimizer with one loss scaler per loss (``AmpHandle.wrap_optimizer``).

    Use ``with wrapper.scale_loss(loss) as scaled: scaled.backward()`` once per
    loss (at most ``num_loss`` times between steps), then ``wrapper.step()``: the
    step is skipped when any of those backwards overflowed, and each loss's
    scaler backs off or grows on its own. Every other attribute is the
    optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, amp_handle: Any, num_loss: int) -> None:
        num_loss = check_int(num_loss, "wrap_optimizer: num_loss", 1)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"wrap_optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self._optimizer = optimizer
        self._amp_handle = amp_handle
        self._num_loss = num_loss
        self._loss_idx = 0
        self._skip_next = [False] * num_loss
        spec = getattr(amp_handle, "loss_scale_spec", 1.0)
        self._loss_scaler = [LossScaler(spec) for _ in range(num_loss)]

    @contextlib.contextmanager
    def scale_loss(self, loss):
        if not self._amp_handle.is_active():
            yield loss
            return
        if self._loss_idx >= self._num_loss:
            raise RuntimeError(
                f"OptimWrapper.scale_loss called {self._loss_idx + 1} times since the last step(), but the "
                f"optimizer was wrapped with num_loss={self._num_loss}"
            )
        scaler = self._loss_scaler[self._loss_idx]
        with _scaled_backward(loss, scaler, self._optimizer) as scaled:
            yield scaled
        self._skip_next[self._loss_idx] = scaler.update_scale()
        self._loss_idx += 1
        self._amp_handle._clear_cache()

    def step(self, closure=None):
        if not self._amp_handle.is_active():
            return self._optimizer.step(closure)
        if closure is not None:
            raise NotImplementedError("The closure argument is not supported by the amp optimizer wrapper.")
        skip = any(self._skip_next)
        self._skip_next = [False] * self._num_loss
        self._loss_idx = 0
        if skip:
            maybe_log("apex.amp: gradient overflow, skipping this optimizer step")
            return None
        return self._optimizer.step()

    def __getattr__(self, name: str):
        optimizer = self.__dict__.get("_optimizer")
        if optimizer is None:
            raise AttributeError(name)
        return getattr(optimizer, name)

    def __repr__(self) -> str:
        return f"OptimWrapper({self._optimizer!r}, num_loss={self._num_loss})"


class AmpHandle:
    """An active ``amp.init()``: torch's listed functions cast process-wide until ``_deactivate()``."""

    user_cast_preferred = False

    def __init__(self, loss_scale: Any = "dynamic", enable_caching: bool = True, verbose: bool = False,
                 patch_type: torch.dtype = torch.float16, allow_banned: bool = False) -> None:
        from ._casts import FunctionPatches
        from ._global_casts import CastCache, GlobalCasts

        self.loss_scale_spec = _check_loss_scale(loss_scale)
        self._enable_caching = bool(enable_caching)
        self._verbose = bool(verbose)
        self.low_dtype = patch_type
        self.device_type = _device.autocast_device_type(None)
        self._cache = CastCache()
        self._default_scaler = LossScaler(self.loss_scale_spec)
        self._casts = GlobalCasts(patch_type, bool(allow_banned), self._cache if enable_caching else None,
                                  verbose=bool(verbose))
        self.function_patches = FunctionPatches()
        self._is_active = False

    def _activate(self) -> None:
        """Patch torch's listed functions and the registered ones; a failure puts back whatever this call
        patched, so a handle is either fully active or not at all."""
        if self._is_active:
            return
        self._casts.enabled = True
        try:
            self._casts.install()
            self._is_active = True
            self.function_patches.install_registry()
        except BaseException:
            self._is_active = False
            self._casts.enabled = False
            self.function_patches.restore()
            self._casts.restore()
            raise

    def is_active(self) -> bool:
        return self._is_active

    @contextlib.contextmanager
    def _disable_casts(self):
        with disable_casts():
            yield

    def wrap_optimizer(self, optimizer, num_loss: int = 1) -> OptimWrapper:
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizer):
        """Yield ``loss.float() * scale``; on exit unscale the new grads, and skip the next step on overflow."""
        if not self.is_active():
            yield loss
            return
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"scale_loss: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        scaler = self._default_scaler
        with _scaled_backward(loss, scaler, optimizer) as scaled:
            yield scaled
        if scaler.update_scale():
            _skip_next_step(optimizer, "amp.init's scale_loss")
        # One iteration's weight casts end here: the optimizer is about to change the weights.
        self._clear_cache()

    def _clear_cache(self) -> None:
        self._cache.clear()

    def _deactivate(self) -> None:
        """Put every patched torch function back; the handle then passes everything through."""
        if not self._is_active:
            return
        self._is_active = False
        self._casts.enabled = False
        self.function_patches.restore()
        replaced = self._casts.restore()
        if replaced:
            logger.warning("apex.amp: %s were replaced by other code while amp.init was active; left as they are",
                           ", ".join(replaced))
        self._cache.clear()

    @property
    def has_cache(self) -> bool:
        return self._enable_caching

    @property
    def cache(self):
        return self._cache

    @property
    def verbose(self) -> bool:
        return self._verbose

    def loss_scale(self) -> float:
        return self._default_scaler.loss_scale()


class NoOpHandle:
    """What ``amp.init(enabled=False)`` returns: the same interface, passing everything through."""

    def is_active(self) -> bool:
        return False

    @contextlib.contextmanager
    def _disable_casts(self):
        yield

    def wrap_optimizer(self, optimizer, num_loss: int = 1) -> OptimWrapper:
        return OptimWrapper(optimizer, self, num_loss)

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizer):
        yield loss

    def _clear_cache(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False


class SessionHandle:
    """``_amp_state.handle`` after ``amp.initialize``: ``_deactivate()`` stops that session's O1 casts.

    Its models' forwards then run without autocast and registered functions
    stop casting; loss scaling and the optimizers stay as ``initialize`` left
    them (``amp.deinitialize()`` undoes those).
    """

    def __init__(self, session: Any) -> None:
        self._session = session

    def is_active(self) -> bool:
        return _amp_state.session is self._session and bool(self._session.patch_functions)

    @contextlib.contextmanager
    def _disable_casts(self):
        with disable_casts():
            yield

    def scale_loss(self, loss, optimizer):
        return scale_loss(loss, optimizer)

    def _clear_cache(self) -> None:
        pass  # autocast's cast cache lives for one forward

    def _deactivate(self) -> None:
        self._session.patch_functions = False
        self._session.function_patches.restore()

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return _amp_state.verbosity > 1
