"""``scale_loss``: the loss-scaling context manager."""

from __future__ import annotations

import contextlib
from typing import Any, List

import torch

from .. import _device
from . import _ddp
from ._amp_state import _amp_state
from ._casts import disable_casts  # noqa: F401  (upstream exports it from here)


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
        if stash is None or stash.torn_down:
            raise RuntimeError(
                f"scale_loss: optimizer {i} ({type(opt).__name__}) was not returned by the active amp.initialize"
            )
    return optimizers


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id: int = 0, model=None, delay_unscale: bool = False,
               delay_overflow_check: bool = False):
    """Yield ``loss.float() * loss_scale``; on exit unscale the grads, check for overflow, update the scale.

    On exit (unless ``delay_unscale``) the gradients of the params of
    ``optimizers`` that this backward produced are divided by the loss scale and
    added to the grads they already had (gradient accumulation), and checked for
    inf/nan. A dynamic scaler then backs off on overflow, and each optimizer in
    ``optimizers`` skips its next ``step()`` once; a static scale never skips.
    ``delay_unscale=True`` leaves the grads scaled, to be unscaled by a later
    ``scale_loss`` of the same loss (accumulation without the per-backward cost).
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
    optimizers = _optimizer_list(optimizers)
    scalers = _amp_state.loss_scalers
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < len(scalers):
        raise ValueError(
            f"scale_loss: loss_id must be an int in [0, {len(scalers)}) (amp.initialize(num_losses={len(scalers)})), "
            f"got {loss_id!r}"
        )
    session = _amp_state.session
    scaler = scalers[loss_id]
    scale = scaler.loss_scale()
    stashes = [opt._amp_stash for opt in optimizers]
    ddp = session.ddp if session is not None else None  # combine_ddp (apex.amp._ddp)

    if not props.master_weights and not scaler.dynamic and scale == 1.0 and ddp is None:
        # Nothing to unscale and never a skipped step: the grads accumulate as in plain torch.
        yield loss.float()
        return

    for stash in stashes:
        if stash.combined is not None:
            stash.prepare_backward(scale)  # pending-scale bookkeeping handles delayed and accumulated grads
        elif not delay_unscale and not stash.params_have_scaled_gradients:
            stash.prepare_backward(scale)
    if ddp is not None:
        _ddp.call(ddp, "before_backward", [stash.combined for stash in stashes], delay_unscale)
    use_flag = session is not None and session.overflow_flag
    if use_flag:
        # The register is global: cleared before every backward, read after it. A delay_unscale backward's
        # overflow is read at its own exit and kept per loss (below), so clearing here never loses it.
        _device.npu_clear_overflow_flag()
    try:
        yield loss.float() * scale
    except BaseException:
        for stash in stashes:
            stash.restore_after_error()
        raise

    if delay_unscale:
        for stash in stashes:
            stash.after_delayed_exit()
        if use_flag and _device.npu_get_overflow_flag():
            session.pending_flag_overflow.add(loss_id)  # reported at this loss's next real exit
        return
    scaler.clear_overflow_state()
    for stash in stashes:
        scaler.record_overflow(stash.post_backward(scale, check=not use_flag, fold=True))
        stash.params_have_scaled_gradients = False
    if use_flag:
        scaler.record_overflow(_device.npu_get_overflow_flag() or loss_id in session.pending_flag_overflow)
        session.pending_flag_overflow.discard(loss_id)
    if ddp is not None:  # every rank skips together
        scaler.record_overflow(bool(_ddp.call(ddp, "agree_overflow", scaler.has_overflow())))
    should_skip = False if delay_overflow_check else scaler.update_scale()
    if should_skip:
        for stash in stashes:
            if stash.skip_pending is None:
                stash.skip_pending = (loss_id, scaler)
