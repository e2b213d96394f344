"""Model side of amp: checks, casting the network, and the per-instance forward patch.

Nothing is patched on classes or globally: ``model.forward`` (and, for
combine_grad sessions, ``model.zero_grad``) get an instance attribute that
shadows the class method, removed again on teardown.
"""

from __future__ import annotations

import types
from itertools import chain
from typing import Any, Callable, List, Optional

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


def check_params_fp32(models: List[torch.nn.Module]) -> None:
    """Upstream's rule: amp does the casting, so incoming floating params and buffers must be fp32."""
    for i, model in enumerate(models):
        for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
            for name, t in named:
                if t.is_floating_point() and t.dtype != torch.float32:
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


def convert_network(model: torch.nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> None:
    """Cast floating params/buffers (and existing grads) to ``dtype`` in place; batchnorm stays fp32 if asked.

    Params keep their identity (``param.data`` is replaced), so optimizers built
    on them before amp.initialize still hold the same objects.
    """
    with torch.no_grad():
        for module in model.modules():
            if keep_batchnorm_fp32 and isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                continue
            for param in module.parameters(recurse=False):
                if param.is_floating_point() and param.dtype != dtype:
                    param.data = param.data.to(dtype)
                    if param.grad is not None and param.grad.is_floating_point():
                        param.grad = param.grad.to(dtype)
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                    module._buffers[name] = buf.to(dtype)


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


def patch_forward(model: torch.nn.Module, session: Any, input_dtype: Optional[torch.dtype],
                  output_dtype: Optional[torch.dtype], autocast: bool) -> InstancePatch:
    """Wrap ``model.forward``: cast inputs, run under autocast (O1), cast outputs."""
    orig = model.forward
    device_type, low_dtype = session.device_type, session.low_dtype

    def forward(*args, **kwargs):
        if input_dtype is not None:
            args = cast_tensors(args, input_dtype)
            kwargs = cast_tensors(kwargs, input_dtype)
        if autocast and session.patch_functions and not casts_disabled():  # _amp_state.handle._deactivate() stops it
            with torch.autocast(device_type, dtype=low_dtype):
                out = orig(*args, **kwargs)
        else:
            out = orig(*args, **kwargs)
        if output_dtype is not None:
            out = cast_tensors(out, output_dtype)
        return out

    forward.__wrapped__ = orig
    return InstancePatch(model, "forward", forward)


def patch_zero_grad(model: torch.nn.Module, on_zero: Callable[[Any, bool], None]) -> InstancePatch:
    """Wrap ``model.zero_grad`` so amp learns which grads were zeroed: the grads it set aside for the next exit,
    O2's master grads, and combine_grad's flat buffers known to be zero."""
    orig = model.zero_grad

    def zero_grad(self, set_to_none: bool = True):
        orig(set_to_none=set_to_none)
        on_zero(self, set_to_none)

    return InstancePatch(model, "zero_grad", types.MethodType(zero_grad, model))


def _fp32_state_dict(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post hook: the module's own fp16/bf16 params and buffers are saved as fp32 (NVIDIA's O2/O3 rule).

    A checkpoint of a cast model then loads into an fp32 model, or back into a cast one (torch's
    ``load_state_dict`` copies into the params, converting). Entries that are the live tensors
    (``keep_vars=True``) are left as they are. Module-level, so hooked models still pickle.
    """
    for name, t in chain(module._parameters.items(), module._buffers.items()):
        key = prefix + name
        v = state_dict.get(key) if t is not None else None
        if isinstance(v, torch.Tensor) and v is not t and v.dtype in _LOW_DTYPES:
            state_dict[key] = v.float()


class StateDictHooks:
    """`_fp32_state_dict` on every module of a model; ``restore`` removes them (session teardown)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.handles = [m.register_state_dict_post_hook(_fp32_state_dict) for m in model.modules()]

    def restore(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
