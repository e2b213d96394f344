"""NpuFusedRMSpropTF (TensorFlow/timm RMSprop) against a float64 reference written from the formulas."""

import random

import pytest
import torch
from _optim_harness import Spec, Suite, invalid_values, run_side_by_side

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
        var = (var - (new if new is not None else out)["grad_avg"] ** 2).clamp(min=0)  # variance >= 0, as the kernel
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


SUITE = Suite(
    SPEC, "f64", FULL, random_seed=400,
    groups=dict(layout=[(3, VARIANTS["all"]), (3, VARIANTS["momentum-lr-out"])], seed=14, frozen=(5,),
                skip=lambda step, k: (k == 2 and step % 3 == 0) or (k == 3 and step < 6)),
    # scalars and the options that change the state layout (momentum, centered) switched mid-run
    changes=(dict(lr=0.01), {8: dict(alpha=0.6, momentum=0.5, lr_in_momentum=False),
                             16: dict(centered=True, decoupled_decay=True, weight_decay=0.05)}),
    low=dict(seed=24, skip=lambda step, k: k == 1 and step == 5),
    low_variants={name: VARIANTS[name] for name in ("plain", "momentum-lr-in", "all")},
    invalid=invalid_values(lr=-0.01, eps=-1.0, momentum=-0.9, weight_decay=-0.1, alpha=-0.5),
    resume_hp=dict(FULL, decoupled_decay=True),
)
globals().update(SUITE.tests())


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
