"""``clip_grad_norm_`` with NVIDIA Apex's signature: the norm of all grads together, grads scaled in place.

Upstream documents it as identical to ``torch.nn.utils.clip_grad_norm_`` and only routes float32/float16 CUDA
grads through its multi-tensor kernels for the 2-norm; everywhere else it calls torch's function. Here torch's
function serves every device: on CUDA its foreach norm and scale kernels do what upstream's path did, and on CPU
and NPU it is what upstream ran. The result is torch's: the total norm as a 0-d tensor, grads multiplied by
``min(max_norm / (total_norm + 1e-6), 1)``.

Arguments are checked before any grad is touched, and errors name the offending one: a negative or nan
``max_norm`` would flip or poison every grad, so it is rejected (torch accepts it).
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable, Union

import torch

from apex._checks import check_dense

__all__ = ["clip_grad_norm_"]

_TensorOrTensors = Union[torch.Tensor, Iterable[torch.Tensor]]


def _real(name: str, value) -> float:
    """What upstream's ``float(value)`` reads: a real number (numpy's too), a one-element tensor, or a string
    such as ``'inf'``; a bool is refused, it is almost certainly another argument misplaced."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str, torch.Tensor)):
        raise TypeError(f"clip_grad_norm_: {name} must be a number, got {value!r} ({type(value).__name__})")
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise TypeError(f"clip_grad_norm_: {name} must be a number, got a tensor of shape {tuple(value.shape)}")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"clip_grad_norm_: {name} must be a number or 'inf', got {value!r}") from None


def clip_grad_norm_(parameters: _TensorOrTensors, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scales the grads of ``parameters`` in place so that their joint ``norm_type``-norm is at most ``max_norm``.

    ``parameters``: a tensor or an iterable of tensors; those without a grad, or with an empty one, are skipped
    (none left: returns ``tensor(0.)``). ``norm_type``: a positive number or ``'inf'``. ``error_if_nonfinite``:
    raise RuntimeError, changing nothing, when the total norm is nan or inf. Returns the total norm (before
    clipping) as a 0-d tensor. Raises TypeError for a non-tensor entry, a sparse, nested or meta grad or a
    non-number argument, ValueError for a negative or nan ``max_norm`` or a ``norm_type`` that is not a positive
    number.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    try:
        params = list(parameters)
    except TypeError:
        raise TypeError("clip_grad_norm_: parameters must be a tensor or an iterable of tensors, got "
                        f"{type(parameters).__name__}") from None
    for k, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"clip_grad_norm_: parameters[{k}] must be a tensor, got {type(p).__name__}")
        if p.grad is not None:
            # torch's norms fail on a sparse grad naming no parameter, and a meta grad has no norm to clip by
            check_dense(p.grad, f"clip_grad_norm_: parameters[{k}].grad", meta=False)
    max_norm = _real("max_norm", max_norm)
    if math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
    norm_type = _real("norm_type", norm_type)
    if math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be a positive number or 'inf', got {norm_type}")
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(f"clip_grad_norm_: error_if_nonfinite must be a bool, got {error_if_nonfinite!r}")
    # a grad with no elements changes no p-norm and has nothing to scale; torch's infinity norm raises on one
    grads = [p for p in params if p.grad is not None and p.grad.numel()]
    if not grads:
        return torch.tensor(0.0)
    return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type=norm_type,
                                          error_if_nonfinite=error_if_nonfinite)
