"""Behaviour shared by the NVIDIA-Apex-compatible optimizers (FusedAdam, FusedLAMB, FusedNovoGrad, ...).

NVIDIA's fused optimizers differ from torch.optim in a few ways that user code
can observe, and code written for them must keep working unchanged here:

* one step count per *param group* (``group["step"]``, saved in
  ``state_dict()["param_groups"]``), advanced at every ``step()`` call for every
  group, instead of torch's per-parameter ``state[p]["step"]``;
* ``set_grad_none``: what ``zero_grad()`` does when called without arguments;
* constructor options that are optimizer attributes rather than group options
  (``adam_w_mode``, ``use_nvlamb``, ...), so they are not in state dicts.

The per-group step is written into the flat set's per-segment step array before
each kernel call, so the kernels (which take per-segment steps) apply NVIDIA's
bias correction.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ._base import CombinedOptimizer, _check_range
from ._flat import FlatSet

logger = logging.getLogger("apex.optimizers")

__all__ = ["NvidiaCompatMixin", "check_betas", "group_step"]


def check_betas(betas) -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: expected a pair (beta1, beta2), got {betas!r}")
    _check_range("beta parameter at index 0", betas[0], 0.0, 1.0)
    _check_range("beta parameter at index 1", betas[1], 0.0, 1.0)


def group_step(group: dict) -> float:
    """The group's step count as a float (NVIDIA keeps an int, or an int tensor in FusedMixedPrecisionLamb)."""
    step = group.get("step", 0)
    return float(step.item() if isinstance(step, torch.Tensor) else step)


class NvidiaCompatMixin:
    """Per-group steps and ``set_grad_none`` for CombinedOptimizer subclasses (list it first in the bases)."""

    set_grad_none: bool = True

    def _advance_group_steps(self) -> None:
        for group in self.param_groups:
            step = group.get("step")
            if step is None:
                group["step"] = 1
            elif isinstance(step, torch.Tensor):
                step += 1  # in place, as NVIDIA does with its device-side step tensor
            else:
                group["step"] = step + 1

    @staticmethod
    def _use_group_step(s: FlatSet, group: dict) -> float:
        """Writes the group's step into the per-segment step array the kernels read; returns it."""
        step = group_step(group)
        s.steps.fill_(step)
        return step

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """``set_to_none=None`` (NVIDIA's call without arguments) follows ``set_grad_none``.

        NVIDIA's ``set_grad_none=False`` calls torch's ``zero_grad()``, whose default became
        ``set_to_none=True`` in torch 2.0; here it means what it documents: grads are zeroed
        in place (and stay bound to the combined buffers).
        """
        if set_to_none is None:
            set_to_none = self.set_grad_none
        CombinedOptimizer.zero_grad(self, set_to_none=bool(set_to_none))

    def load_state_dict(self, state_dict: dict) -> None:
        """Also accepts torch.optim checkpoints: a group without ``step`` takes the largest per-param step."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if "step" in group:
                continue
            steps = [
                float(self.state[p]["step"]) for p in group["params"]
                if p in self.state and "step" in self.state[p]
            ]
            for p in group["params"]:
                if p in self.state:
                    self.state[p].pop("step", None)  # NVIDIA's layout: the step lives in the group
            if steps:
                group["step"] = int(max(steps))
                logger.info("apex: group without 'step' in the loaded state dict: using the params' step %d",
                            group["step"])
