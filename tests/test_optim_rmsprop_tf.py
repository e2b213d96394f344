"""NpuFusedRMSpropTF (TensorFlow/timm RMSprop) against a float64 reference written from the formulas."""

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
    check_zero_grad,
    expected_executor,
    lr_schedule_hook,
    run_side_by_side,
    use_executor,
)

from apex.optimizers import NpuFusedRMSpropTF


def ref_rmsprop_tf(p, g, st, t, hp, new):
    """float64 TF RMSprop: v += (1-alpha)(g^2 - v) from v = 1, eps inside the root, lr in momentum.

    Decoupled decay shrinks the param by weight_decay * p before the update (the NPU patch's rule).
    """
    a, wd, lr = hp["alpha"], hp["weight_decay"], hp["lr"]
    z = torch.zeros_like(p)
    if wd and hp["decoupled_decay"]:
        p = p - wd * p
    elif wd:
        g = g + wd * p
    sq0 = st.get("square_avg", torch.ones_like(p))
    out = {"square_avg": sq0 + (1 - a) * (g * g - sq0)}
    used = new if new is not None else out
    var = used["square_avg"]
    if hp["centered"]:
        ga0 = st.get("grad_avg", z)
        out["grad_avg"] = ga0 + (1 - a) * (g - ga0)
        var = var - (new if new is not None else out)["grad_avg"] ** 2
    rms = torch.sqrt(var + hp["eps"])
    if hp["momentum"] > 0:
        scale = lr if hp["lr_in_momentum"] else 1.0
        out["momentum_buffer"] = hp["momentum"] * st.get("momentum_buffer", z) + scale * g / rms
        buf = (new if new is not None else out)["momentum_buffer"]
        out["param"] = p - buf if hp["lr_in_momentum"] else p - lr * buf
    else:
        out["param"] = p - lr * g / rms
    return out


def draw(rng: random.Random) -> dict:
    return dict(lr=rng.uniform(1e-3, 1e-2), alpha=rng.uniform(0.8, 0.99), eps=10 ** rng.uniform(-10, -6),
                weight_decay=rng.choice([0.0, rng.uniform(0.0, 0.05)]),
                momentum=rng.choice([0.0, rng.uniform(0.5, 0.95)]), centered=rng.random() < 0.5,
                decoupled_decay=rng.random() < 0.5, lr_in_momentum=rng.random() < 0.5)


SPEC = Spec(ours=NpuFusedRMSpropTF, ref=ref_rmsprop_tf, draw=draw, state_fill={"square_avg": 1.0})
FULL = dict(lr=0.01, alpha=0.9, eps=1e-8, weight_decay=0.01, momentum=0.9, centered=True)
VARIANTS = {
    "plain": dict(lr=0.01),
    "momentum-lr-in": dict(lr=0.01, momentum=0.9, weight_decay=0.02),
    "momentum-lr-out": dict(lr=0.01, momentum=0.9, lr_in_momentum=False),
    "centered-decoupled": dict(lr=0.01, centered=True, weight_decay=0.01, decoupled_decay=True),
    "all": dict(FULL, decoupled_decay=True),
}


@pytest.mark.parametrize("executor", ["apex_C", "torch"])
@pytest.mark.parametrize("seed", range(4))
def test_matches_reference_random_hyperparameters(seed, executor, device, monkeypatch):
    use_executor(monkeypatch, executor, device)
    hp = draw(random.Random(400 + seed))
    ours, *_ = run_side_by_side(SPEC, [(4, hp)], device=device, seed=seed, ref_kind="f64")
    assert ours.last_executor == executor


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants(variant, device):
    ours, params, *_ = run_side_by_side(SPEC, [(3, VARIANTS[variant])], device=device, seed=6, ref_kind="f64",
                                        steps=10)
    hp = VARIANTS[variant]
    expected = ["step", "square_avg"] + ["momentum_buffer"] * (hp.get("momentum", 0) > 0)
    expected += ["grad_avg"] * bool(hp.get("centered"))
    assert all(list(ours.state[p]) == expected for p in params)


def test_square_avg_starts_at_ones(device):
    """TF/timm initialisation (documented choice; the NPU patch used zeros): v1 = 1 + (1-alpha)(g^2 - 1)."""
    p = torch.nn.Parameter(torch.randn(7, device=device))
    p0 = p.detach().clone()
    g = torch.randn(7, device=device)
    opt = NpuFusedRMSpropTF([p], lr=0.01, alpha=0.9, eps=1e-10)
    p.grad = g.clone()
    opt.step()
    v1 = 1 + 0.1 * (g * g - 1)
    torch.testing.assert_close(opt.state[p]["square_avg"], v1)
    torch.testing.assert_close(p.detach(), p0 - 0.01 * g / torch.sqrt(v1 + 1e-10))
    # with zeros the first update would be about lr / sqrt(1 - alpha) per element, whatever |g|
    assert (p.detach() - p0).abs().max() < 0.01 * g.abs().max() / 0.9**0.5


def test_decoupled_decay_is_lr_free(device):
    """decoupled_decay: p -= weight_decay * p (the patch's rule), the grad is not decayed."""
    p = torch.nn.Parameter(torch.full((4,), 2.0, device=device))
    opt = NpuFusedRMSpropTF([p], lr=0.0, weight_decay=0.1, decoupled_decay=True)
    p.grad = torch.ones_like(p)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.full((4,), 1.8, device=device))
    torch.testing.assert_close(opt.state[p]["square_avg"], torch.ones(4, device=device))  # 1 + 0.1 (1 - 1)


def test_param_groups_frozen_and_skipped_params(device):
    layout = [(3, VARIANTS["all"]), (3, VARIANTS["momentum-lr-out"])]
    ours, *_ = run_side_by_side(SPEC, layout, device=device, seed=14, ref_kind="f64", frozen=(5,),
                                skip=lambda step, k: (k == 2 and step % 3 == 0) or (k == 3 and step < 6))
    assert ours.last_executor == expected_executor(device)


def test_hyperparameter_changes_take_effect(device):
    """Scalars and the options that change the state layout (momentum, centered) switched mid-run."""

    def between(step, ours, ref):
        for opt in (ours, ref):
            g = opt.param_groups[0]
            if step == 8:
                g.update(alpha=0.6, momentum=0.5, lr_in_momentum=False)
            if step == 16:
                g.update(centered=True, decoupled_decay=True, weight_decay=0.05)

    run_side_by_side(SPEC, [(4, dict(lr=0.01))], device=device, seed=3, ref_kind="f64", between=between)


@pytest.mark.parametrize("kind", ["step", "lambda"])
def test_lr_scheduler(kind, device):
    run_side_by_side(SPEC, [(3, FULL)], device=device, seed=4, ref_kind="f64", steps=12,
                     between=lr_schedule_hook(kind))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none, device):
    check_zero_grad(SPEC, FULL, set_to_none, device=device, ref_kind="f64")


@pytest.mark.parametrize("executor", ["apex_C", "torch"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("variant", ["plain", "momentum-lr-in", "all"])
def test_low_precision_within_one_ulp(variant, dtype, executor, device, monkeypatch):
    use_executor(monkeypatch, executor, device)
    opt = check_low_precision(SPEC, VARIANTS[variant], dtype, device=device, seed=24,
                              skip=lambda step, k: k == 1 and step == 5)
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


@pytest.mark.parametrize("executor", ["apex_C", "torch"])
def test_resume_is_bitwise(executor, device, monkeypatch):
    use_executor(monkeypatch, executor, device)
    check_resume_bitwise(SPEC, dict(FULL, decoupled_decay=True), device=device, executor=executor)
