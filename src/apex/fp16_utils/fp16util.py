"""Manual mixed-precision helpers: half-precision models with fp32 batchnorm, fp32 master copies.

These are the building blocks of the pre-amp FP16 workflow: convert the model to fp16 (batchnorm
kept in fp32), keep an fp32 *master* copy of the params for the optimizer, copy the fp16 grads
to the masters before the step and the updated masters back into the model after it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.modules.batchnorm import _BatchNorm

from apex.fp16_utils.loss_scaler import to_python_float

__all__ = [
    "BN_convert_float",
    "FP16Model",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]

def clip_grad_norm(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
    """Scale the grads of ``parameters`` in place so their total ``norm_type`` norm is at most ``max_norm``;
    returns the total norm before clipping (a tensor). Upstream's name for torch's ``clip_grad_norm_``,
    which does the work."""
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type,
                                          error_if_nonfinite=error_if_nonfinite)


def _check_module(obj: Any, where: str) -> nn.Module:
    if not isinstance(obj, nn.Module):
        raise TypeError(f"{where}: expected a torch.nn.Module, got {type(obj).__name__}")
    return obj


class tofp16(nn.Module):
    """A module that casts its input to fp16 (the first stage of :func:`network_to_half`)."""

    def __init__(self) -> None:  # no options: its own signature, not the varargs one inherited from torch's Module
        super().__init__()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Cast every affine batchnorm layer of ``module`` back to fp32, in place; returns ``module``.

    fp16 batchnorm statistics lose too much precision; the layer's own kernels accept fp16 input
    with fp32 weights (cudnn and torch's CPU implementation both do).
    """
    _check_module(module, "BN_convert_float")
    for m in module.modules():
        if isinstance(m, _BatchNorm) and m.affine:
            m.float()
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """``network`` in fp16 with fp32 batchnorm, behind a stage casting the input to fp16."""
    _check_module(network, "network_to_half")
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s own floating-point params (and their grads) and buffers to ``dtype``, in place."""
    _check_module(module, "convert_module")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"convert_module: dtype must be a floating-point torch.dtype, got {dtype!r}")
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None and param.grad.is_floating_point():
                param.grad.data = param.grad.data.to(dtype)
    for name, buf in module.named_buffers(recurse=False):
        if buf is not None and buf.is_floating_point():
            setattr(module, name, buf.to(dtype))


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every module of ``network`` to ``dtype`` except affine batchnorm layers; returns ``network``."""
    _check_module(network, "convert_network")
    for module in network.modules():
        if isinstance(module, _BatchNorm) and module.affine:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """``network`` converted to fp16 (batchnorm kept fp32); floating-point inputs are cast to fp16."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        _check_module(network, "FP16Model")
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: Any) -> Any:
        inputs = tuple(t.half() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)
        return self.network(*inputs)


def prep_param_lists(model: nn.Module, flat_master: bool = False) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """``(model_params, master_params)``: the params that require grad, and fp32 copies of them.

    With ``flat_master=True`` the masters are one flat fp32 ``nn.Parameter`` (with an allocated
    grad) holding every model param in order; that needs all model params to share one dtype.
    Each master requires grad and is detached from the model.
    """
    _check_module(model, "prep_param_lists")
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        dtypes = {p.dtype for p in model_params}
        if len(dtypes) > 1:
            raise TypeError(
                "prep_param_lists: flat_master=True needs every model param of one dtype, got "
                f"{sorted(map(str, dtypes))}"
            )
        if not model_params:
            raise ValueError("prep_param_lists: flat_master=True needs at least one param that requires grad")
        flat = _flatten_dense_tensors([p.detach() for p in model_params]).float()
        master = nn.Parameter(flat.clone())
        master.grad = torch.zeros_like(master)
        return model_params, [master]
    masters = []
    for p in model_params:
        m = p.detach().clone().float()
        m.requires_grad_(True)
        masters.append(m)
    return model_params, masters


def _check_copy(where: str, what: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Raises where ``dst.copy_(src)`` would fail, so that a list is checked whole before any pair is copied."""
    if src.device.type == "meta" and dst.device.type != "meta":
        raise ValueError(f"{where}: {what}: the source is a meta tensor, which holds no values")
    if dst.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"{where}: {what}: the destination is an inference tensor, which cannot be written "
                           "outside torch.inference_mode()")


def _check_dense(where: str, what: str, t: torch.Tensor) -> None:
    """A strided tensor: torch copies no sparse tensor into a dense one, nor flattens one (as upstream, whose
    copies of ``.data`` fail on them too), and would fail only after the earlier pairs were copied."""
    if t.is_nested or t.layout != torch.strided:
        got = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        hint = " (a sparse grad, as nn.Embedding(sparse=True) makes, has no dense master copy)" if t.is_sparse else ""
        raise TypeError(f"{where}: {what} must be a dense (strided) tensor, got {got}{hint}")


def _check_pairing(model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor],
                   flat_master: bool, where: str) -> None:
    model_params, master_params = list(model_params), list(master_params)
    for name, ps in (("model", model_params), ("master", master_params)):
        for i, p in enumerate(ps):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{where}: {name} param {i} must be a tensor, got {type(p).__name__}")
            _check_dense(where, f"{name} param {i}", p)
    if flat_master:
        if len(master_params) != 1:
            raise ValueError(f"{where}: flat_master=True expects one flat master, got {len(master_params)}")
        total = sum(p.numel() for p in model_params)
        flat = master_params[0]
        if flat.dim() != 1 or flat.numel() != total:
            raise ValueError(f"{where}: the flat master must be 1-D with the model params' {total} elements, got "
                             f"shape {tuple(flat.shape)}")
        return
    if len(model_params) != len(master_params):
        raise ValueError(f"{where}: {len(model_params)} model params but {len(master_params)} master params")
    for i, (model, master) in enumerate(zip(model_params, master_params)):
        if model.shape != master.shape:
            raise ValueError(f"{where}: param {i}: model shape {tuple(model.shape)} != master shape "
                             f"{tuple(master.shape)}")


def _kept_grad(master: torch.Tensor) -> Optional[torch.Tensor]:
    """The master's grad if the copy can write into it, else None (a new one is allocated)."""
    grad = master.grad
    if grad is None or grad.shape != master.shape or grad.is_nested or grad.layout != torch.strided:
        return None
    return grad


def _check_grads_to_masters(model_params: List[torch.Tensor], master_params: List[torch.Tensor],
                            flat_master: bool, where: str) -> None:
    """Every check of `model_grads_to_master_grads`, before it writes or allocates anything."""
    _check_pairing(model_params, master_params, flat_master, where)
    for i, model in enumerate(model_params):
        if model.grad is not None:
            _check_dense(where, f"param {i}: the model grad", model.grad)
    if flat_master:
        master = master_params[0]
        devices = {p.device for p in model_params}
        if len(devices) > 1:
            raise ValueError(f"{where}: flat_master=True needs every model param on one device, got "
                             f"{sorted(map(str, devices))}")
        for i, model in enumerate(model_params):
            if model.grad is not None:
                _check_copy(where, f"param {i}", master, model.grad)
        kept = _kept_grad(master)
        if kept is not None:
            _check_copy(where, "the flat master's grad", kept, master)
        return
    for i, (model, master) in enumerate(zip(model_params, master_params)):
        if model.grad is not None:
            _check_copy(where, f"param {i}", master, model.grad)
            kept = _kept_grad(master)
            if kept is not None:
                _check_copy(where, f"param {i}: the master's grad", kept, model.grad)


def _check_params_to_models(model_params: List[torch.Tensor], master_params: List[torch.Tensor],
                            flat_master: bool, where: str) -> None:
    """Every check of `master_params_to_model_params`, before it writes anything."""
    _check_pairing(model_params, master_params, flat_master, where)
    for i, model in enumerate(model_params):
        _check_copy(where, f"param {i}", model, master_params[0] if flat_master else master_params[i])


def model_grads_to_master_grads(model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor],
                                flat_master: bool = False) -> None:
    """Copy the model grads into the masters' grads (allocated as needed); a model param without a
    grad leaves its master without one. Grads must be dense: a sparse grad is refused, before anything is
    copied."""
    model_params, master_params = list(model_params), list(master_params)
    _check_grads_to_masters(model_params, master_params, flat_master, "model_grads_to_master_grads")
    _copy_grads_to_masters(model_params, master_params, flat_master)


def _copy_grads_to_masters(model_params: List[torch.Tensor], master_params: List[torch.Tensor],
                           flat_master: bool) -> None:
    """`model_grads_to_master_grads` once `_check_grads_to_masters` has passed."""
    if flat_master:
        master = master_params[0]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model_params]
        flat = _flatten_dense_tensors([g.detach() for g in grads])  # before the master's grad is allocated
        grad = _kept_grad(master)
        if grad is None:
            master.grad = grad = torch.empty_like(master)
        grad.detach().copy_(flat)
        return
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        grad = _kept_grad(master)
        if grad is None:
            master.grad = grad = torch.empty_like(master, memory_format=torch.preserve_format)
        grad.detach().copy_(model.grad.detach())


def master_params_to_model_params(model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor],
                                  flat_master: bool = False) -> None:
    """Copy the master values into the model params (rounded to the model dtype)."""
    model_params, master_params = list(model_params), list(master_params)
    _check_params_to_models(model_params, master_params, flat_master, "master_params_to_model_params")
    _copy_params_to_models(model_params, master_params, flat_master)


def _copy_params_to_models(model_params: List[torch.Tensor], master_params: List[torch.Tensor],
                           flat_master: bool) -> None:
    """`master_params_to_model_params` once `_check_params_to_models` has passed."""
    with torch.no_grad():
        if flat_master:
            for model, part in zip(model_params, _unflatten_dense_tensors(master_params[0].detach(), model_params)):
                model.copy_(part)
            return
        for model, master in zip(model_params, master_params):
            model.copy_(master.detach())
