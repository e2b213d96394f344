"""NpuFusedSGD = torch.optim.SGD (momentum, dampening, Nesterov, weight decay) on combined buffers."""

import random

import pytest
import torch
from _optim_harness import (
    LOW,
    Spec,
    check_grad_scale_folded,
    check_invalid,
    check_low_precision,
    check_resume_bitwise,
    check_torch_state_dict,
    check_zero_grad,
    expected_executor,
    lr_schedule_hook,
    run_side_by_side,
    use_executor,
)

from apex.optimizers import NpuFusedSGD


def ref_sgd(p, g, st, t, hp, new):
    """float64 SGD from its formulas; the first momentum buffer is the (decayed) grad itself."""
    d = g + hp["weight_decay"] * p
    out = {}
    if hp["momentum"] != 0:
        buf = d.clone() if "momentum_buffer" not in st else hp["momentum"] * st["momentum_buffer"] + (
            1 - hp["dampening"]
        ) * d
        out["momentum_buffer"] = buf
        used = new["momentum_buffer"] if new is not None else buf
        d = d + hp["momentum"] * used if hp["nesterov"] else used
    out["param"] = p - hp["lr"] * d
    return out


def draw(rng: random.Random) -> dict:
    momentum = rng.choice([0.0, rng.uniform(0.5, 0.95)])
    nesterov = momentum > 0 and rng.random() < 0.5
    dampening = 0.0 if nesterov or rng.random() < 0.5 else rng.uniform(0.0, 0.5)
    return dict(lr=rng.uniform(0.01, 0.2), momentum=momentum, dampening=dampening,
                weight_decay=rng.choice([0.0, rng.uniform(0.0, 0.1)]), nesterov=nesterov)


SPEC = Spec(ours=NpuFusedSGD, ref=ref_sgd, draw=draw, torch_cls=torch.optim.SGD, has_step=False,
            base=dict(lr=0.05))
MOMENTUM = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)


@pytest.mark.parametrize("executor", ["apex_C", "torch", "torch_ops"])
@pytest.mark.parametrize("seed", range(4))
def test_matches_torch_random_hyperparameters(seed, executor, device, monkeypatch):
    """Each executor: the C++ kernel, torch's fused SGD on flat slices, plain torch ops."""
    expected = use_executor(monkeypatch, executor, device)
    hp = draw(random.Random(100 + seed))
    skip = (lambda step, k: k == 2 and step % 4 == 1) if seed % 2 else (lambda step, k: False)
    ours, *_ = run_side_by_side(SPEC, [(4, hp)], device=device, seed=seed, ref_kind="torch", skip=skip)
    assert ours.last_executor == expected


def test_param_groups_frozen_and_skipped_params(device):
    """Two groups with different options; a frozen param; params whose grad is None on some steps."""
    layout = [(3, dict(lr=0.1, momentum=0.9, nesterov=True)), (3, dict(lr=0.03, momentum=0.5, dampening=0.3,
                                                                     weight_decay=0.05))]
    ours, *_ = run_side_by_side(SPEC, layout, device=device, seed=11, ref_kind="torch", frozen=(1,),
                                skip=lambda step, k: (k == 4 and step % 3 == 0) or (k == 0 and step < 5))
    assert ours.last_executor == expected_executor(device)


def test_hyperparameter_changes_take_effect(device):
    """Momentum switched on mid-run (torch starts the buffer from the grad), nesterov and lr changed."""

    def between(step, ours, ref):
        for opt in (ours, ref):
            g = opt.param_groups[0]
            if step == 7:
                g["momentum"] = 0.8
            if step == 15:
                g["nesterov"], g["lr"], g["weight_decay"] = True, 0.02, 0.1

    run_side_by_side(SPEC, [(4, dict(lr=0.1))], device=device, seed=3, ref_kind="torch", between=between)


@pytest.mark.parametrize("kind", ["step", "lambda"])
def test_lr_scheduler(kind, device):
    run_side_by_side(SPEC, [(3, MOMENTUM)], device=device, seed=4, ref_kind="torch", steps=12,
                     between=lr_schedule_hook(kind))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none, device):
    check_zero_grad(SPEC, MOMENTUM, set_to_none, device=device, ref_kind="torch")


@pytest.mark.parametrize("executor", ["apex_C", "torch"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("hp", [MOMENTUM, dict(lr=0.1, momentum=0.9, nesterov=True), dict(lr=0.1, weight_decay=0.1)],
                         ids=["momentum", "nesterov", "plain"])
def test_low_precision_within_one_ulp(hp, dtype, executor, device, monkeypatch):
    use_executor(monkeypatch, executor, device)
    opt = check_low_precision(SPEC, hp, dtype, device=device, seed=21, skip=lambda step, k: k == 1 and step == 2)
    assert opt.last_executor == executor


def test_grad_scale_folded(device):
    check_grad_scale_folded(SPEC, MOMENTUM, device=device)


def test_invalid_hyperparameters(device):
    bad = [
        (dict(lr=-0.1), "learning rate"),
        (dict(momentum=-0.5), "momentum"),
        (dict(weight_decay=-1e-3), "weight_decay"),
        (dict(nesterov=True, momentum=0.0), "Nesterov"),
        (dict(nesterov=True, momentum=0.9, dampening=0.1), "Nesterov"),
    ]
    check_invalid(SPEC, bad, device=device)


def test_lr_is_required():
    with pytest.raises(ValueError, match="lr"):
        NpuFusedSGD([torch.nn.Parameter(torch.zeros(2))])
    opt = NpuFusedSGD([{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.1}])
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("hp", [MOMENTUM, dict(lr=0.1)], ids=["momentum", "no-momentum"])
def test_state_dict_matches_torch(hp, device):
    check_torch_state_dict(SPEC, hp, device=device)


@pytest.mark.parametrize("executor", ["apex_C", "torch"])
def test_resume_is_bitwise(executor, device, monkeypatch):
    use_executor(monkeypatch, executor, device)
    check_resume_bitwise(SPEC, dict(MOMENTUM, nesterov=False), device=device, executor=executor)


def test_no_state_without_momentum(device):
    p = torch.nn.Parameter(torch.randn(4, device=device))
    opt = NpuFusedSGD([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state_dict()["state"] == {}
