"""NpuFusedAdadelta = torch.optim.Adadelta on combined buffers."""

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

from apex.optimizers import NpuFusedAdadelta


def ref_adadelta(p, g, st, t, hp, new):
    """float64 Adadelta (Zeiler 2012) with L2 weight decay, torch's eps placement."""
    rho, eps = hp["rho"], hp["eps"]
    g = g + hp["weight_decay"] * p
    sq = rho * st.get("square_avg", torch.zeros_like(p)) + (1 - rho) * g * g
    acc = st.get("acc_delta", torch.zeros_like(p))
    sq_used = new["square_avg"] if new is not None else sq
    delta = torch.sqrt(acc + eps) / torch.sqrt(sq_used + eps) * g
    return {
        "param": p - hp["lr"] * delta,
        "square_avg": sq,
        "acc_delta": rho * acc + (1 - rho) * delta * delta,
    }


def draw(rng: random.Random) -> dict:
    return dict(lr=rng.uniform(0.1, 1.0), rho=rng.uniform(0.5, 0.99), eps=10 ** rng.uniform(-7, -4),
                weight_decay=rng.choice([0.0, rng.uniform(0.0, 0.1)]))


SPEC = Spec(ours=NpuFusedAdadelta, ref=ref_adadelta, draw=draw, torch_cls=torch.optim.Adadelta)
HP = dict(lr=0.5, rho=0.8, eps=1e-6, weight_decay=0.02)


@pytest.mark.parametrize("executor", ["apex_C", "torch"])
@pytest.mark.parametrize("seed", range(4))
def test_matches_torch_random_hyperparameters(seed, executor, device, monkeypatch):
    use_executor(monkeypatch, executor, device)
    hp = draw(random.Random(200 + seed))
    ours, *_ = run_side_by_side(SPEC, [(4, hp)], device=device, seed=seed, ref_kind="torch")
    assert ours.last_executor == executor


def test_param_groups_frozen_and_skipped_params(device):
    """Two groups with different options; a frozen param; skipped params keep their own step counts."""
    layout = [(3, dict(lr=1.0, rho=0.9)), (3, dict(lr=0.3, rho=0.6, eps=1e-5, weight_decay=0.05))]
    ours, *_ = run_side_by_side(SPEC, layout, device=device, seed=12, ref_kind="torch", frozen=(2,),
                                skip=lambda step, k: (k == 3 and step % 4 == 1) or (k == 0 and step < 3))
    assert ours.last_executor == expected_executor(device)


def test_hyperparameter_changes_take_effect(device):
    def between(step, ours, ref):
        for opt in (ours, ref):
            if step == 10:
                opt.param_groups[0].update(rho=0.5, weight_decay=0.1, eps=1e-4)

    run_side_by_side(SPEC, [(4, HP)], device=device, seed=3, ref_kind="torch", between=between)


@pytest.mark.parametrize("kind", ["step", "lambda"])
def test_lr_scheduler(kind, device):
    run_side_by_side(SPEC, [(3, HP)], device=device, seed=4, ref_kind="torch", steps=12,
                     between=lr_schedule_hook(kind))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none, device):
    check_zero_grad(SPEC, HP, set_to_none, device=device, ref_kind="torch")


@pytest.mark.parametrize("executor", ["apex_C", "torch"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_within_one_ulp(dtype, executor, device, monkeypatch):
    use_executor(monkeypatch, executor, device)
    opt = check_low_precision(SPEC, HP, dtype, device=device, seed=22, skip=lambda step, k: k == 0 and step == 3)
    assert opt.last_executor == executor


def test_grad_scale_folded(device):
    check_grad_scale_folded(SPEC, HP, device=device)


def test_invalid_hyperparameters(device):
    bad = [
        (dict(lr=-1.0), "learning rate"),
        (dict(rho=1.5), "rho"),
        (dict(rho=-0.1), "rho"),
        (dict(eps=-1e-6), "epsilon"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(lr=float("nan")), "learning rate"),
    ]
    check_invalid(SPEC, bad, device=device)


def test_torch_only_options_rejected():
    """A torch state_dict asking for behaviour we do not implement fails, leaving the optimizer as it was."""
    p = torch.nn.Parameter(torch.randn(3))
    sd = torch.optim.Adadelta([p], maximize=True).state_dict()
    opt = NpuFusedAdadelta([p])
    with pytest.raises(ValueError, match="maximize"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["maximize"] is False


def test_state_dict_matches_torch(device):
    check_torch_state_dict(SPEC, HP, device=device)


@pytest.mark.parametrize("executor", ["apex_C", "torch"])
def test_resume_is_bitwise(executor, device, monkeypatch):
    use_executor(monkeypatch, executor, device)
    check_resume_bitwise(SPEC, HP, device=device, executor=executor)
