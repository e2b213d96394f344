"""Workarounds for torch behaviours that break training scripts which use apex.

Imported (for its effect) by the subpackages that import torch: ``apex.amp``, ``apex.optimizers`` and
``apex.parallel``. Each workaround is a function that changes nothing when it does not apply.
"""

from __future__ import annotations

import importlib


def import_distributed_nn_first() -> bool:
    """Import ``torch.distributed.nn`` now, while no process group exists; True if it was imported here.

    ``torch.distributed.nn.functional`` takes ``group.WORLD`` as the default argument of its collectives when
    it is first imported, and torch imports it lazily (the first optimizer construction imports
    ``torch._dynamo``, which imports it). Imported after ``init_process_group``, those defaults hold the default
    group, so ``destroy_process_group`` cannot release it: gloo's worker threads then outlive the interpreter's
    shutdown, and one that releases a collective's tensor during it aborts the process ("terminate called
    without an active exception", SIGABRT) after training succeeded. Imported first, the defaults are None.
    After ``init_process_group`` this does nothing: importing then would hold the group itself.
    """
    try:
        dist = importlib.import_module("torch.distributed")
        if not dist.is_available() or dist.is_initialized():
            return False
        importlib.import_module("torch.distributed.nn")
    except Exception:  # an optional part of torch: never a reason for apex not to import
        return False
    return True


import_distributed_nn_first()
