"""Optimization levels and the rules for overriding their properties.

The table and the override rules are upstream amp's (O0 fp32, O1 casts around
functions, O2 low-precision model with fp32 master weights, O3 pure low
precision), plus the Ascend patch's combining options. Where upstream says
"fp16", this implementation uses the session's low-precision dtype (fp16 on
cuda/npu, bf16 on cpu by default; see ``apex._device.default_amp_dtype``).

Every conflicting option raises RuntimeError naming the option, the value and
the opt level, as upstream does unless its ``hard_override`` switch is set;
wrong types raise TypeError, bad values ValueError.
"""

from __future__ import annotations

import math
from typing import Any, Dict

import torch

from .scaler import in_scale_range

# Table entry meaning "the session's low-precision dtype", resolved per device.
LOW = object()

OPT_LEVEL_NAMES = ("O0", "O1", "O2", "O3")

_LEVELS: Dict[str, Dict[str, Any]] = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None,
               master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type=LOW, patch_torch_functions=False, keep_batchnorm_fp32=True,
               master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=LOW, patch_torch_functions=False, keep_batchnorm_fp32=False,
               master_weights=False, loss_scale=1.0),
}

_BRIEF = {
    "O0": "Pure FP32 training.",
    "O1": "Insert automatic casts around Pytorch functions and Tensor methods.",
    "O2": "Low-precision model with FP32 batchnorm and FP32 master weights (\"almost low precision\").",
    "O3": "Pure low-precision training.",
}

# Options every level starts without (the Ascend patch's extras and ours).
_COMMON = dict(combine_grad=None, combine_ddp=None, check_combined_tensors=None, user_cast_preferred=None,
               fold_unscale=None)

OPTION_NAMES = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
                "master_weights", "loss_scale", "combine_grad", "combine_ddp", "check_combined_tensors",
                "user_cast_preferred", "fold_unscale")

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_opt_level(opt_level: Any) -> str:
    if not isinstance(opt_level, str) or opt_level not in _LEVELS:
        raise RuntimeError(
            f"Unexpected optimization level {opt_level!r}. Options are 'O0', 'O1', 'O2', 'O3'. Note that in "
            "`O0`, `O1`, etc., the prefix O is the letter O, not the number zero."
        )
    return opt_level


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"amp.initialize: {name} must be True, False or None, got {value!r} ({type(value).__name__})")
    return value


class Properties:
    """The effective options of an amp session (upstream's ``_amp_state.opt_properties``)."""

    def __init__(self, opt_level: str, low_dtype: torch.dtype) -> None:
        self.options: Dict[str, Any] = {"enabled": True, "opt_level": check_opt_level(opt_level)}
        for key, value in {**_LEVELS[opt_level], **_COMMON}.items():
            self.options[key] = low_dtype if value is LOW else value
        self.low_dtype = low_dtype

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options")
        if options is not None and name in options:
            return options[name]
        raise AttributeError(f"'Properties' object has no attribute {name!r}")

    @property
    def brief(self) -> str:
        return _BRIEF[self.opt_level]

    def override(self, name: str, value: Any) -> None:
        """Apply one user override (value is not None), checked against the opt level."""
        level = self.opt_level
        if name == "cast_model_type":
            if value is not False and not (isinstance(value, torch.dtype) and value in _FLOAT_DTYPES):
                raise TypeError(
                    f"amp.initialize: cast_model_type must be torch.float32, torch.float16, torch.bfloat16, False "
                    f"or None, got {value!r}"
                )
            if level == "O1" and value is not False and value is not torch.float32:
                raise RuntimeError(
                    "O1 inserts casts around Torch functions rather than model weights, so with O1, the model "
                    "weights themselves should remain FP32. If you wish to cast the model to a different type, use "
                    f"opt_level='O2' or 'O3'. cast_model_type was {value}"
                )
        elif name == "patch_torch_functions":
            _bool(name, value)
            if value and level != "O1":
                raise RuntimeError(
                    "Currently, patch_torch_functions=True should only be set by selecting opt_level='O1'; "
                    f"got it with opt_level={level!r}"
                )
        elif name == "keep_batchnorm_fp32":
            if level == "O1":
                raise RuntimeError(
                    "With opt_level O1, batchnorm functions are automatically run in FP32 by autocast, so "
                    f"keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was {value!r}"
                )
            if value == "True":
                value = True
            elif value == "False":
                value = False
            elif not isinstance(value, bool):
                raise ValueError(
                    "keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', or None, found "
                    f"keep_batchnorm_fp32={value!r}"
                )
        elif name == "master_weights":
            if level == "O1":
                raise RuntimeError(
                    "It doesn't make sense to use master_weights with O1. With O1, your model weights themselves "
                    f"should be FP32. master_weights was {value!r}"
                )
            _bool(name, value)
        elif name == "loss_scale":
            value = _loss_scale(value)
        elif name in ("combine_grad", "check_combined_tensors", "combine_ddp"):
            _bool(name, value)
            if value and level not in ("O1", "O2"):
                raise RuntimeError(f"{name}=True is only supported with opt_level 'O1' or 'O2', got {level!r}")
        elif name == "user_cast_preferred":
            _bool(name, value)
            if value and level != "O1":
                raise RuntimeError(f"user_cast_preferred=True is only supported with opt_level 'O1', got {level!r}")
        elif name == "fold_unscale":
            _bool(name, value)
        else:  # pragma: no cover - initialize only passes the names above
            raise KeyError(name)
        self.options[name] = value

    def check_combination(self) -> None:
        """Rules that involve several options; run after all overrides."""
        if self.combine_ddp and not self.combine_grad:
            raise RuntimeError("combine_ddp=True requires combine_grad=True")
        if self.check_combined_tensors and not self.combine_grad:
            raise RuntimeError("check_combined_tensors=True requires combine_grad=True")
        if self.fold_unscale and not self.combine_grad:
            raise RuntimeError("fold_unscale=True requires combine_grad=True (it folds the unscale of combined grads)")
        if self.opt_level == "O2" and self.combine_grad and not self.master_weights:
            raise RuntimeError("With opt_level O2, combine_grad=True requires master_weights=True")

    def describe(self) -> str:
        return "\n".join(f"{k:22} : {self.options[k]}" for k in OPTION_NAMES)


class _OptLevel:
    """Upstream's per-level objects (``apex.amp.frontend.O0`` ... ``O3`` and ``opt_levels``): ``brief`` and
    ``more`` describe the level, and calling one on a `Properties` resets it to that level's defaults (options
    given to ``initialize`` are applied after that, with `Properties.override`)."""

    name = ""
    more = ""

    @property
    def brief(self) -> str:
        return f"{self.name}:  {_BRIEF[self.name]}"

    def __call__(self, properties: Properties) -> Properties:
        if not isinstance(properties, Properties):
            raise TypeError(f"{self.name}: expected amp Properties, got {type(properties).__name__}")
        properties.options = Properties(self.name, properties.low_dtype).options
        return properties

    def __repr__(self) -> str:
        return f"<amp opt level {self.name}>"


class O0(_OptLevel):
    name = "O0"
    more = "The model stays float32, no casts are inserted and the loss is not scaled: a baseline run."


class O1(_OptLevel):
    name = "O1"
    more = ("The model's weights stay float32; ops that are safe in low precision run in it under autocast, the "
            "others in float32. Dynamic loss scaling.")


class O2(_OptLevel):
    name = "O2"
    more = ("The model is cast to the low-precision dtype, batchnorm kept float32; the optimizer updates float32 "
            "master weights, copied into the model after each step. Dynamic loss scaling.")


class O3(_OptLevel):
    name = "O3"
    more = ("The model, batchnorm included, is cast to the low-precision dtype, with no master weights: a speed "
            "baseline for O1 and O2. Static loss scale 1.")


OPT_LEVELS = {"O3": O3(), "O2": O2(), "O1": O1(), "O0": O0()}


def _loss_scale(value: Any):
    if value == "dynamic":
        return "dynamic"
    if isinstance(value, bool):
        raise TypeError(f"amp.initialize: loss_scale must be 'dynamic' or a positive number, got {value!r}")
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"amp.initialize: loss_scale must be 'dynamic' or a positive number, got {value!r}") from None
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"amp.initialize: loss_scale must be 'dynamic' or a positive number, got {value!r}")
    return in_scale_range("amp.initialize", "loss_scale", scale)
