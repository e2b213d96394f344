"""A weight decay of 0 adds no decay term, as in torch: an inf param stays inf (0 * inf would make it NaN).

Every optimizer that mirrors a torch.optim class, every executor, fp32 and bf16: inf and NaN land where torch puts
them, in the params and in every state; finite values are torch's within a few roundings (torch rounds each of its
ops in the param dtype, we compute in fp32 and round once). fp16 is left out: torch's single-tensor path computes
in fp16, where Adam's eps (1e-8) is 0, so a zero grad gives 0 / 0 = NaN there and not in torch's fused kernels
or ours. SGD has its own copy of this test (tests/test_optim_sgd.py), with bitwise fp32 values.

Where ours runs torch's fused kernel (the torch executor, fp32, a device torch has fused kernels for), the
reference is torch's ``fused=True``: that is the kernel ours calls, and on CUDA its decoupled decay subtracts
``lr * wd * p``, so an inf param becomes NaN there as in torch's own fused AdamW.
"""

from __future__ import annotations

import pytest
import torch
from _optim_harness import assert_nonfinite_alike, runs_torch_fused, step_twins, use_executor

import apex.optimizers as ao

VALUES = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1.5, -2.0, 3.0])
GRADS = torch.tensor([1.0, 1.0, 1.0, -0.0, 0.25, 0.5, -0.0, 0.75])

# (ours, torch's, hyperparameters): the decay off, and on where it is decoupled (a multiplication keeps inf)
CASES = {
    "Adam": ("NpuFusedAdam", torch.optim.Adam, dict(lr=1e-3, weight_decay=0.0)),
    "Adam-amsgrad": ("NpuFusedAdam", torch.optim.Adam, dict(lr=1e-3, weight_decay=0.0, amsgrad=True)),
    "AdamW": ("NpuFusedAdamW", torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.0)),
    "AdamW-decay": ("NpuFusedAdamW", torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)),
    "FusedAdam": ("FusedAdam", torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)),
    "FusedAdam-L2": ("FusedAdam", torch.optim.Adam, dict(lr=1e-3, weight_decay=0.0, adam_w_mode=False)),
    "RMSprop": ("NpuFusedRMSprop", torch.optim.RMSprop, dict(lr=1e-3, weight_decay=0.0)),
    "RMSprop-centered-momentum": ("NpuFusedRMSprop", torch.optim.RMSprop,
                                  dict(lr=1e-3, weight_decay=0.0, centered=True, momentum=0.9)),
    "Adadelta": ("NpuFusedAdadelta", torch.optim.Adadelta, dict(lr=1.0, weight_decay=0.0)),
    "Adagrad": ("FusedAdagrad", torch.optim.Adagrad, dict(lr=1e-2, weight_decay=0.0)),
}


def _ref_kwargs(hp, fused: bool):
    """torch's arguments: ours without NVIDIA's adam_w_mode (the reference class says it); torch's fused kernel
    where ours runs it (`runs_torch_fused`), else the single-tensor path."""
    path = {"fused": True} if fused else {"foreach": False}
    return dict({k: v for k, v in hp.items() if k != "adam_w_mode"}, **path)


@pytest.mark.parametrize("executor", ["apex_C", "torch", "torch_ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_nonfinite_params_as_torch(monkeypatch, device, executor, dtype, case):
    name, ref_cls, hp = CASES[case]
    fused = runs_torch_fused(ref_cls, device, dtype, executor)
    expect = use_executor(monkeypatch, executor, device)
    ours, ours_p, ref, ref_p = step_twins(lambda ps: getattr(ao, name)(ps, **hp),
                                          lambda ps: ref_cls(ps, **_ref_kwargs(hp, fused)), VALUES, GRADS, device,
                                          dtype)
    assert ours.last_executor == expect
    pairs = [("param", ours_p.detach(), ref_p.detach())]
    for key, value in ref.state[ref_p].items():
        if key != "step" and key in ours.state[ours_p]:
            pairs.append((key, ours.state[ours_p][key], value))
    tol = 8 * torch.finfo(dtype).eps
    for key, a, b in pairs:
        a, b = assert_nonfinite_alike(a, b, f"{case} {key}")
        torch.testing.assert_close(a, b, rtol=tol, atol=1e-30, msg=lambda m, key=key: f"{case} {key}: {m}")
