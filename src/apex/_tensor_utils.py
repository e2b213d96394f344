"""Small tensor helpers shared by amp, contrib and the optimizers (torch only, no apex imports).

``map_tensors``: amp's input casts and the compact checkpoints of combined tensors
both walk user data (dicts, lists, tuples, namedtuples) that they must not mutate:
the caller may still hold it (a module's inputs, an optimizer's live per-param
state), so each container is rebuilt and keeps its type.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with each tensor ``t`` in it replaced by ``fn(t)``; other leaves are kept as they are."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        # copy.copy keeps the mapping's type and attributes (OrderedDict, HF ModelOutput, a state_dict's _metadata)
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = map_tensors(v, fn)
        return out
    if isinstance(value, tuple):
        items = [map_tensors(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def zero_grad_(g: torch.Tensor) -> None:
    """Zeroes one grad in place as torch's ``zero_grad(set_to_none=False)`` does: detached from its graph first."""
    if g.grad_fn is not None:
        g.detach_()
    else:
        g.requires_grad_(False)
    g.zero_()
