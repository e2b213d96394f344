"""Model side of amp: checks, casting the network, and the per-instance patches.

Nothing is patched on classes or globally: ``model.forward``, ``model.zero_grad`` and the hook torch's
DataParallel makes its replicas with (``_replicate_for_data_parallel``) get an instance attribute (`AmpForward`,
`AmpZeroGrad`, `AmpReplicate`) that shadows the class method, removed again on teardown.
"""

from __future__ import annotations

import copy
import types
import weakref
from itertools import chain
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ._casts import cast_tensors, casts_disabled

_PARALLEL_WRAPPERS = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
_LOW_DTYPES = (torch.float16, torch.bfloat16)


def check_models(models: List[Any]) -> None:
    for i, model in enumerate(models):
        if isinstance(model, _PARALLEL_WRAPPERS) or getattr(type(model), "_apex_parallel_wrapper", False):
            raise RuntimeError(
                f"Incoming model {i} is an instance of {type(model).__module__}.{type(model).__name__}. Parallel "
                "wrappers should only be applied to the model(s) AFTER the model(s) have been returned from "
                "amp.initialize."
            )
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"models must be either a single model or a list of models; entry {i} is "
                            f"{type(model).__name__}")


def check_params_fp32(models: List[torch.nn.Module], cast_back: frozenset = frozenset()) -> None:
    """Upstream's rule: amp does the casting, so incoming floating params and buffers must be fp32.
    ``cast_back``: ids of tensors an earlier session cast, which are made fp32 again before this one casts."""
    for i, model in enumerate(models):
        for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, t in named:
                if t.is_floating_point() and t.dtype != torch.float32 and id(t) not in cast_back:
                    raise RuntimeError(
                        f"Found {kind} {name} of model {i} with dtype {t.dtype}, expected torch.float32.\n"
                        "When using amp.initialize, you do not need to call .half() on your model before passing "
                        "it, no matter what optimization level you choose."
                    )


def model_device(models: List[torch.nn.Module]) -> Optional[torch.device]:
    for model in models:
        for t in model.parameters():
            return t.device
        for t in model.buffers():
            return t.device
    return None


#: one tensor amp cast: (module, name, is a param, dtype before, dtype after)
Cast = Tuple[torch.nn.Module, str, bool, torch.dtype, torch.dtype]


def convert_network(model: torch.nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> List[Cast]:
    """Cast floating params/buffers (and existing grads) to ``dtype`` in place; batchnorm stays fp32 if asked.

    Params keep their identity (``param.data`` is replaced), so optimizers built
    on them before amp.initialize still hold the same objects. Returns what was cast (`casts_to_undo`).
    """
    casts: List[Cast] = []
    with torch.no_grad():
        for module in model.modules():
            if keep_batchnorm_fp32 and isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                continue
            for name, param in module.named_parameters(recurse=False):
                if param.is_floating_point() and param.dtype != dtype:
                    casts.append((module, name, True, param.dtype, dtype))
                    param.data = param.data.to(dtype)
                    if param.grad is not None and param.grad.is_floating_point():
                        param.grad = param.grad.to(dtype)
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                    casts.append((module, name, False, buf.dtype, dtype))
                    module._buffers[name] = buf.to(dtype)
    return casts


def casts_to_undo(casts: List[Cast]) -> List[Tuple[torch.nn.Module, str, bool, torch.Tensor, torch.dtype]]:
    """The casts of `convert_network` that still hold: the module has the tensor under that name, in the dtype
    amp gave it. Each as (module, name, is a param, the tensor now, its dtype before amp). A tensor replaced or
    cast since (``model.half()`` on top, a new buffer) is the user's, not amp's, and is left out."""
    out = []
    for module, name, is_param, before, after in casts:
        t = (module._parameters if is_param else module._buffers).get(name)
        if t is not None and t.dtype == after:
            out.append((module, name, is_param, t, before))
    return out


def master_where_kept(master: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """A master weight after its low-precision model copy may have been written: the master where the model still
    holds it rounded to the model dtype (its precision is kept), the model's value elsewhere (a change since)."""
    return torch.where(model == master.to(model.dtype), master, model.to(master.dtype))


def undo_casts(casts: List[Cast], masters: Dict[int, torch.Tensor]) -> None:
    """Give the tensors amp cast their dtype back (a model prepared by an earlier session is passed to
    `amp.initialize` again). ``masters``: fp32 master weights by id of their model param; a param takes its
    master's value where the model still holds that master rounded to the model dtype, and its own elsewhere
    (a weight the user changed since the last step), as `AmpStash.sync_masters` decides."""
    with torch.no_grad():
        for module, name, is_param, t, before in casts_to_undo(casts):
            if not is_param:
                module._buffers[name] = t.to(before)
                continue
            master = masters.get(id(t))
            if master is not None and master.shape == t.shape and master.device == t.device:
                value = master_where_kept(master.detach(), t.detach()).to(before)
            else:
                value = t.detach().to(before)
            t.data = value
            if t.grad is not None and t.grad.is_floating_point():
                t.grad = t.grad.to(before)


class InstancePatch:
    """Shadow ``obj.<name>`` with an instance attribute; ``restore`` brings back what was there."""

    def __init__(self, obj: Any, name: str, replacement: Callable) -> None:
        self.obj, self.name, self.replacement = obj, name, replacement
        self.had_own = name in obj.__dict__
        self.previous = obj.__dict__.get(name)
        object.__setattr__(obj, name, replacement)

    def active(self) -> bool:
        return self.obj.__dict__.get(self.name) is self.replacement

    def restore(self) -> None:
        if not self.active():
            return  # replaced again by someone else: theirs wins
        if self.had_own:
            object.__setattr__(self.obj, self.name, self.previous)
        else:
            object.__delattr__(self.obj, self.name)


class AmpForward:
    """The ``forward`` amp binds on a model instance: casts the inputs, runs the forward it shadows (under
    autocast at O1) and casts the outputs.

    An object rather than a closure so that copies of the model call their own forward: ``copy.deepcopy``
    (timm's and others' EMA models, made after ``amp.initialize``) copies the module and the patch with it, and
    a closure kept by reference ran the original model for the copy. The copy shares the session (its
    autocast switch), which is not copied. Pickling keeps the casts and the autocast choice without the session:
    an unpickled model runs as amp prepared it, with autocast on unless casts are disabled
    (``_amp_state.handle._deactivate()``). ``__wrapped__`` is the forward it shadows, so ``inspect.signature``
    (transformers' Trainer reads the forward's parameters) sees the model's own.
    """

    def __init__(self, model: torch.nn.Module, previous: Optional[Callable], session: Any,
                 input_dtype: Optional[torch.dtype], output_dtype: Optional[torch.dtype], autocast: bool,
                 device_type: str, low_dtype: Optional[torch.dtype]) -> None:
        # previous: an instance attribute ``forward`` this one shadows (None: the class's forward)
        self.model, self.previous, self.session = model, previous, session
        self.input_dtype, self.output_dtype, self.autocast = input_dtype, output_dtype, autocast
        self.device_type, self.low_dtype = device_type, low_dtype
        # bound once here: looked up per call (type(model).forward), torch.compile's tracing recursed into this patch
        self.__wrapped__ = previous if previous is not None else types.MethodType(type(model).forward, model)

    def __call__(self, *args, **kwargs):
        inner = self.__wrapped__
        if self.input_dtype is not None:
            args = cast_tensors(args, self.input_dtype)
            kwargs = cast_tensors(kwargs, self.input_dtype)
        on = self.session.patch_functions if self.session is not None else True
        if self.autocast and on and not casts_disabled():  # _amp_state.handle._deactivate() stops it
            with torch.autocast(self.device_type, dtype=self.low_dtype):
                out = inner(*args, **kwargs)
        else:
            out = inner(*args, **kwargs)
        if self.output_dtype is not None:
            out = cast_tensors(out, self.output_dtype)
        return out

    def _settings(self) -> tuple:
        return self.input_dtype, self.output_dtype, self.autocast, self.device_type, self.low_dtype

    def bound_to(self, module: torch.nn.Module) -> AmpForward:
        """The same patch for another instance sharing this one's ``__dict__`` entries (a DataParallel replica)."""
        return AmpForward(module, _rebound(self.previous, self.model, module), self.session, *self._settings())

    def __deepcopy__(self, memo: dict) -> AmpForward:
        # reached through the model's __dict__: memo maps the model to its copy in progress
        return AmpForward(copy.deepcopy(self.model, memo), copy.deepcopy(self.previous, memo), self.session,
                          *self._settings())

    def __reduce__(self):
        return AmpForward, (self.model, self.previous, None, *self._settings())


class AmpZeroGrad:
    """The ``zero_grad`` amp binds on a model instance: the one it shadows, then amp's bookkeeping of what was
    zeroed (``on_zero``). A copy of the model (``copy.deepcopy``) or an unpickled one gets its plain
    ``zero_grad``: it is not a model of the session, and the closure this replaces zeroed the original's grads."""

    def __init__(self, model: torch.nn.Module, previous: Optional[Callable],
                 on_zero: Callable[[Any, bool], None]) -> None:
        self.model, self.previous, self.on_zero = model, previous, on_zero

    def __call__(self, set_to_none: bool = True) -> None:
        if self.previous is not None:
            self.previous(set_to_none=set_to_none)
        else:
            type(self.model).zero_grad(self.model, set_to_none=set_to_none)
        self.on_zero(self.model, set_to_none)

    def __deepcopy__(self, memo: dict) -> Callable:
        if self.previous is not None:
            return copy.deepcopy(self.previous, memo)
        clone = copy.deepcopy(self.model, memo)
        return types.MethodType(type(clone).zero_grad, clone)

    def __reduce__(self):
        return _plain_zero_grad, (self.model, self.previous)


class AmpReplicate:
    """The ``_replicate_for_data_parallel`` amp binds on a model instance. torch's DataParallel makes each replica
    as a shallow copy of the model's ``__dict__``, which carries the instance patches bound to the original: every
    replica would run the original's forward on the original's params (on the original's device), and a replica's
    ``zero_grad`` would zero the original's grads. This rebinds them: a replica's forward is an `AmpForward` of the
    replica (its own broadcast params, the same casts and session), its ``zero_grad`` the plain one (a replica is
    not a model of the session) and its own replicas are made the same way."""

    def __init__(self, model: torch.nn.Module, previous: Optional[Callable]) -> None:
        self.model, self.previous = model, previous

    def __call__(self) -> torch.nn.Module:
        model = self.model
        if self.previous is not None:
            replica = self.previous()
        else:
            replica = type(model)._replicate_for_data_parallel(model)
        attrs = replica.__dict__
        forward = attrs.get("forward")
        if isinstance(forward, AmpForward) and forward.model is model:
            attrs["forward"] = forward.bound_to(replica)
        zero_grad = attrs.get("zero_grad")
        if isinstance(zero_grad, AmpZeroGrad) and zero_grad.model is model:
            if zero_grad.previous is None:
                del attrs["zero_grad"]
            else:
                attrs["zero_grad"] = _rebound(zero_grad.previous, model, replica)
        if attrs.get("_replicate_for_data_parallel") is self:
            attrs["_replicate_for_data_parallel"] = AmpReplicate(replica, _rebound(self.previous, model, replica))
        return replica

    def __deepcopy__(self, memo: dict) -> AmpReplicate:
        return AmpReplicate(copy.deepcopy(self.model, memo), copy.deepcopy(self.previous, memo))

    def __reduce__(self):
        return AmpReplicate, (self.model, self.previous)


def _rebound(fn: Optional[Callable], old: Any, new: Any) -> Optional[Callable]:
    """``fn`` as a method of ``new`` where it is a method bound to ``old``; anything else as it is."""
    if isinstance(fn, types.MethodType) and fn.__self__ is old:
        return types.MethodType(fn.__func__, new)
    return fn


def _plain_zero_grad(model: torch.nn.Module, previous: Optional[Callable]) -> Callable:
    """What an unpickled model gets for `AmpZeroGrad`: the zero_grad it shadowed."""
    return previous if previous is not None else types.MethodType(type(model).zero_grad, model)


def patch_forward(model: torch.nn.Module, session: Any, input_dtype: Optional[torch.dtype],
                  output_dtype: Optional[torch.dtype], autocast: bool) -> InstancePatch:
    """Shadow ``model.forward`` with an `AmpForward`: cast inputs, run under autocast (O1), cast outputs."""
    previous = model.__dict__.get("forward")
    return InstancePatch(model, "forward", AmpForward(model, previous, session, input_dtype, output_dtype, autocast,
                                                      session.device_type, session.low_dtype))


def patch_zero_grad(model: torch.nn.Module, on_zero: Callable[[Any, bool], None]) -> InstancePatch:
    """Shadow ``model.zero_grad`` with an `AmpZeroGrad`, so amp learns which grads were zeroed: the grads it set
    aside for the next exit, O2's master grads, and combine_grad's flat buffers known to be zero."""
    return InstancePatch(model, "zero_grad", AmpZeroGrad(model, model.__dict__.get("zero_grad"), on_zero))


def patch_replicate(model: torch.nn.Module) -> InstancePatch:
    """Shadow ``model._replicate_for_data_parallel`` with an `AmpReplicate`, so that DataParallel's replicas run
    their own params through amp's forward (install after the other patches: it rebinds them)."""
    return InstancePatch(model, "_replicate_for_data_parallel",
                         AmpReplicate(model, model.__dict__.get("_replicate_for_data_parallel")))


def _fp32_state_dict(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post hook: the module's own fp16/bf16 params and buffers are saved as fp32 (NVIDIA's O2/O3 rule).

    A checkpoint of a cast model then loads into an fp32 model, or back into a cast one (torch's
    ``load_state_dict`` copies into the params, converting). Entries that are the live tensors
    (``keep_vars=True``) are left as they are. Entries that view the same memory (tied weights: GPT-2's
    embedding and LM head) get the same fp32 tensor, so a checkpoint stores them once, as it stores the live
    tied param once. Module-level, so hooked models still pickle.
    """
    copies = _copies_for(state_dict)
    for name, t in chain(module._parameters.items(), module._buffers.items()):
        key = prefix + name
        v = state_dict.get(key) if t is not None else None
        if isinstance(v, torch.Tensor) and v is not t and v.dtype in _LOW_DTYPES:
            if copies is None:
                state_dict[key] = v.float()
                continue
            same = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.stride(), v.dtype,
                    v.device)
            converted = copies.get(same)
            if converted is None:
                converted = copies[same] = v.float()
            state_dict[key] = converted


# fp32 copies made for one state_dict() call, per destination dict, by id (dicts are unhashable) while the dict
# lives (torch's destination is an OrderedDict, which can be weakly referenced; a plain dict given as
# ``destination`` cannot, and its tied entries are converted apart)
_FP32_COPIES: Dict[int, Tuple[weakref.ref, dict]] = {}


def _copies_for(state_dict: dict) -> Optional[dict]:
    key = id(state_dict)
    entry = _FP32_COPIES.get(key)
    if entry is not None and entry[0]() is state_dict:
        return entry[1]
    try:
        ref = weakref.ref(state_dict, lambda _, key=key: _FP32_COPIES.pop(key, None))
    except TypeError:
        return None
    copies: dict = {}
    _FP32_COPIES[key] = (ref, copies)
    return copies


class StateDictHooks:
    """`_fp32_state_dict` on every module of a model; ``restore`` removes them (session teardown)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.obj = model
        self.handles = [m.register_state_dict_post_hook(_fp32_state_dict) for m in model.modules()]

    def restore(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
