"""``ASP``: NVIDIA Apex's automatic sparsity workflow, class methods over one model and one optimizer per process.

::

    ASP.init_model_for_pruning(model, mask_calculator="m4n2_1d", ...)   # mask buffers on eligible weights
    ASP.init_optimizer_for_pruning(optimizer)                          # masked grads before, masked weights after
    ASP.compute_sparse_masks()                                         # compute the masks and prune

or ``ASP.prune_trained_model(model, optimizer)`` for all three with upstream's choices (2:4 along input channels on
``Linear``, ``Conv2d`` and ``MultiheadAttention`` weights). To resume from a checkpoint, call
``init_model_for_pruning`` before loading it: the masks are buffers (``__weight_mma_mask``, and
``__weight_mma_pruned_p`` with ``allow_recompute_mask``), so the state dict carries them.

Eligible weights: those of modules whose type is in ``whitelist`` (or subclasses one), named in
``allowed_layer_names`` when that is given and not in ``disallowed_layer_names``, that require grad, have at least
two dimensions and whose first two dimensions are multiples of 8 and 16 (what sparse tensor cores take; upstream
checked float32 and float16 weights only, here every dtype). The others are skipped, and with ``verbosity`` >= 2 or
3 the choices are printed, as upstream printed them.

With ``allow_recompute_mask`` the pruned values are kept (on the CPU), so ``compute_sparse_masks`` can compute new
masks from the dense weights and ``restore_pruned_weights`` can make the model dense again.

Upstream also searched for input-channel permutations that keep more magnitude before computing the masks
(``allow_permutation``, on by default, through a torch.fx trace of the model). This package does not: the
argument is accepted and the masks are computed on the channels as they are, which is a valid 2:4 model, with
somewhat less magnitude kept where a permutation would have helped.

Every argument is checked before anything changes; errors are TypeError / ValueError for arguments and
RuntimeError for calls out of order (a second ``init_model_for_pruning``, an optimizer before a model, masks to
recompute without the pruned values).
"""

from __future__ import annotations

import logging
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from apex.contrib.sparsity.sparse_masklib import PATTERNS, create_mask

__all__ = ["ASP", "eligible_modules"]

logger = logging.getLogger(__name__)

_DEFAULT_PARAMETERS: Dict[type, Tuple[str, ...]] = {
    nn.Linear: ("weight",),
    nn.Conv1d: ("weight",),
    nn.Conv2d: ("weight",),
    nn.Conv3d: ("weight",),
    nn.MultiheadAttention: ("q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_weight"),
}


def eligible_modules(model: nn.Module, whitelist_layer_types, allowed_layer_names, disallowed_layer_names):
    """``(name, module)`` of ``model``'s modules that are instances of ``whitelist_layer_types``, named in
    ``allowed_layer_names`` (when not None) and not in ``disallowed_layer_names``."""
    allowed = None if allowed_layer_names is None else set(allowed_layer_names)
    disallowed = set(disallowed_layer_names or ())
    return [(name, mod) for name, mod in model.named_modules()
            if isinstance(mod, tuple(whitelist_layer_types)) and name not in disallowed
            and (allowed is None or name in allowed)]


def _parameters_for(module: nn.Module, table: Dict[type, Sequence[str]]) -> Sequence[str]:
    for cls in type(module).__mro__:  # a subclass of a listed type prunes what its base does
        if cls in table:
            return table[cls]
    return ()


def _names(value, what: str) -> Optional[List[str]]:
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(v, str) for v in _iterable(value, what)):
        raise TypeError(f"ASP.init_model_for_pruning: {what} must be a list of module names, got {value!r}")
    return list(value)


def _iterable(value, what: str):
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"ASP.init_model_for_pruning: {what} must be a list, got {type(value).__name__}") from None


class _Entry:
    """One pruned weight: where it lives (looked up on use, so moving the model keeps the entry valid)."""

    __slots__ = ("mask_name", "module", "module_name", "p_name", "pruned_name")

    def __init__(self, module_name: str, module: nn.Module, p_name: str, recompute: bool):
        self.module_name, self.module, self.p_name = module_name, module, p_name
        self.mask_name = f"__{p_name}_mma_mask"
        self.pruned_name = f"__{p_name}_mma_pruned_p" if recompute else None

    @property
    def param(self) -> torch.Tensor:
        return getattr(self.module, self.p_name)

    @property
    def mask(self) -> torch.Tensor:
        return self.module._buffers[self.mask_name]

    @property
    def pruned(self) -> Optional[torch.Tensor]:
        return None if self.pruned_name is None else self.module._buffers[self.pruned_name]

    def label(self) -> str:
        p = self.param
        return f"{self.module_name}::{self.p_name} of size={tuple(p.shape)} and type={p.dtype}"


class ASP:
    """NVIDIA Apex's ``ASP`` class methods; see the module docstring."""

    _model: Optional[nn.Module] = None
    _verbosity = 0
    _optimizer = None
    _entries: List[_Entry] = []
    _calculate_mask: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    _allow_permutation = True
    _save_permutation_graph = False
    _permutation_output_dir = "."

    # ------------------------------------------------------------------ set-up

    @classmethod
    def init_model_for_pruning(cls, model, mask_calculator="m4n2_1d", verbosity=3,
                               whitelist=(nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention),
                               allowed_layer_names=None, disallowed_layer_names=(), allow_recompute_mask=False,
                               custom_layer_dict=None, allow_permutation=True):
        """Adds a mask buffer (ones: dense) to every eligible weight of ``model``; see the module docstring."""
        where = "ASP.init_model_for_pruning"
        if cls._model is not None:
            raise RuntimeError(f"{where}: ASP has been initialized already (one model per process)")
        if not isinstance(model, nn.Module):
            raise TypeError(f"{where}: model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(mask_calculator, str):
            if mask_calculator not in PATTERNS:
                raise ValueError(f"{where}: unknown mask pattern {mask_calculator!r}; known: {', '.join(PATTERNS)}")
            pattern = mask_calculator

            def calculate(p: torch.Tensor) -> torch.Tensor:
                return create_mask(p, pattern).bool()
        elif callable(mask_calculator):
            calculate = mask_calculator
        else:
            raise TypeError(f"{where}: mask_calculator must be a pattern name or a callable, got "
                            f"{type(mask_calculator).__name__}")
        if isinstance(verbosity, bool) or not isinstance(verbosity, int):
            raise TypeError(f"{where}: verbosity must be an int, got {type(verbosity).__name__}")
        for name, flag in (("allow_recompute_mask", allow_recompute_mask), ("allow_permutation", allow_permutation)):
            if not isinstance(flag, bool):
                raise TypeError(f"{where}: {name} must be a bool, got {type(flag).__name__}")
        table = dict(_DEFAULT_PARAMETERS)
        custom = dict(custom_layer_dict or {})
        for layer, names in custom.items():
            if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
                raise TypeError(f"{where}: custom_layer_dict's keys must be nn.Module types, got {layer!r}")
            if isinstance(names, str) or not all(isinstance(n, str) for n in _iterable(names, "custom_layer_dict")):
                raise TypeError(f"{where}: custom_layer_dict[{layer.__name__}] must be a list of parameter names, "
                                f"got {names!r}")
            table[layer] = tuple(names)
        types_ = list(_iterable(whitelist, "whitelist")) + [t for t in custom if t not in list(whitelist)]
        for layer in types_:
            if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
                raise TypeError(f"{where}: whitelist must hold nn.Module types, got {layer!r}")
            if not any(c in table for c in layer.__mro__):
                raise ValueError(f"{where}: no parameters to sparsify are known for {layer.__name__}: add it to "
                                 f"custom_layer_dict with its parameter names")
        allowed = _names(allowed_layer_names, "allowed_layer_names")
        disallowed = _names(disallowed_layer_names, "disallowed_layer_names") or []

        entries: List[_Entry] = []
        messages: List[Tuple[int, str]] = []
        for module_name, module in eligible_modules(model, types_, allowed, disallowed):
            wanted = _parameters_for(module, table)
            for p_name, p in module.named_parameters(recurse=False):
                if p_name not in wanted or not p.requires_grad:
                    messages.append((3, f"[ASP] Not sparsifying {module_name}::{p_name} of size={tuple(p.shape)} "
                                        f"and type={p.dtype}"))
                    continue
                if p.dim() < 2 or p.shape[0] % 8 or p.shape[1] % 16:
                    messages.append((1, f"[ASP] Auto skipping pruning {module_name}::{p_name} of "
                                        f"size={tuple(p.shape)} and type={p.dtype} for sparsity"))
                    continue
                messages.append((3, f"[ASP] Sparsifying {module_name}::{p_name} of size={tuple(p.shape)} and "
                                    f"type={p.dtype} for sparsity"))
                entries.append(_Entry(module_name, module, p_name, allow_recompute_mask))
        # nothing failed: now change the model
        for entry in entries:
            p = entry.param
            entry.module.register_buffer(entry.mask_name, torch.ones_like(p, dtype=torch.bool))
            if allow_recompute_mask:
                entry.module.register_buffer(entry.pruned_name, torch.zeros(p.shape, dtype=p.dtype))
        cls._model, cls._verbosity, cls._entries = model, verbosity, entries
        cls._calculate_mask, cls._allow_permutation = calculate, allow_permutation
        for level, text in messages:
            if verbosity >= level:
                print(text)
        if allow_permutation:
            logger.info("ASP: input-channel permutation search is not performed; masks are computed on the "
                        "channels in their order")

    @classmethod
    def already_init_asp_model(cls) -> bool:
        """Whether ``init_model_for_pruning`` has been called."""
        done = cls._model is not None
        if cls._verbosity >= 3:
            print(f"[ASP] ASP has {'' if done else 'not '}been initialized{' already' if done else ''}.")
        return done

    @classmethod
    def init_optimizer_for_pruning(cls, optimizer) -> None:
        """Wraps ``optimizer.step``: the pruned weights' grads are masked before the update and the weights
        after it, so pruned weights stay zero."""
        where = "ASP.init_optimizer_for_pruning"
        if cls._optimizer is not None:
            raise RuntimeError(f"{where}: ASP has initialized an optimizer already")
        if cls._calculate_mask is None:
            raise RuntimeError(f"{where}: call ASP.init_model_for_pruning first")
        step = getattr(optimizer, "step", None)
        if not callable(step):
            raise TypeError(f"{where}: expected an optimizer with a step() method, got {type(optimizer).__name__}")
        entries = cls._entries

        def masked_step(opt_self, *args, **kwargs):
            with torch.no_grad():
                for entry in entries:
                    p = entry.param
                    if p.grad is not None:
                        p.grad.mul_(entry.mask)
            result = step(*args, **kwargs)
            with torch.no_grad():
                for entry in entries:
                    entry.param.mul_(entry.mask)
            return result

        optimizer.step = types.MethodType(masked_step, optimizer)
        cls._optimizer = optimizer

    # ------------------------------------------------------------------ masks

    @classmethod
    def compute_sparse_masks(cls) -> None:
        """Computes every mask from its weight and prunes the weight (in place: a checkpoint then holds zeros).
        When masks were computed before, the dense weights are restored first, which needs
        ``allow_recompute_mask``."""
        where = "ASP.compute_sparse_masks"
        if cls._calculate_mask is None:
            raise RuntimeError(f"{where}: call ASP.init_model_for_pruning first")
        with torch.no_grad():
            for entry in cls._entries:
                if not bool(entry.mask.all()) and entry.pruned is None:
                    raise RuntimeError(f"{where}: cannot compute new masks for {entry.label()}: it is pruned "
                                       f"already and its pruned values were not kept (allow_recompute_mask=False)")
            for entry in cls._entries:
                p, mask, pruned = entry.param, entry.mask, entry.pruned
                if not bool(mask.all()):
                    p.add_(pruned.to(p.device, p.dtype))
                new = cls._calculate_mask(p)
                if not isinstance(new, torch.Tensor) or new.shape != p.shape:
                    got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
                    raise ValueError(f"{where}: the mask calculator returned {got} for {entry.label()}; expected a "
                                     f"tensor of the weight's shape")
                mask.copy_(new.to(mask.device) != 0)
                if pruned is not None:
                    pruned.copy_(p.masked_fill(mask, 0).to(pruned.device))
                p.mul_(mask)
                if cls._verbosity >= 2:
                    kept = int(mask.sum())
                    print(f"[ASP] Enabled {100.0 - 100.0 * kept / max(1, mask.numel()):.2f}% sparsity for "
                          f"{entry.label()} with magnitude {float(p.abs().sum())}")

    @classmethod
    def restore_pruned_weights(cls) -> None:
        """Makes every pruned weight dense again (needs ``allow_recompute_mask``) and its mask all ones."""
        where = "ASP.restore_pruned_weights"
        with torch.no_grad():
            pruned_now = [e for e in cls._entries if not bool(e.mask.all())]
            for entry in pruned_now:
                if entry.pruned is None:
                    raise RuntimeError(f"{where}: cannot restore {entry.label()}: its pruned values were not kept "
                                       f"(allow_recompute_mask=False)")
            for entry in pruned_now:
                p = entry.param
                p.add_(entry.pruned.to(p.device, p.dtype))
                entry.mask.fill_(True)
                entry.pruned.zero_()
                if cls._verbosity >= 2:
                    print(f"[ASP] Disabled sparsity for {entry.module_name}::{entry.p_name} (dense weights restored)")

    @classmethod
    def is_sparsity_enabled(cls) -> bool:
        """True when every mask keeps half its weights, False when every mask keeps all; RuntimeError when the
        model mixes the two (or a mask is neither, as a custom calculator may give)."""
        dense = half = 0
        for entry in cls._entries:
            kept, total = int(entry.mask.sum()), entry.mask.numel()
            dense += kept == total
            half += 2 * kept == total
        if dense == len(cls._entries):
            return False
        if half == len(cls._entries):
            return True
        raise RuntimeError(f"ASP.is_sparsity_enabled: inconsistent model sparsity: of {len(cls._entries)} masks, "
                           f"{dense} are dense and {half} keep half their weights")

    @classmethod
    def prune_trained_model(cls, model, optimizer) -> None:
        """``init_model_for_pruning`` (2:4 along input channels of ``Linear``, ``Conv2d`` and
        ``MultiheadAttention`` weights, verbosity 2), ``init_optimizer_for_pruning`` and
        ``compute_sparse_masks``. The optimizer is checked before the model changes."""
        if not callable(getattr(optimizer, "step", None)):
            raise TypeError(f"ASP.prune_trained_model: expected an optimizer with a step() method, got "
                            f"{type(optimizer).__name__}")
        if cls._optimizer is not None:
            raise RuntimeError("ASP.prune_trained_model: ASP has initialized an optimizer already")
        cls.init_model_for_pruning(model, mask_calculator="m4n2_1d", verbosity=2,
                                   whitelist=[nn.Linear, nn.Conv2d, nn.MultiheadAttention],
                                   allow_recompute_mask=False)
        cls.init_optimizer_for_pruning(optimizer)
        cls.compute_sparse_masks()

    @classmethod
    def set_permutation_saving_params(cls, allow_permutation=True, save_permutation_graph=False,
                                      permutation_output_dir=".") -> None:
        """Records upstream's permutation settings; no permutation search runs here (see the module
        docstring)."""
        for name, flag in (("allow_permutation", allow_permutation),
                           ("save_permutation_graph", save_permutation_graph)):
            if not isinstance(flag, bool):
                raise TypeError(f"ASP.set_permutation_saving_params: {name} must be a bool, got "
                                f"{type(flag).__name__}")
        if not isinstance(permutation_output_dir, str):
            raise TypeError(f"ASP.set_permutation_saving_params: permutation_output_dir must be a str, got "
                            f"{type(permutation_output_dir).__name__}")
        cls._allow_permutation = allow_permutation
        cls._save_permutation_graph = save_permutation_graph
        cls._permutation_output_dir = permutation_output_dir

    # ------------------------------------------------------------------ tests and notebooks

    @classmethod
    def _reset(cls) -> None:
        """Forgets the model and optimizer (the optimizer's wrapped step and the model's buffers stay), so a new
        ``init_model_for_pruning`` may follow: for tests and notebooks, which upstream's ASP could not serve."""
        cls._model, cls._optimizer, cls._entries, cls._calculate_mask = None, None, [], None
        cls._verbosity, cls._allow_permutation = 0, True

    @classmethod
    def _parameters(cls) -> List[Tuple[str, str, Any]]:
        """(module name, parameter name, parameter) of each pruned weight."""
        return [(e.module_name, e.p_name, e.param) for e in cls._entries]
