"""NpuFusedAdadelta = torch.optim.Adadelta on combined buffers."""

import random

import pytest
import torch
from _optim_harness import Spec, Suite, invalid_values

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
SUITE = Suite(
    SPEC, "torch", HP, random_seed=200,
    groups=dict(layout=[(3, dict(lr=1.0, rho=0.9)), (3, dict(lr=0.3, rho=0.6, eps=1e-5, weight_decay=0.05))],
                seed=12, frozen=(2,), skip=lambda step, k: (k == 3 and step % 4 == 1) or (k == 0 and step < 3)),
    changes=(HP, {10: dict(rho=0.5, weight_decay=0.1, eps=1e-4)}),
    low=dict(seed=22, skip=lambda step, k: k == 0 and step == 3),
    invalid=invalid_values(lr=[-1.0, float("nan")], rho=[1.5, -0.1], eps=-1e-6, weight_decay=-0.1),
)
globals().update(SUITE.tests())


def test_torch_only_options_rejected():
    """A torch state_dict asking for behaviour we do not implement fails, leaving the optimizer as it was."""
    p = torch.nn.Parameter(torch.randn(3))
    sd = torch.optim.Adadelta([p], maximize=True).state_dict()
    opt = NpuFusedAdadelta([p])
    with pytest.raises(ValueError, match="maximize"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["maximize"] is False
