"""Small tensor helpers shared by amp, contrib and the optimizers (torch only, no apex imports).

Tensor readers for ``map()`` (``get_dtype``, ``data_ptr``, ...): the per-step checks over every param or grad
run as one C-level map per property, with no Python frame per tensor; the modules that do so share these.

``map_tensors``: amp's input casts and the compact checkpoints of combined tensors
both walk user data (dicts, lists, tuples, namedtuples) that they must not mutate:
the caller may still hold it (a module's inputs, an optimizer's live per-param
state), so each container is rebuilt and keeps its type.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Callable, Optional

import torch

get_device = operator.attrgetter("device")
get_dtype = operator.attrgetter("dtype")
get_grad = operator.attrgetter("grad")
get_is_cpu = operator.attrgetter("is_cpu")
get_is_nested = operator.attrgetter("is_nested")
get_layout = operator.attrgetter("layout")
get_nbytes = operator.attrgetter("nbytes")
get_shape = operator.attrgetter("shape")
data_ptr = torch.Tensor.data_ptr
detach = torch.Tensor.detach
is_contiguous = torch.Tensor.is_contiguous
is_neg = torch.Tensor.is_neg
numel = torch.Tensor.numel
stride = torch.Tensor.stride


#: attribute set (True) on a flat grad buffer whose owner reduces in the optimizer's buffer once the grads live
#: there (apex.parallel.DistributedDataParallel): fused optimizers adopt kept grads that view it, which hands the
#: owner their buffer, where views of other owners' buffers are read in place at every step
YIELDS_GRADS = "_apex_yields_grads"

#: attribute a fused optimizer sets on one grad it read in place (its flat set's token): found again at the next
#: step, the grad was kept between steps (a tensor made since cannot carry it) and is adopted into the
#: optimizer's buffer
READ_IN_PLACE_MARK = "_apex_read_in_place_by"


def forget_read_in_place(t: torch.Tensor) -> None:
    """Drops the mark of `READ_IN_PLACE_MARK` from ``t``: an owner that binds its view to ``p.grad`` again after
    the grad was set to None (and copies the new one in) says so, since that view was not kept between steps."""
    t.__dict__.pop(READ_IN_PLACE_MARK, None)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with each tensor ``t`` in it replaced by ``fn(t)``; other leaves are kept as they are.

    Raises ValueError for a container that contains itself (the copy would never end). Not checked while
    torch.compile traces the call (amp's cast of a compiled model's inputs): the check keys on ``id()`` of each
    container, which dynamo guards on, so every call recompiled until the recompile limit sent the model back
    to eager; a traced call's arguments cannot hold a cycle anyway (dynamo refuses them first)."""
    return _map_tensors(value, fn, None if torch.compiler.is_compiling() else set())


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor], path: Optional[set]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if not isinstance(value, (dict, tuple, list)):
        return value
    if path is not None:
        if id(value) in path:
            raise ValueError(f"a {type(value).__name__} contains itself (a reference cycle): only trees of dicts, "
                             "lists and tuples can be copied with their tensors mapped")
        path.add(id(value))
    try:
        if type(value) is dict:  # the kwargs of a call: a comprehension, which torch.compile traces
            return {k: _map_tensors(v, fn, path) for k, v in value.items()}
        if isinstance(value, dict):
            # copy.copy keeps the mapping's type and attributes (OrderedDict, HF ModelOutput, a state_dict's
            # _metadata)
            out = copy.copy(value)
            for k, v in value.items():
                out[k] = _map_tensors(v, fn, path)
            return out
        if isinstance(value, tuple):
            items = [_map_tensors(v, fn, path) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return type(value)(_map_tensors(v, fn, path) for v in value)
    finally:
        if path is not None:
            path.discard(id(value))


def zero_grad_(g: torch.Tensor) -> None:
    """Zeroes one grad in place as torch's ``zero_grad(set_to_none=False)`` does: detached from its graph first."""
    if g.grad_fn is not None:
        g.detach_()
    else:
        g.requires_grad_(False)
    g.zero_()
