"""NpuFusedRMSprop = torch.optim.RMSprop (momentum, centered) on combined buffers."""

import random

import pytest
import torch
from _optim_harness import Spec, Suite, invalid_values, run_side_by_side

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
        # clamped at 0 as ours (rounded low-precision states can make it slightly negative)
        var = (var - (new if new is not None else out)["grad_avg"] ** 2).clamp(min=0)
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


SUITE = Suite(
    SPEC, "torch", FULL, random_seed=300,
    groups=dict(layout=[(3, VARIANTS["centered"]), (2, VARIANTS["momentum"]), (2, VARIANTS["plain"])], seed=13,
                frozen=(4,), skip=lambda step, k: (k == 1 and step % 3 == 2) or (k == 6 and step < 4)),
    changes=(FULL, {9: dict(alpha=0.5, weight_decay=0.1, eps=1e-3, momentum=0.3)}),
    low=dict(seed=23, skip=lambda step, k: k == 2 and step == 4),
    low_variants={name: VARIANTS[name] for name in sorted(VARIANTS)},
    state_dict_variants={name: VARIANTS[name] for name in ("plain", "both")},
    # the same checks and values as rmsprop_tf's (both name the options torch's way)
    invalid=invalid_values(lr=-0.01, eps=-1.0, momentum=-0.9, weight_decay=-0.1, alpha=-0.5),
)
globals().update(SUITE.tests())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_state_layout_matches_torch(variant, device):
    """Only the states an option needs exist (momentum_buffer, grad_avg), each bound to its kernel slot."""
    run_side_by_side(SPEC, [(3, VARIANTS[variant])], device=device, seed=5, ref_kind="torch", steps=10)


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
