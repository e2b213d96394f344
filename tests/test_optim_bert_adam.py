"""NpuFusedBertAdam against a float64 reference written from BertAdam's formulas (all four schedules)."""

import copy
import logging
import math
import random

import pytest
import torch
from _optim_harness import Spec, Suite, invalid_values, run_side_by_side, use_executor

from apex.optimizers import NpuFusedBertAdam
from apex.optimizers.bert_adam import SCHEDULES

SCHEDULE_NAMES = ["warmup_linear", "warmup_constant", "warmup_cosine", "warmup_poly"]


def schedule(name: str, x: float, warmup: float) -> float:
    """lr multiplier at progress x: linear warmup to 1 at x = warmup, then the named decay (0 past the end)."""
    w = 0.0 if warmup == -1 else warmup
    if x < w:
        return x / w
    if name == "warmup_constant":
        return 1.0
    if name == "warmup_linear":  # the line through (w, 1) and (1, 0)
        return max(0.0, (1.0 - x) / (1.0 - w))
    if name == "warmup_cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(x, 1.0)))
    return max(0.0, 1.0 - x) ** 0.5  # warmup_poly, degree 0.5


def ref_bert_adam(p, g, st, t, hp, new):
    """float64 BertAdam: per-param clipping to max_grad_norm, no bias correction, decay in the update."""
    if hp["max_grad_norm"] > 0:
        g = g * min(hp["max_grad_norm"] / (float(g.norm()) + 1e-6), 1.0)
    b1, b2, z = hp["b1"], hp["b2"], torch.zeros_like(p)
    out = {
        "exp_avg": b1 * st.get("exp_avg", z) + (1 - b1) * g,
        "exp_avg_sq": b2 * st.get("exp_avg_sq", z) + (1 - b2) * g * g,
    }
    used = new if new is not None else out
    update = used["exp_avg"] / (torch.sqrt(used["exp_avg_sq"]) + hp["e"]) + hp["weight_decay"] * p
    lr = hp["lr"]
    if hp["t_total"] != -1:
        lr = lr * schedule(hp["schedule"], t / hp["t_total"], hp["warmup"])
    out["param"] = p - lr * update
    return out


def draw(rng: random.Random) -> dict:
    return dict(lr=rng.uniform(1e-3, 5e-2), schedule=rng.choice(SCHEDULE_NAMES),
                warmup=rng.choice([-1, rng.uniform(0.05, 0.5)]), t_total=rng.choice([-1, rng.randint(10, 40)]),
                b1=rng.uniform(0.8, 0.95), b2=rng.uniform(0.9, 0.9999), e=10 ** rng.uniform(-8, -5),
                weight_decay=rng.choice([0.0, rng.uniform(0.0, 0.05)]),
                max_grad_norm=rng.choice([-1, rng.uniform(0.5, 4.0)]))


SPEC = Spec(ours=NpuFusedBertAdam, ref=ref_bert_adam, draw=draw, base=dict(lr=0.01))
HP = dict(lr=0.02, warmup=0.2, t_total=20, schedule="warmup_cosine", weight_decay=0.01, max_grad_norm=2.0)


def grad_sizes(k: int) -> float:
    """Grad scale per param index: some params' norms exceed max_grad_norm, some do not."""
    return (0.05, 3.0, 0.5, 10.0, 1.0, 0.2)[k % 6]


SUITE = Suite(
    SPEC, "f64", HP, random_seed=500, gscale=grad_sizes,
    groups=dict(layout=[(3, HP), (3, dict(lr=0.005, schedule="warmup_linear", warmup=0.1, t_total=15, b1=0.8,
                                          b2=0.99, e=1e-8, weight_decay=0.0, max_grad_norm=-1))],
                seed=15, frozen=(0,), skip=lambda step, k: k == 4 and step % 2 == 0),
    changes=(HP, {10: dict(max_grad_norm=0.5, schedule="warmup_poly", b1=0.7, t_total=40)}),
    # (the LR scheduler test: a torch scheduler scales the group lr, the built-in schedule applies on top)
    low_hp=dict(HP, t_total=12), low=dict(seed=25, gscale=2.0, skip=lambda step, k: k == 0 and step in (1, 2)),
    zero_grad_hp=dict(HP, max_grad_norm=0.05),
    # amp's unscale folded into the step: the clip norm is the unscaled grad's
    grad_scale_hp=dict(HP, max_grad_norm=0.5),
    resume_hp=dict(HP, t_total=6, warmup=0.3),
    invalid=invalid_values(lr=-0.1, schedule="warmup_exp", warmup=[1.0, -0.5], t_total=0, b1=1.0, b2=-0.1, e=-1e-6,
                           weight_decay=-0.01, max_grad_norm=float("nan")),
)
globals().update(SUITE.tests())


@pytest.mark.parametrize("executor", ["apex_C", "torch"])
@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_schedules_with_uneven_step_counts(name, executor, device, monkeypatch):
    """Each schedule through warmup, decay and past t_total; skipped params have their own step counts."""
    use_executor(monkeypatch, executor, device)
    hp = dict(HP, schedule=name)
    ours, params, *_ = run_side_by_side(SPEC, [(5, hp)], device=device, seed=7, ref_kind="f64", steps=26,
                                        gscale=grad_sizes, skip=lambda step, k: (k == 1 and step % 3 == 0)
                                        or (k == 3 and step < 7))
    assert [int(ours.state[p]["step"]) for p in params] == [26, 17, 26, 19, 26]
    assert ours.last_executor == executor


def test_schedule_functions():
    """Values from the formulas; warmup=-1 means no warmup; past the end the decays stay at 0."""
    lin, const, cos, poly = (SCHEDULES[n] for n in SCHEDULE_NAMES)
    assert lin(0.05, 0.1) == pytest.approx(0.5) and const(0.05, 0.1) == pytest.approx(0.5)
    assert lin(0.55, 0.1) == pytest.approx(0.5) and lin(1.5, 0.1) == 0.0
    assert const(0.7, 0.1) == 1.0 and const(3.0, 0.1) == 1.0
    assert cos(0.5, 0.0) == pytest.approx(0.5) and cos(1.0, 0.0) == pytest.approx(0.0) and cos(1.7, 0.0) == 0.0
    assert poly(0.75, 0.0) == pytest.approx(0.5) and poly(1.2, 0.0) == 0.0
    for name in SCHEDULE_NAMES:
        for x in (0.0, 0.01, 0.3, 0.99, 1.0, 1.4):
            for w in (0.0, 0.1, 0.5):
                assert SCHEDULES[name](x, w) == pytest.approx(schedule(name, x, w), abs=1e-15), (name, x, w)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_warmup_minus_one_is_no_warmup(name, device):
    """warmup=-1 with t_total set: the schedule at warmup 0 (the original's cosine crashed on a float)."""
    p = torch.nn.Parameter(torch.ones(3, device=device))
    opt = NpuFusedBertAdam([p], lr=0.1, t_total=4, schedule=name, warmup=-1, b2=0.999, weight_decay=0.0,
                           max_grad_norm=-1)
    deltas = []
    for _ in range(5):
        before = p.detach().clone()
        p.grad = torch.ones_like(p)
        opt.step()
        deltas.append(float((before - p.detach())[0]))
    u = 1.0 / (1.0 + 1e-6)  # m / (sqrt(v) + e) with g = 1 and no bias correction: the same every step
    for t, d in enumerate(deltas):
        factor = (1 - 0.9 ** (t + 1)) / (math.sqrt(1 - 0.999 ** (t + 1)) + 1e-6) / u
        assert d == pytest.approx(0.1 * schedule(name, t / 4, 0.0) * factor * u, rel=1e-5, abs=1e-9), t


def test_clipping_uses_max_grad_norm_per_param_and_leaves_grads(device):
    """Each param's grad is scaled to norm max_grad_norm when larger (not to 1, as the patch did)."""
    big = torch.nn.Parameter(torch.zeros(4, device=device))
    small = torch.nn.Parameter(torch.zeros(4, device=device))
    opt = NpuFusedBertAdam([big, small], lr=0.1, weight_decay=0.0, max_grad_norm=2.5, b1=0.5)
    big.grad = torch.tensor([6.0, 8.0, 0.0, 0.0], device=device)  # norm 10
    small.grad = torch.tensor([0.3, 0.4, 0.0, 0.0], device=device)  # norm 0.5 < 2.5: untouched
    grads = [big.grad.clone(), small.grad.clone()]
    opt.step()
    coef = 2.5 / (10.0 + 1e-6)
    torch.testing.assert_close(opt.state[big]["exp_avg"], 0.5 * coef * grads[0])
    torch.testing.assert_close(opt.state[small]["exp_avg"], 0.5 * grads[1])
    assert torch.equal(big.grad, grads[0]) and torch.equal(small.grad, grads[1])
    opt2 = NpuFusedBertAdam([big], lr=0.1, max_grad_norm=-1, b1=0.5)
    opt2.step()
    torch.testing.assert_close(opt2.state[big]["exp_avg"], 0.5 * grads[0])


def test_step_count_is_checkpointed(device):
    """The schedule resumes where it stopped: 'step' is saved (the patch lost it)."""
    p = torch.nn.Parameter(torch.randn(5, device=device))
    opt = NpuFusedBertAdam([p], lr=0.05, warmup=0.25, t_total=12)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert float(sd["state"][0]["step"]) == 3.0
    assert list(sd["state"][0]) == ["step", "exp_avg", "exp_avg_sq"]
    assert {k for k in sd["param_groups"][0] if k != "params"} == {
        "lr", "schedule", "warmup", "t_total", "b1", "b2", "e", "weight_decay", "max_grad_norm"}


def test_past_t_total_logs_once(device, caplog):
    p = torch.nn.Parameter(torch.randn(3, device=device))
    opt = NpuFusedBertAdam([p], lr=0.1, t_total=2)
    with caplog.at_level(logging.WARNING, logger="apex.optimizers"):
        for _ in range(5):
            p.grad = torch.randn_like(p)
            opt.step()
    assert sum("past t_total" in r.getMessage() for r in caplog.records) == 1


def test_defaults_are_the_npu_patch_signature():
    """b2=0.99 and no clipping by default, as the patch's code (not its docstring, which lists BertAdam's)."""
    p = torch.nn.Parameter(torch.zeros(4))
    group = NpuFusedBertAdam([p], lr=0.1).param_groups[0]
    assert {k: group[k] for k in ("warmup", "t_total", "schedule", "b1", "b2", "e", "weight_decay",
                                  "max_grad_norm")} == dict(warmup=-1, t_total=-1, schedule="warmup_linear", b1=0.9,
                                                            b2=0.99, e=1e-6, weight_decay=0.01, max_grad_norm=-1)
    g = torch.full((4,), 100.0)  # norm 200: the default does not clip it
    p.grad = g.clone()
    opt = NpuFusedBertAdam([p], lr=0.1, weight_decay=0.0)
    opt.step()
    torch.testing.assert_close(opt.state[p]["exp_avg"], 0.1 * g)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], 0.01 * g * g)


def test_lr_is_required():
    with pytest.raises(ValueError, match="lr"):
        NpuFusedBertAdam([torch.nn.Parameter(torch.zeros(2))])
