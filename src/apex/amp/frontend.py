"""``amp.initialize``, amp checkpoints (``state_dict`` / ``load_state_dict``) and ``deinitialize``."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import MutableMapping
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import _device
from .._checks import check_int
from . import _ddp
from ._amp_state import _amp_state, logger, maybe_log
from ._cast_lists import FLOAT, FUNCTIONAL_SESSION_FLOAT
from ._casts import FunctionPatches, check_registry
from ._model import (
    Cast,
    InstancePatch,
    StateDictHooks,
    casts_to_undo,
    check_models,
    check_params_fp32,
    convert_network,
    model_device,
    patch_forward,
    patch_replicate,
    patch_zero_grad,
    undo_casts,
)
from ._optimizer import process_optimizer
from ._properties import O0, O1, O2, O3, Properties, check_opt_level  # noqa: F401
from ._properties import OPT_LEVELS as opt_levels  # noqa: F401  (upstream's names, imported from here)
from .scaler import LossScaler, check_scale_value, check_scaler_states, load_scaler_states, scaler_states

# More losses than any training script scales separately (GANs use two or three); each gets a scaler at initialize.
MAX_LOSSES = 2 ** 16

_DTYPE_NAMES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class _Session:
    """Everything one ``amp.initialize`` call set up, and how to undo it."""

    def __init__(self, properties: Properties, device_type: str, low_dtype: torch.dtype) -> None:
        self.properties = properties
        self.device_type = device_type
        self.low_dtype = low_dtype
        self.patch_functions = bool(properties.patch_torch_functions)
        self.user_cast_preferred = bool(properties.user_cast_preferred)
        self.function_patches = FunctionPatches()
        self.model_patches: List[InstancePatch] = []
        self.models: List[torch.nn.Module] = []
        self.casts: Dict[int, List[Cast]] = {}  # what convert_network cast, by id of the model (held in models)
        self.optimizers: List[torch.optim.Optimizer] = []
        self.loss_scalers: List[LossScaler] = []
        self.overflow_flag = False  # npu without inf/nan mode: read the float-status register
        self.pending_flag_overflow: set = set()  # loss ids whose delay_unscale backward raised the register
        self.ddp: Any = None
        self.ddp_replica_count = 4
        self.request: Optional[tuple] = None  # initialize's options as given (`_repeats_active_session`)

    def release_flag_overflows(self, loss_ids) -> None:
        """NPU flag mode: the overflow flags the delayed backwards of these losses raised were acted on, or went
        with their grads. A flag stays for a loss whose chain is still open on another optimizer."""
        still_open = {opt._amp_stash.delayed_chain[0] for opt in self.optimizers
                      if opt._amp_stash.delayed_chain is not None}
        self.pending_flag_overflow -= set(loss_ids) - still_open

    def on_model_zero_grad(self, model: torch.nn.Module, set_to_none: bool) -> None:
        stashes = [opt._amp_stash for opt in self.optimizers]
        # grads set to None and no masters (O1, the default zero_grad, every Trainer step): nothing to
        # accumulate onto, so no walk over the model's params
        if not any(s.pairs or (s.combined is not None and not set_to_none) or s.holds_stashed_grads
                   or s.delayed_chain is not None for s in stashes):
            return
        ids = frozenset(id(p) for p in model.parameters())
        for stash in stashes:
            stash.drop_master_grads(ids)  # O2: the masters' grads are the model's, accumulated
            stash.drop_stashed_grads(ids)
            stash.end_chain_if_zeroed(ids)
            if stash.combined is not None and not set_to_none:
                stash.combined.mark_zeroed(ids)

    def holds(self, model: torch.nn.Module) -> bool:
        return any(m is model for m in self.models)

    def cast_back_to_fp32(self, model: torch.nn.Module) -> set:
        """Ids of the model's tensors `release_model` gives fp32 back (amp cast them from fp32)."""
        return {id(t) for _, _, _, t, before in casts_to_undo(self.casts.get(id(model), []))
                if before == torch.float32}

    def release_model(self, model: torch.nn.Module) -> None:
        """The model is passed to a new ``amp.initialize``: it leaves this session as if it had never entered it.
        Its patches go, the tensors amp cast get their dtype back (params their fp32 masters' values), and
        this session's optimizers that update any of its params are torn down as `deinitialize` does (an O2
        one keeps stepping its masters, no longer copied into the model). The session's other models stay."""
        if not self.holds(model):
            return
        pids = {id(p) for p in model.parameters()}
        leaving = [opt for opt in self.optimizers
                   if any(id(p) in pids for _, p in opt._amp_stash.pairs)
                   or any(id(p) in pids for g in opt.param_groups for p in g["params"])]
        masters = {id(p): master for opt in leaving for master, p in opt._amp_stash.pairs if id(p) in pids}
        for patch in reversed([p for p in self.model_patches if p.obj is model]):
            patch.restore()
        self.model_patches = [p for p in self.model_patches if p.obj is not model]
        undo_casts(self.casts.pop(id(model), []), masters)
        for opt in leaving:
            opt._amp_stash.teardown()
        self.optimizers = [opt for opt in self.optimizers if not any(opt is o for o in leaving)]
        self.models = [m for m in self.models if m is not model]

    def teardown(self) -> None:
        self.function_patches.restore()
        for patch in reversed(self.model_patches):
            patch.restore()
        self.model_patches.clear()
        for opt in self.optimizers:
            opt._amp_stash.teardown()
        _ddp.call(self.ddp, "teardown")


def _truth(name: str, value: Any) -> bool:
    """An on/off argument read as upstream reads it (its truth value), except a string: ``"False"`` and ``"no"``
    are true, which is never what a caller meant; and a value without a truth value is a TypeError."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"amp.initialize: {name} must be a bool, got the string {value!r}")
    try:
        return bool(value)
    except Exception as exc:  # whatever __bool__ raises (a multi-element tensor, ...)
        raise TypeError(f"amp.initialize: {name} must be a bool, got {type(value).__name__} ({exc})") from exc


def _as_list(value: Any, kind: type, what: str) -> Tuple[List[Any], bool]:
    if isinstance(value, kind):
        return [value], False
    if isinstance(value, (list, tuple)):
        items = list(value)
        for i, item in enumerate(items):
            if not isinstance(item, kind):
                raise TypeError(f"{what} must be either a single {kind.__name__} or a list of them; entry {i} is "
                                f"{type(item).__name__}")
        return items, True
    raise TypeError(f"{what} must be either a single {kind.__name__} or a list of them, got {type(value).__name__}")


def _same_shape(items: List[Any], original: Any, was_list: bool) -> Any:
    if not was_list:
        return items[0]
    return type(original)(items) if isinstance(original, tuple) else items


def _low_dtype(amp_dtype: Any, device_type: str) -> torch.dtype:
    if amp_dtype is None:
        return _device.default_amp_dtype(device_type)
    if isinstance(amp_dtype, str):
        dtype = _DTYPE_NAMES.get(amp_dtype.lower())
    else:
        dtype = amp_dtype if amp_dtype in (torch.float16, torch.bfloat16) else None
    if dtype is None:
        raise ValueError(f"amp.initialize: amp_dtype must be torch.float16, torch.bfloat16 (or their names), "
                         f"got {amp_dtype!r}")
    return dtype


def initialize(
    models,
    optimizers=None,
    enabled=True,
    opt_level="O1",
    cast_model_type=None,
    patch_torch_functions=None,
    keep_batchnorm_fp32=None,
    master_weights=None,
    loss_scale=None,
    cast_model_outputs=None,
    num_losses=1,
    verbosity=1,
    dynamic_init_scale=2.0**16,
    scale_growth_factor=2.0,
    scale_backoff_factor=0.5,
    scale_window=2000,
    min_loss_scale=None,
    max_loss_scale=2.0**24,
    combine_grad=None,
    combine_ddp=None,
    ddp_replica_count=4,
    user_cast_preferred=None,
    check_combined_tensors=None,
    *,
    amp_dtype=None,
    fold_unscale=None,
    fp32_state_dict=True,
):
    """Prepare models and optimizers for mixed-precision training (see docs/amp.md).

    Returns the models and optimizers in the shape they were given (a single
    object or a list); without optimizers, only the models. Options left as
    None take the opt level's value. Beyond upstream: ``amp_dtype`` picks the
    low-precision dtype (default fp16 on cuda/npu, bf16 on cpu;
    ``APEX_AMP_DTYPE`` overrides the default), ``fold_unscale=True`` (with
    combine_grad) leaves the unscale to the optimizer's update when it can do
    it in the same pass. ``fp32_state_dict=False`` keeps ``model.state_dict()`` in the model's
    dtype under O2/O3 (by default its fp16/bf16 entries are saved as fp32, as NVIDIA's amp does).
    """
    verbosity = check_int(verbosity, "amp.initialize: verbosity")
    enabled = _truth("enabled", enabled)
    model_list, models_was_list = _as_list(models, torch.nn.Module, "models")
    if optimizers is None:
        opt_list, opts_was_list = [], False
    else:
        opt_list, opts_was_list = _as_list(optimizers, torch.optim.Optimizer, "optimizers")

    def result():
        m = _same_shape(model_list, models, models_was_list)
        if optimizers is None:
            return m
        return m, _same_shape(opt_list, optimizers, opts_was_list)

    if not enabled:
        _amp_state.verbosity = verbosity
        _amp_state.opt_properties = _disabled_properties()
        _amp_state.loss_scalers = []
        _amp_state.session = None
        return result()

    # the same call again on what it returned (transformers' Trainer.train() run twice): nothing to do
    request = (opt_level, cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale,
               cast_model_outputs, num_losses, min_loss_scale, max_loss_scale, dynamic_init_scale,
               scale_growth_factor, scale_backoff_factor, scale_window, combine_grad, combine_ddp, ddp_replica_count,
               user_cast_preferred, check_combined_tensors, amp_dtype, fold_unscale, fp32_state_dict,
               os.environ.get("APEX_AMP_DTYPE"))
    if _repeats_active_session(model_list, opt_list, request):
        maybe_log("apex.amp: amp.initialize called again with the same models, optimizers and options: "
                  "they stay as prepared")
        return result()

    # ---- every check first: nothing is changed unless all of them pass
    check_opt_level(opt_level)
    check_models(model_list)
    for i, model in enumerate(model_list):
        for j in range(i):
            if model_list[j] is model:
                raise RuntimeError(f"model {i} appears twice in the list passed to amp.initialize (also as model "
                                   f"{j}); pass each model once")
    for i, opt in enumerate(opt_list):
        if hasattr(opt, "_amp_stash"):
            raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
        if opt_list.index(opt) != i:
            raise RuntimeError(f"optimizer {i} appears twice in the list passed to amp.initialize")
    if not isinstance(fp32_state_dict, bool):
        raise TypeError(f"amp.initialize: fp32_state_dict must be a bool, got {fp32_state_dict!r}")
    num_losses = check_int(num_losses, "amp.initialize: num_losses", 1)
    if num_losses > MAX_LOSSES:  # one scaler object per loss is made now: a typo must not exhaust memory
        raise ValueError(f"amp.initialize: num_losses must be at most {MAX_LOSSES}, got {num_losses}")
    scale_window = check_int(scale_window, "amp.initialize: scale_window", 1)
    ddp_replica_count = check_int(ddp_replica_count, "amp.initialize: ddp_replica_count", 1)
    dynamic_init_scale = check_scale_value("dynamic_init_scale", dynamic_init_scale, scale=True)
    max_loss_scale = check_scale_value("max_loss_scale", max_loss_scale, scale=True)
    min_loss_scale = check_scale_value("min_loss_scale", min_loss_scale, allow_none=True, scale=True)
    growth = check_scale_value("scale_growth_factor", scale_growth_factor)
    backoff = check_scale_value("scale_backoff_factor", scale_backoff_factor)
    if growth < 1.0:
        raise ValueError(f"amp.initialize: scale_growth_factor must be >= 1, got {growth}")
    if backoff > 1.0:
        raise ValueError(f"amp.initialize: scale_backoff_factor must be in (0, 1], got {backoff}")
    if min_loss_scale is not None and min_loss_scale > max_loss_scale:
        raise ValueError(f"amp.initialize: min_loss_scale ({min_loss_scale}) is larger than max_loss_scale "
                         f"({max_loss_scale})")
    if cast_model_outputs is not None and cast_model_outputs not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"amp.initialize: cast_model_outputs must be a floating torch.dtype or None, "
                        f"got {cast_model_outputs!r}")
    # a model an earlier session prepared leaves it (`_Session.release_model`): what that session cast is
    # fp32 again before this one casts, so it passes the fp32 check
    holders = [(model, s) for model in model_list for s in _amp_state.sessions if s.holds(model)]
    if not _amp_state.allow_incoming_model_not_fp32:
        check_params_fp32(model_list, set().union(*(s.cast_back_to_fp32(m) for m, s in holders)))

    device = model_device(model_list)
    device_type = _device.autocast_device_type(device)
    low = _low_dtype(amp_dtype, device_type)
    props = Properties(opt_level, low)
    overrides = dict(cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
                     keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights, loss_scale=loss_scale,
                     combine_grad=combine_grad, combine_ddp=combine_ddp,
                     check_combined_tensors=check_combined_tensors, user_cast_preferred=user_cast_preferred,
                     fold_unscale=fold_unscale)
    for name, value in overrides.items():
        if value is not None:
            props.override(name, value)
    props.check_combination()
    if props.cast_model_type and fp32_state_dict:
        _check_state_dict_hooks(model_list, opt_level)
    if props.patch_torch_functions:
        check_registry("amp.initialize")
    if props.master_weights:
        for i, opt in enumerate(opt_list):
            for p in (p for g in opt.param_groups for p in g["params"]):
                if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise TypeError(f"Optimizer's parameters must be float32, float16 or bfloat16 for master "
                                    f"weights; optimizer {i} has a {p.dtype} param")

    # existing optimizer state (a checkpoint loaded before initialize) is loaded again below, cast to the model's
    # new dtype or moved to the fp32 masters: a state that load refuses must fail now, before a model is cast
    if props.cast_model_type or props.master_weights:
        for opt in opt_list:
            check_loaded = getattr(opt, "_check_loaded", None)  # apex optimizers: load's checks, changing nothing
            if opt.state and check_loaded is not None:
                check_loaded(opt.state_dict())

    session = _Session(props, device_type, low)
    session.request = request
    session.ddp_replica_count = ddp_replica_count
    session.overflow_flag = _device.npu_needs_overflow_flag(device_type)
    session.loss_scalers = [
        LossScaler(props.loss_scale, init_scale=dynamic_init_scale, scale_factor=growth, scale_window=scale_window,
                   min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale, backoff_factor=backoff)
        for _ in range(num_losses)
    ]
    session.models = model_list
    session.optimizers = opt_list
    if props.combine_ddp:
        session.ddp = _ddp.create(session)  # raises before anything changed when no backend is registered

    # ---- from here on, models and optimizers are changed
    # The function casts go first: installing them is the one step left that could still fail (a registered
    # function replaced by something unpatchable in the meantime), and then nothing else has changed yet.
    previous = _amp_state.session
    if previous is not None:
        previous.function_patches.restore()
    if session.patch_functions:
        try:
            _install_function_casts(session)
        except BaseException:
            session.function_patches.restore()
            if previous is not None and previous.patch_functions:
                try:
                    _install_function_casts(previous)
                except Exception:  # the same registration fails again: that session runs without its casts
                    previous.function_patches.restore()
                    logger.warning("apex.amp: the previous session's function casts could not be put back")
            raise
    if previous is not None:
        logger.warning("apex.amp: amp.initialize was called again; the previous session's function casts are "
                       "removed (its models and optimizers stay prepared until amp.deinitialize(), except the models "
                       "passed again and the optimizers that update them)")
    # apex optimizers that loaded an amp checkpoint before this call hand over its loss scale (taken now: the
    # state reloads below make them forget it)
    loaded_scalers = [_take_loaded_scalers(opt) for opt in opt_list]
    for model, earlier in holders:
        earlier.release_model(model)
    _amp_state.verbosity = verbosity
    maybe_log("Selected optimization level %s: %s (low-precision dtype %s on %s)", opt_level, props.brief, low,
              device_type, rank0=True)
    maybe_log("Processed optimization options:\n%s", props.describe(), rank0=True)

    autocast = bool(props.patch_torch_functions)  # O1 (also with cast_model_type=torch.float32)
    if props.cast_model_type:
        for model in model_list:
            session.casts[id(model)] = convert_network(model, props.cast_model_type, bool(props.keep_batchnorm_fp32))
            if fp32_state_dict:
                session.model_patches.append(StateDictHooks(model))
        if not props.master_weights:
            # existing optimizer state (e.g. a checkpoint loaded before initialize) follows its params' new dtype,
            # as a checkpoint loaded after initialize would (torch casts states to the param dtype at load).
            # Under master weights the states move to the fp32 masters instead (make_masters), unrounded.
            for opt in opt_list:
                if opt.state:
                    opt.load_state_dict(opt.state_dict())
        output_dtype = cast_model_outputs if cast_model_outputs is not None else torch.float32
        for model in model_list:
            session.model_patches.append(patch_forward(model, session, props.cast_model_type, output_dtype,
                                                       autocast=autocast))
    elif autocast or cast_model_outputs is not None:
        for model in model_list:
            session.model_patches.append(patch_forward(model, session, None, cast_model_outputs, autocast=autocast))
    for opt in opt_list:
        process_optimizer(opt, session)
    # model.zero_grad() must reach what amp keeps beside the grads: set-aside grads, master grads, flat buffers
    for model in model_list:
        session.model_patches.append(patch_zero_grad(model, session.on_model_zero_grad))
        # DataParallel copies the model's attributes into its replicas: they must get patches of their own
        session.model_patches.append(patch_replicate(model))

    _amp_state.session = session
    _amp_state.add_session(session)
    _amp_state.opt_properties = props
    _amp_state.loss_scalers = session.loss_scalers
    for opt, loaded in zip(opt_list, loaded_scalers):
        if loaded:
            opt._amp_stash.hold_scalers(loaded)  # applied at its first scale_loss per loss (handle.py)
    _record_upstream_state(session, min_loss_scale, max_loss_scale)
    return result()


def _install_function_casts(session: _Session) -> None:
    """O1 autocasts the forward only; a loss computed after it meets a low-precision output and fp32 targets.
    Upstream's O1 casts its float32 functions wherever they are called, so such a loss runs in float32 (torch's
    CUDA backward of several losses rejects mixed dtypes): the losses and the softmax family keep that rule
    process-wide while the session's casts are on. User registrations are installed after, so theirs win."""
    for name in FUNCTIONAL_SESSION_FLOAT:
        session.function_patches.install(torch.nn.functional, name, FLOAT)
    session.function_patches.install_registry()


def _check_state_dict_hooks(models: List[torch.nn.Module], opt_level: str) -> None:
    """fp32_state_dict puts a state_dict hook on every module of a cast model; TorchScript modules take none,
    and finding that out after the cast would leave the weights cast by a failed call."""
    for i, model in enumerate(models):
        for name, module in model.named_modules():
            if isinstance(module, torch.jit.ScriptModule):
                where = f"model {i}" + (f" (its submodule {name!r})" if name else "")
                raise RuntimeError(
                    f"amp.initialize: {where} is a TorchScript module ({type(module).__name__}), which takes no "
                    f"state_dict hooks, so {opt_level} with fp32_state_dict=True cannot save its low-precision "
                    f"weights as float32. Pass fp32_state_dict=False (state_dict() then holds the model's own "
                    f"dtype)")


def _repeats_active_session(models: list, optimizers: list, request: tuple) -> bool:
    """Whether this call repeats the one that made the active session: the same models and optimizers (the
    objects it returned, in the same order, none torn down since) and equal options. Upstream refused any
    optimizer passed a second time; a repeated call is harmless, and a second ``Trainer.train()`` makes one."""
    session = _amp_state.session
    if session is None or not optimizers or session.request is None:
        return False
    same = (len(models) == len(session.models) and all(a is b for a, b in zip(models, session.models))
            and len(optimizers) == len(session.optimizers)
            and all(a is b for a, b in zip(optimizers, session.optimizers))
            and not any(opt._amp_stash.torn_down for opt in optimizers))
    if not same:
        return False
    try:  # options compared as given (a tensor scale or a custom object may not compare to a bool)
        return bool(request == session.request)
    except Exception:
        return False


def _take_loaded_scalers(opt: torch.optim.Optimizer) -> list:
    """The loss scalers an apex optimizer validated when it loaded an amp checkpoint (none for others)."""
    loaded = getattr(opt, "loaded_amp_scalers", None)
    if loaded is None:
        return []
    opt.loaded_amp_scalers = None
    return loaded


def _record_upstream_state(session: _Session, min_loss_scale: Optional[float], max_loss_scale: float) -> None:
    """The ``_amp_state`` fields upstream's initialize sets that user code reads."""
    from .handle import SessionHandle

    _amp_state.handle = SessionHandle(session)
    _amp_state.min_loss_scale = min_loss_scale
    _amp_state.max_loss_scale = max_loss_scale


def _disabled_properties() -> Properties:
    props = Properties("O0", torch.float16)
    props.options["enabled"] = False
    return props


def deinitialize() -> None:
    """Undo every amp.initialize (and an active amp.init): forward/zero_grad/optimizer patches and casts go.

    Models keep the dtype amp gave them and O2 optimizers keep stepping on their
    fp32 masters (no longer copied into the model). An optimizer that went
    through amp.initialize cannot be passed to it again.
    """
    for session in reversed(_amp_state.sessions):
        session.teardown()
    for handle in (_amp_state.handle, _amp_state.init_handle):  # an amp.init handle's process-wide casts end too
        if handle is not None:
            handle._deactivate()
    _amp_state.handle = _amp_state.init_handle = None
    _amp_state.clear_sessions()
    _amp_state.session = None
    _amp_state.opt_properties = None
    _amp_state.loss_scalers = []


def state_dict(destination=None):
    """``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}`` (upstream's format)."""
    if destination is None:
        destination = OrderedDict()
    elif not isinstance(destination, MutableMapping):
        raise TypeError(f"amp.state_dict: destination must be a dict (or None), got {type(destination).__name__}")
    destination.update(scaler_states(_amp_state.loss_scalers))
    return destination


def load_state_dict(state_dict):
    """Restore the loss scalers from :func:`state_dict` output; everything is checked before anything is set.

    Raises RuntimeError for keys other than ``loss_scalerN``, TypeError for an entry that is not a
    ``{"loss_scale", "unskipped"}`` dict or holds a non-number, ValueError for a non-finite or
    non-positive scale or a negative count (see docs/amp.md, "Checkpointing").
    """
    entries = check_scaler_states(state_dict, "amp.load_state_dict")
    scalers = _amp_state.loss_scalers
    for idx, key, _, _ in entries:
        if idx >= len(scalers):
            logger.warning("apex.amp: skipping %s, since num_losses was set to %d", key, len(scalers))
    if len(state_dict) != len(scalers):
        logger.warning("apex.amp: state_dict contains %d entries, while %d loss_scalers are used",
                       len(state_dict), len(scalers))
    load_scaler_states(scalers, entries)
    for session in _amp_state.sessions:  # the amp checkpoint decides: optimizers' held scalers are dropped
        for opt in session.optimizers:
            stash = getattr(opt, "_amp_stash", None)
            if stash is not None:
                stash.pending_scalers.clear()


def active_session() -> Optional[_Session]:
    return _amp_state.session


__all__ = ["deinitialize", "initialize", "load_state_dict", "state_dict"]
