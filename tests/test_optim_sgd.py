"""NpuFusedSGD = torch.optim.SGD (momentum, dampening, Nesterov, weight decay) on combined buffers."""

import random

import pytest
import torch
from _optim_harness import Spec, Suite, assert_nonfinite_alike, invalid_values, step_twins, use_executor

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


SUITE = Suite(
    SPEC, "torch", MOMENTUM, random_seed=100,
    # each executor: the C++ kernel, torch's fused SGD on flat slices, plain torch ops
    executors=("apex_C", "torch", "torch_ops"), random_skip=lambda step, k: k == 2 and step % 4 == 1,
    groups=dict(layout=[(3, dict(lr=0.1, momentum=0.9, nesterov=True)),
                        (3, dict(lr=0.03, momentum=0.5, dampening=0.3, weight_decay=0.05))],
                seed=11, frozen=(1,), skip=lambda step, k: (k == 4 and step % 3 == 0) or (k == 0 and step < 5)),
    # momentum switched on mid-run (torch starts the buffer from the grad), then nesterov and lr changed
    changes=(dict(lr=0.1), {7: dict(momentum=0.8), 15: dict(nesterov=True, lr=0.02, weight_decay=0.1)}),
    low=dict(seed=21, skip=lambda step, k: k == 1 and step == 2),
    low_variants={"momentum": MOMENTUM, "nesterov": dict(lr=0.1, momentum=0.9, nesterov=True),
                  "plain": dict(lr=0.1, weight_decay=0.1)},
    state_dict_variants={"momentum": MOMENTUM, "no-momentum": dict(lr=0.1)},
    invalid=[*invalid_values(lr=-0.1, momentum=-0.5, weight_decay=-1e-3),
             (dict(nesterov=True, momentum=0.0), "Nesterov"),
             (dict(nesterov=True, momentum=0.9, dampening=0.1), "Nesterov")],
    resume_hp=dict(MOMENTUM, nesterov=False),
)
globals().update(SUITE.tests())


def test_lr_is_required():
    with pytest.raises(ValueError, match="lr"):
        NpuFusedSGD([torch.nn.Parameter(torch.zeros(2))])
    opt = NpuFusedSGD([{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.1}])
    assert opt.param_groups[0]["lr"] == 0.1


def test_no_state_without_momentum(device):
    p = torch.nn.Parameter(torch.randn(4, device=device))
    opt = NpuFusedSGD([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state_dict()["state"] == {}


@pytest.mark.parametrize("executor", ["apex_C", "torch", "torch_ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hp", [dict(momentum=0.9), dict(momentum=0.9, nesterov=True), dict(momentum=0.0)])
def test_nonfinite_params_as_torch(monkeypatch, device, executor, dtype, hp):
    """weight_decay=0 adds no decay term: an inf param stays inf, as in torch, instead of 0 * inf = NaN. Every
    executor puts inf and NaN where torch.optim.SGD does; fp32 values are torch's bitwise (the sign of a zero
    aside), 16-bit ones within one rounding per step (torch rounds each of its ops, we round once)."""
    expect = use_executor(monkeypatch, executor, device)
    values = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1.5, -2.0, 3.0])
    grads = torch.tensor([1.0, 1.0, 1.0, -0.0, -0.0, 0.5, -0.0, float("inf")])
    ours, ours_p, ref, ref_p = step_twins(lambda ps: NpuFusedSGD(ps, lr=0.1, weight_decay=0.0, **hp),
                                          lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.0, foreach=False,
                                                                     **hp),
                                          values, grads, device, dtype)
    assert ours.last_executor == expect
    pairs = [(ours_p.detach(), ref_p.detach())]
    if hp["momentum"]:
        pairs.append((ours.state[ours_p]["momentum_buffer"], ref.state[ref_p]["momentum_buffer"]))
    for a, b in pairs:
        a, b = assert_nonfinite_alike(a, b, "SGD")
        if dtype == torch.float32:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=3 * torch.finfo(dtype).eps, atol=0)
