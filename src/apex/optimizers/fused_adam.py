"""FusedAdam with NVIDIA Apex's signature, defaults and semantics, on combined buffers.

Per param group, with the group's step count ``t`` (NVIDIA keeps one per group)::

    g = grad (+ weight_decay * p                  when adam_w_mode=False: L2, as torch.optim.Adam)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2
    u = (m / bc1) / (sqrt(v / bc2) + eps)        bc1 = 1 - beta1^t, bc2 = 1 - beta2^t (1 with bias_correction=False)
    p = p - lr * (u + weight_decay * p)         (the decay term only when adam_w_mode=True: AdamW)

so ``adam_w_mode=True`` (the default) is torch.optim.AdamW and ``adam_w_mode=False``
torch.optim.Adam: the same math as NpuFusedAdam(W), with a per-group step count and
optional bias correction. Executors: the apex_C ``_raw_adam_step`` kernel on CPU (one pass
per group x dtype); elsewhere torch's fused Adam(W) (`adam.fused_adam`) for fp32 sets with
the bias correction on, where the device has it, else NpuFusedAdam's torch ops on flat
slices. All shrink p by ``1 - lr * weight_decay`` before the Adam step, which is
``p - lr * (u + weight_decay * p)`` up to rounding.

fp16 / bf16 params: as NVIDIA, the moments are fp32 and each param is updated in fp32
and rounded once, in place: the params' own flat buffer with fp32 state buffers beside it
(the CPU kernel converts on the fly; the torch executor works on fp32 copies of each run of
slots), so the optimizer holds no fp32 copy of the params and, with torch's default
``zero_grad()``, none of the grads.

``capturable=True`` is NVIDIA's GradScaler-aware form: ``group["lr"]`` is a float32 tensor
and ``group["step"]`` an int32 tensor ``[t]`` on the params' device, and torch's
``GradScaler`` drives the step without unscaling the grads first
(``_step_supports_amp_scaling``): a step with inf/NaN grads is skipped, the step count
included, and ``1 / scale`` is folded into the update (the grads are unscaled in place
afterwards, as NVIDIA's kernel leaves them). ``master_weights=True`` (only with
``capturable``, as NVIDIA) keeps the fp32 shadows of fp16/bf16 params as master weights:
made from the params at the first step, updated in fp32 and rounded into the params,
never re-read from them. The executors are the same as without these options; what they
do not give is CUDA-graph capture of ``step()``, which reads the scaler's flags on the host.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .. import _core
from ._base import CombinedOptimizer, _call_closure, _check_adam_group, check_no_amsgrad
from ._flat import FlatSet
from ._functional import adam_math, settler
from ._nvidia import (
    AmpCOp,
    GradScalerMixin,
    NvidiaCompatMixin,
    OverflowFlag,
    ShadowParamsMixin,
    group_device,
    tensor_lr_and_step,
)
from .adam import fused_adam

__all__ = ["FusedAdam"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)

_LEGACY_STEP_ARGS_MSG = (
    "FusedAdam has been updated.  Simply initialize it identically to torch.optim.Adam, and call step() "
    "with no arguments."
)


class FusedAdam(NvidiaCompatMixin, GradScalerMixin, ShadowParamsMixin, CombinedOptimizer):
    """Adam / AdamW as ``apex.optimizers.FusedAdam``; drop-in for NVIDIA's class (see the module docstring).

    Args: params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
    weight_decay=0., amsgrad=False, set_grad_none=True, capturable=False, master_weights=False.

    ``amsgrad=True`` raises RuntimeError, as NVIDIA does. ``step()`` takes a closure;
    NVIDIA's removed step arguments (``grads``, ``output_params``, ``scale``, ``grad_norms``)
    raise NVIDIA's RuntimeError; ``grad_scaler`` is read with ``capturable=True`` and ignored
    otherwise, as NVIDIA does. ``zero_grad()`` without arguments follows ``set_grad_none``.
    ``param_groups_master``: per group, the fp32 master of each param with ``master_weights``
    (fp32 params are their own; fp16/bf16 ones get theirs at the first step, None before), all
    None without.

    torch.optim.Adam / AdamW checkpoints load (their per-param steps become the group step). A group that asks for
    math this class does not have raises ValueError at ``load_state_dict``, ``add_param_group`` or the next step,
    with nothing changed: ``amsgrad=True``, and a non-zero ``weight_decay`` whose ``decoupled_weight_decay`` is not
    ``adam_w_mode`` (an AdamW checkpoint into ``adam_w_mode=False``, or the reverse: construct the class with the
    checkpoint's rule instead). Without decay the two rules are one update, so either loads.
    """

    # upstream's kernel handles, for subclasses that replace step() (see `AmpCOp`)
    multi_tensor_adam = AmpCOp("multi_tensor_adam")
    multi_tensor_adam_capturable = AmpCOp("multi_tensor_adam_capturable")
    multi_tensor_adam_capturable_master = AmpCOp("multi_tensor_adam_capturable_master")
    _dummy_overflow_buf = OverflowFlag()

    _gather_grads = True  # the kernel reads grads only through OptArgs

    _has_step = False  # NVIDIA: group["step"], no per-param step

    _unscale_grads_after = True  # capturable + GradScaler: NVIDIA's kernel leaves the grads unscaled

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, master_weights=False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if master_weights and not capturable:
            raise RuntimeError("Master weights is currently only supported with the capturable version.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        self._validate_group(defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.set_grad_none = bool(set_grad_none)
        self.capturable = bool(capturable)
        self.master_weights = bool(master_weights)
        # GradScaler hands over its scale and flags only in the capturable form, as NVIDIA's class: otherwise
        # it unscales the grads in place before step(), which user code may rely on when it reads them
        self._step_supports_amp_scaling = self.capturable
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """Capturable: lr becomes a float32 tensor on the group's device (the step count one at the first
        step), as NVIDIA keeps them."""
        super().add_param_group(param_group)
        if self.capturable:
            tensor_lr_and_step(self.param_groups[-1])

    def _advance_group_steps(self) -> None:
        if self.capturable:
            for group in self.param_groups:
                if group.get("step") is None:
                    group["step"] = torch.zeros(1, dtype=torch.int32, device=group_device(group))
        super()._advance_group_steps()

    @property
    def param_groups_master(self) -> List[dict]:
        """NVIDIA's attribute (see the class docstring)."""
        if not self.master_weights:
            return [{"params": [None] * len(g["params"])} for g in self.param_groups]
        return self._master_lists(lambda p: p if p.dtype == torch.float32 else None)

    def _validate_group(self, group: dict) -> None:
        _check_adam_group(group)
        check_no_amsgrad(type(self).__name__, group)
        # torch.optim.Adam / AdamW checkpoints name their decay: one that is not adam_w_mode's would run the other
        # decay rule; without decay the two rules are the same update (torch.optim.Adam(weight_decay=0) is FusedAdam's
        # common source), so only a decay that is used must agree
        if "decoupled_weight_decay" in group and float(group["weight_decay"]) != 0.0:
            decoupled = bool(group["decoupled_weight_decay"])
            if decoupled != self.adam_w_mode:
                raise ValueError(
                    f"{type(self).__name__}(adam_w_mode={self.adam_w_mode}) applies "
                    f"{'decoupled (AdamW)' if self.adam_w_mode else 'L2 (Adam)'} weight decay; the group has "
                    f"decoupled_weight_decay={group['decoupled_weight_decay']!r} and weight_decay="
                    f"{group['weight_decay']} ({'torch.optim.AdamW' if decoupled else 'torch.optim.Adam'}'s rule): "
                    f"construct FusedAdam(adam_w_mode={decoupled}) to continue with it"
                )

    def _shadow_dtypes(self) -> Tuple[torch.dtype, ...]:
        return _LOW_PRECISION if self.master_weights else ()

    def _state_dtype_for(self, dtype: torch.dtype) -> Optional[torch.dtype]:
        # NVIDIA's fp32 moments; without master weights the kernel updates the fp16/bf16 params in place
        return torch.float32 if dtype in _LOW_PRECISION else None

    def _state_names(self, group: dict) -> List[str]:
        return ["exp_avg", "exp_avg_sq"]

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, grad_scaler=None):
        """One update of every param with a grad. Returns the closure's loss (None without a closure)."""
        if any(a is not None for a in (grads, output_params, scale, grad_norms)):
            raise RuntimeError(_LEGACY_STEP_ARGS_MSG)
        loss = _call_closure(closure)
        if self.capturable:
            self._scaled_update(grad_scaler, self._adam_step)
        else:
            self._adam_step()
        return loss

    def _adam_step(self) -> None:
        self._sync_shadows()
        self._update(self._prepare_counted_step())

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        self._use_group_step(s, group)
        b1, b2 = group["betas"]
        flags = _core.ext.FLAG_DECOUPLED if self.adam_w_mode else 0
        if not group["bias_correction"]:
            flags |= _core.ext.FLAG_NO_BIAS_CORRECTION
        a = self._prepare_args(s, [float(group["lr"]), b1, b2, group["eps"], group["weight_decay"]], flags)
        _core.ext._raw_adam_step(a)

    def _torch_gather_ok(self, s: FlatSet, group: dict) -> bool:
        # torch's fused Adam(W) is this class's math with the bias correction on, the moments in the params'
        # dtype (fp32 here) and the step count a host number (capturable keeps it on the device)
        return not self.capturable and bool(group["bias_correction"]) and self._torch_fused_ok(s)

    def _torch_gather_step(self, s: FlatSet, group: dict) -> None:
        self._use_group_step(s, group)
        b1, b2 = group["betas"]
        fused_adam(s, lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"],
                   weight_decay=group["weight_decay"], amsgrad=False, decoupled=self.adam_w_mode)

    def _torch_step(self, s: FlatSet, group: dict) -> None:
        step = self._use_group_step(s, group)
        b1, b2 = group["betas"]
        settle = settler(s.state_dtype)
        lr = float(group["lr"])

        def update(p, g, states, _):  # `step` is the group's (NVIDIA's bias correction)
            adam_math(
                p, g, *states, None, lr=lr, beta1=b1, beta2=b2, eps=group["eps"],
                weight_decay=group["weight_decay"], step=step, amsgrad=False, decoupled=self.adam_w_mode,
                bias_correction=group["bias_correction"], grad_scale=self._grad_scale(), settle=settle,
            )

        self._update_runs(s, ["exp_avg", "exp_avg_sq"], update)
        self.last_executor = "torch"
