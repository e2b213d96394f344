"""NpuFusedRMSprop = torch.optim.RMSprop (momentum, centered) on combined buffers."""

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

from apex.optimizers import NpuFusedRMSprop


def ref_rmsprop(p, g, st, t, hp, new):
    """float64 RMSprop (Hinton; centered: Graves 2013) with torch's eps outside the root."""
    alpha, z = hp["alpha"], torch.zeros_like(p)
    g = g + hp["weight_decay"] * p
    out = {"square_avg": alpha * st.get("square_avg", z) + (1 - alpha) * g * g}
    used = new if new is not None else out
    var = used["square_avg"]
    if hp["centered"]:
        out["grad_avg"] = alpha * st.get("grad_avg", z) + (1 - alpha) * g
        var = var - (new if new is not None else out)["grad_avg"] ** 2
    step = g / (torch.sqrt(var) + hp["eps"])
    if hp["momentum"] > 0:
        out["momentum_buffer"] = hp["momentum"] * st.get("momentum_buffer", z) + step
        step = (new if new is not None else out)["momentum_buffer"]
    out["param"] = p - hp["lr"] * step
    return out


def draw(rng: random.Random) -> dict:
    return dict(lr=rng.uniform(1e-3, 2e-2), alpha=rng.uniform(0.8, 0.999), eps=10 ** rng.uniform(-8, -5),
                weight_decay=rng.choice([0.0, rng.uniform(0.0, 0.1)]),
                momentum=rng.choice([0.0, rng.uniform(0.5, 0.95)]), centered=rng.random() < 0.5)


SPEC = Spec(ours=NpuFusedRMSprop, ref=ref_rmsprop, draw=draw, torch_cls=torch.optim.RMSprop)
FULL = dict(lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.01, momentum=0.8, centered=True)
VARIANTS = {
    "plain": dict(lr=0.01, alpha=0.95),
    "momentum": dict(lr=0.01, alpha=0.9, momentum=0.9, weight_decay=0.05),
    "centered": dict(lr=0.01, alpha=0.9, centered=True),
    "both": FULL,
}


@pytest.mark.parametrize("executor", ["apex_C", "torch"])
@pytest.mark.parametrize("seed", range(4))
def test_matches_torch_random_hyperparameters(seed, executor, device, monkeypatch):
    use_executor(monkeypatch, executor, device)
    hp = draw(random.Random(300 + seed))
    ours, *_ = run_side_by_side(SPEC, [(4, hp)], device=device, seed=seed, ref_kind="torch")
    assert ours.last_executor == executor


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_state_layout_matches_torch(variant, device):
    """Only the states an option needs exist (momentum_buffer, grad_avg), each bound to its kernel slot."""
    run_side_by_side(SPEC, [(3, VARIANTS[variant])], device=device, seed=5, ref_kind="torch", steps=10)


def test_param_groups_frozen_and_skipped_params(device):
    layout = [(3, VARIANTS["centered"]), (2, VARIANTS["momentum"]), (2, VARIANTS["plain"])]
    ours, *_ = run_side_by_side(SPEC, layout, device=device, seed=13, ref_kind="torch", frozen=(4,),
                                skip=lambda step, k: (k == 1 and step % 3 == 2) or (k == 6 and step < 4))
    assert ours.last_executor == expected_executor(device)


def test_hyperparameter_changes_take_effect(device):
    def between(step, ours, ref):
        for opt in (ours, ref):
            if step == 9:
                opt.param_groups[0].update(alpha=0.5, weight_decay=0.1, eps=1e-3, momentum=0.3)

    run_side_by_side(SPEC, [(4, FULL)], device=device, seed=3, ref_kind="torch", between=between)


def test_momentum_switched_on_later(device):
    """torch cannot do this (KeyError); ours re-combines with a zero momentum buffer, as a fresh torch state."""
    p = torch.nn.Parameter(torch.randn(5, device=device))
    opt = NpuFusedRMSprop([p], lr=0.01)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[0]["momentum"] = 0.9
    before, sq = p.detach().clone(), opt.state[p]["square_avg"].clone()
    opt.step()
    assert list(opt.state[p]) == ["step", "square_avg", "momentum_buffer"]
    sq = 0.99 * sq + 0.01 * p.grad**2
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], p.grad / (sq.sqrt() + 1e-8))
    torch.testing.assert_close(p.detach(), before - 0.01 * opt.state[p]["momentum_buffer"])


@pytest.mark.parametrize("kind", ["step", "lambda"])
def test_lr_scheduler(kind, device):
    run_side_by_side(SPEC, [(3, FULL)], device=device, seed=4, ref_kind="torch", steps=12,
                     between=lr_schedule_hook(kind))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none, device):
    check_zero_grad(SPEC, FULL, set_to_none, device=device, ref_kind="torch")


@pytest.mark.parametrize("executor", ["apex_C", "torch"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_low_precision_within_one_ulp(variant, dtype, executor, device, monkeypatch):
    use_executor(monkeypatch, executor, device)
    opt = check_low_precision(SPEC, VARIANTS[variant], dtype, device=device, seed=23,
                              skip=lambda step, k: k == 2 and step == 4)
    assert opt.last_executor == executor


def test_grad_scale_folded(device):
    check_grad_scale_folded(SPEC, FULL, device=device)


def test_invalid_hyperparameters(device):
    bad = [
        (dict(lr=-0.01), "learning rate"),
        (dict(eps=-1.0), "epsilon"),
        (dict(momentum=-0.9), "momentum"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(alpha=-0.5), "alpha"),
    ]
    check_invalid(SPEC, bad, device=device)


@pytest.mark.parametrize("variant", ["plain", "both"])
def test_state_dict_matches_torch(variant, device):
    check_torch_state_dict(SPEC, VARIANTS[variant], device=device)


@pytest.mark.parametrize("executor", ["apex_C", "torch"])
def test_resume_is_bitwise(executor, device, monkeypatch):
    use_executor(monkeypatch, executor, device)
    check_resume_bitwise(SPEC, FULL, device=device, executor=executor)
