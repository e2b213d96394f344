"""NVIDIA Apex's optimizer API (FusedAdam, FusedSGD, FusedAdagrad, FusedLAMB, FusedNovoGrad,
FusedMixedPrecisionLamb) on our combined-buffer executors.

References: torch.optim.Adam / AdamW / SGD / Adagrad where torch has the same math; float64
implementations written here from the published formulas (NVIDIA's documented semantics,
see docs/upstream-compat.md) for LAMB and NovoGrad. fp32 params: 30 steps, every param and
state within assert_close(rtol=1e-5, atol=1e-6 * max|p0|). Each case runs on the C++ kernel
(``executor="auto"`` on CPU) and on the torch executor (what other devices use).

The HF transformers Trainer runs (optim="adamw_apex_fused", half_precision_backend="apex")
are in the full tier.
"""

from __future__ import annotations

import copy
import math
import random
import warnings
from typing import Dict, List, Optional, Sequence

import pytest
import torch

from apex.multi_tensor_apply import multi_tensor_applier
from apex.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

STEPS = 30
RTOL = 1e-5
EXECUTORS = ("auto", "torch")


# ------------------------------------------------------------------ helpers
def expected_executor(executor: str, device: str) -> str:
    return "apex_C" if executor == "auto" and device == "cpu" else "torch"


def shapes_for(seed: int) -> List[tuple]:
    rng = random.Random(seed)
    return [tuple(rng.randint(1, 7) for _ in range(rng.choice([0, 1, 2, 3]))) for _ in range(rng.randint(3, 6))]


def make_params(shapes, device, dtype=torch.float32, seed=0) -> List[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype))
            for s in shapes]


def clone_params(params, dtype=None) -> List[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone().to(dtype or p.dtype)) for p in params]


def set_grad(p: torch.Tensor, g: Optional[torch.Tensor]) -> None:
    """Writes into the existing grad (keeps our combined views) or binds a new one; None drops it."""
    if g is None:
        p.grad = None
    elif p.grad is None:
        p.grad = g.clone()
    else:
        p.grad.copy_(g)


def draw_grads(params, gen: torch.Generator, scale: float = 1.0,
               drop: Sequence[int] = ()) -> List[Optional[torch.Tensor]]:
    out = []
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale
        out.append(None if i in drop else g.to(device=p.device, dtype=p.dtype))
    return out


def assert_params_close(ours, ref, atol_scale: float, what: str) -> None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a.detach().double().cpu(), b.detach().double().cpu(), rtol=RTOL,
                                   atol=1e-6 * atol_scale, msg=lambda m, i=i: f"{what} {i}: {m}")


def step_on(opt, params, gen: torch.Generator, **draw_kw) -> List[Optional[torch.Tensor]]:
    """One step on grads freshly drawn with draw_grads' options; returns them."""
    grads = draw_grads(params, gen, **draw_kw)
    for p, g in zip(params, grads):
        set_grad(p, g)
    opt.step()
    return grads


def check_resume_matches_twin(new_opt, params, grads_seq, split: int, check_saved) -> None:
    """`params` and a twin copy run grads_seq[:split]; the first's checkpoint (looked at by check_saved),
    loaded into a fresh optimizer on copies of its params, then runs the rest beside the twin: bit for bit
    the same (same executor)."""
    twin = clone_params(params)
    opt, opt_twin = new_opt(params), new_opt(twin)
    for grads in grads_seq[:split]:
        for p, q, g in zip(params, twin, grads):
            set_grad(p, g)
            set_grad(q, g)
        opt.step()
        opt_twin.step()
    saved = copy.deepcopy(opt.state_dict())
    check_saved(saved)
    resumed_params = clone_params(params)
    resumed = new_opt(resumed_params)
    resumed.load_state_dict(saved)
    for grads in grads_seq[split:]:
        for p, q, g in zip(resumed_params, twin, grads):
            set_grad(p, g)
            set_grad(q, g)
        resumed.step()
        opt_twin.step()
    assert all(torch.equal(a, b) for a, b in zip(resumed_params, twin))


def max_abs(params) -> float:
    return max(float(p.detach().abs().max()) if p.numel() else 0.0 for p in params) or 1.0


def run_vs_torch(ours_cls, ours_kw, torch_cls, torch_kw, device, executor, seed, groups=2, drop_at=None):
    """Both optimizers see identical fp32 grads for STEPS steps; params and states must agree."""
    shapes = shapes_for(seed)
    params = make_params(shapes, device, seed=seed)
    ref = clone_params(params)
    half = max(1, len(params) // groups)
    split = [(0, half), (half, len(params))]
    ours_groups = [{"params": params[a:b]} for a, b in split if b > a]
    ref_groups = [{"params": ref[a:b]} for a, b in split if b > a]
    if len(ours_groups) > 1:  # a second group with its own learning rate
        ours_groups[1]["lr"] = ref_groups[1]["lr"] = ours_kw.get("lr", 1e-3) * 0.5
    opt = ours_cls(ours_groups, **ours_kw)
    opt.executor = executor
    ref_opt = torch_cls(ref_groups, **torch_kw)
    atol = max_abs(params)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(STEPS):
        drop = (0,) if drop_at is not None and step in drop_at else ()
        grads = draw_grads(params, gen, drop=drop)
        for p, q, g in zip(params, ref, grads):
            set_grad(p, g)
            set_grad(q, None if g is None else g.clone())
        opt.step()
        ref_opt.step()
    assert opt.last_executor == expected_executor(executor, device)
    assert_params_close(params, ref, atol, "param")
    for p, q in zip(params, ref):
        for key, value in opt.state[p].items():
            if key in ref_opt.state[q] and isinstance(value, torch.Tensor) and key != "step":
                torch.testing.assert_close(value.double().cpu(), ref_opt.state[q][key].double().cpu(), rtol=RTOL,
                                           atol=1e-6 * max(1.0, float(ref_opt.state[q][key].abs().max())))
    return opt, params


# ------------------------------------------------------------------ FusedAdam
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_fused_adam_matches_torch(device, executor, adam_w_mode, seed):
    rng = random.Random(seed)
    hp = dict(lr=rng.choice([1e-3, 1e-2, 5e-2]), betas=(rng.uniform(0.8, 0.95), rng.uniform(0.9, 0.999)),
              eps=rng.choice([1e-8, 1e-6]), weight_decay=rng.choice([0.0, 0.01, 0.1]))
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    opt, _ = run_vs_torch(FusedAdam, dict(hp, adam_w_mode=adam_w_mode), torch_cls, hp, device, executor, seed)
    # NVIDIA's layout: one step per group, no per-param step
    assert [g["step"] for g in opt.param_groups] == [STEPS] * len(opt.param_groups)
    assert all(set(st) == {"exp_avg", "exp_avg_sq"} for st in opt.state.values())


def ref_adam64(p, g, m, v, *, lr, b1, b2, eps, wd, step, adam_w_mode, bias_correction):
    if wd and not adam_w_mode:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1 = 1 - b1**step if bias_correction else 1.0
    bc2 = 1 - b2**step if bias_correction else 1.0
    u = (m / bc1) / ((v / bc2).sqrt() + eps)
    if wd and adam_w_mode:
        u = u + wd * p
    return p - lr * u, m, v


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fused_adam_no_bias_correction_and_group_step(device, executor):
    """bias_correction=False, and NVIDIA's per-group step: a param without a grad is skipped while the
    group's count still advances, so its later bias correction uses the group's count."""
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    for bias_correction in (False, True):
        params = make_params(shapes_for(3), device, seed=3)
        ref = [p.detach().double().cpu() for p in params]
        ms = [torch.zeros_like(r) for r in ref]
        vs = [torch.zeros_like(r) for r in ref]
        opt = FusedAdam(params, bias_correction=bias_correction, **hp)
        opt.executor = executor
        gen = torch.Generator().manual_seed(4)
        for step in range(1, STEPS + 1):
            grads = step_on(opt, params, gen, drop=(0,) if step in (2, 3, 7) else ())
            for i, g in enumerate(grads):
                if g is None:
                    continue
                ref[i], ms[i], vs[i] = ref_adam64(ref[i], g.double().cpu(), ms[i], vs[i], lr=hp["lr"], b1=0.9,
                                                  b2=0.99, eps=1e-8, wd=0.05, step=step, adam_w_mode=True,
                                                  bias_correction=bias_correction)
        assert opt.param_groups[0]["step"] == STEPS
        assert opt.last_executor == expected_executor(executor, device)
        assert_params_close(params, ref, max_abs(ref), f"bias_correction={bias_correction}")


def test_fused_adam_errors_and_closure(device):
    params = make_params([(3,), (2, 2)], device)
    with pytest.raises(RuntimeError, match="FusedAdam does not support the AMSGrad variant"):
        FusedAdam(params, amsgrad=True)
    with pytest.raises(RuntimeError, match="Master weights is currently only supported with the capturable"):
        FusedAdam(params, master_weights=True)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        FusedAdam(params, lr=-1.0)
    opt = FusedAdam(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    for legacy in ("grads", "output_params", "scale", "grad_norms"):
        with pytest.raises(RuntimeError, match="FusedAdam has been updated"):
            opt.step(**{legacy: 1.0})
    # the rejected calls changed nothing
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert "step" not in opt.param_groups[0] and not opt.state

    def closure():
        opt.zero_grad()
        loss = sum((p.float() ** 2).sum() for p in params)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.grad_fn is not None  # the closure ran with grad enabled
    assert opt.param_groups[0]["step"] == 1
    assert not any(torch.equal(a, b) for a, b in zip(params, before))
    opt.step(grad_scaler=None)  # accepted, as NVIDIA's signature has it
    assert not opt._step_supports_amp_scaling and opt.param_groups_master == [{"params": [None, None]}]


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad])
def test_set_grad_none(device, cls):
    params = make_params([(4,), (2, 3)], device)
    opt = cls(params, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    grads = [p.grad for p in params]
    opt.zero_grad()  # default set_grad_none=True: NVIDIA's behaviour
    assert all(p.grad is None for p in params)
    opt = cls(params, lr=1e-2, set_grad_none=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    grads = [p.grad for p in params]
    opt.zero_grad()  # set_grad_none=False: zeroed in place, still the same (combined) tensors
    assert all(p.grad is g for p, g in zip(params, grads))
    assert all(float(p.grad.abs().sum()) == 0 for p in params)
    opt.zero_grad(set_to_none=True)  # an explicit argument wins
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("set_grad_none", [None, False, True])
def test_fused_sgd_takes_set_grad_none_and_zero_grad_sets_none(device, set_grad_none):
    """Upstream's FusedSGD signature has set_grad_none=False; its zero_grad() sets None either way on torch >= 2.0
    (False calls torch's zero_grad(), whose default is set_to_none=True)."""
    params = make_params([(4,), (2, 3)], device)
    kwargs = {} if set_grad_none is None else {"set_grad_none": set_grad_none}
    opt = FusedSGD(params, lr=1e-2, momentum=0.9, **kwargs)
    assert opt.set_grad_none is bool(set_grad_none)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    grads = [p.grad for p in params]
    opt.zero_grad(set_to_none=False)  # an explicit argument: zeroed in place
    assert all(p.grad is g and float(g.abs().sum()) == 0 for p, g in zip(params, grads))


def test_set_grad_none_false_low_precision_params(device):
    """FusedAdam's fp16/bf16 params run through fp32 shadows: zero_grad must zero the params' own grads."""
    params = make_params([(4,), (2, 3)], device, dtype=torch.bfloat16)
    opt = FusedAdam(params, lr=1e-2, set_grad_none=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    grads = [p.grad for p in params]
    opt.zero_grad()
    assert all(p.grad is g and float(g.abs().sum()) == 0 for p, g in zip(params, grads))
    opt.step()  # zero grads: a normal update (only the decoupled decay, here 0, and the moments' decay)
    assert opt.param_groups[0]["step"] == 2


def test_fused_adam_state_dict_resume_and_torch_checkpoint(device):
    hp = dict(lr=1e-2, weight_decay=0.01)
    params = make_params(shapes_for(5), device, seed=5)
    gen = torch.Generator().manual_seed(6)
    grads_seq = [draw_grads(params, gen) for _ in range(8)]

    def check_saved(saved):
        assert saved["param_groups"][0]["step"] == 4 and set(saved["state"][0]) == {"exp_avg", "exp_avg_sq"}

    check_resume_matches_twin(lambda ps: FusedAdam(ps, **hp), params, grads_seq, 4, check_saved)

    # a torch.optim.AdamW checkpoint (per-param steps) continues as torch would
    tp = make_params(shapes_for(7), device, seed=7)
    torch_opt = torch.optim.AdamW(tp, **hp)
    ours_p = clone_params(tp)
    for _ in range(3):
        for p in tp:
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        torch_opt.step()
    ours = FusedAdam(ours_p, **hp)
    ours_p_data = [p.detach().clone() for p in tp]
    for p, d in zip(ours_p, ours_p_data):
        p.data.copy_(d)
    ours.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # as if saved and loaded: no shared tensors
    assert ours.param_groups[0]["step"] == 3 and "step" not in ours.state[ours_p[0]]
    for _ in range(3):
        for p, q in zip(tp, ours_p):
            g = torch.randn(p.shape, generator=gen).to(device)
            p.grad, q.grad = g.clone(), g.clone()
        torch_opt.step()
        ours.step()
    assert_params_close(ours_p, tp, max_abs(tp), "after torch checkpoint")


# ------------------------------------------------------------------ FusedSGD
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_sgd_matches_torch(device, executor, seed):
    rng = random.Random(seed)
    nesterov = seed == 1
    hp = dict(lr=rng.choice([1e-2, 5e-2]), momentum=rng.choice([0.0, 0.9]) if not nesterov else 0.9,
              dampening=0.0 if nesterov else rng.choice([0.0, 0.3]), weight_decay=rng.choice([0.0, 1e-2]),
              nesterov=nesterov)
    run_vs_torch(FusedSGD, hp, torch.optim.SGD, hp, device, executor, seed, drop_at={3, 4})


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("nesterov", [False, True])
def test_fused_sgd_wd_after_momentum(device, executor, nesterov):
    lr, mom, damp, wd = 0.05, 0.9, 0.0, 0.1
    params = make_params(shapes_for(8), device, seed=8)
    ref = [p.detach().double().cpu() for p in params]
    bufs: List[Optional[torch.Tensor]] = [None] * len(ref)
    opt = FusedSGD(params, lr=lr, momentum=mom, dampening=damp, weight_decay=wd, nesterov=nesterov,
                   wd_after_momentum=True, materialize_master_grads=False)
    opt.executor = executor
    assert opt.wd_after_momentum and not opt.materialize_master_grads
    gen = torch.Generator().manual_seed(9)
    for step in range(STEPS):
        grads = step_on(opt, params, gen, drop=(1,) if step == 5 else ())
        for i, g in enumerate(grads):
            if g is None:
                continue
            g = g.double().cpu()
            bufs[i] = g.clone() if bufs[i] is None else mom * bufs[i] + (1 - damp) * g
            d = g + mom * bufs[i] if nesterov else bufs[i]
            ref[i] = ref[i] - lr * (d + wd * ref[i])
    assert opt.last_executor == expected_executor(executor, device)
    assert_params_close(params, ref, max_abs(ref), "wd_after_momentum")


# ------------------------------------------------------------------ FusedAdagrad
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_fused_adagrad_matches_torch(device, executor, weight_decay):
    hp = dict(lr=5e-2, eps=1e-10, weight_decay=weight_decay)
    opt, _ = run_vs_torch(FusedAdagrad, hp, torch.optim.Adagrad, hp, device, executor, seed=10)
    assert all(set(st) == {"sum"} for st in opt.state.values())


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fused_adagrad_w_mode(device, executor):
    lr, eps, wd = 5e-2, 1e-10, 0.1
    params = make_params(shapes_for(11), device, seed=11)
    ref = [p.detach().double().cpu() for p in params]
    h = [torch.zeros_like(r) for r in ref]
    opt = FusedAdagrad(params, lr=lr, eps=eps, weight_decay=wd, adagrad_w_mode=True)
    opt.executor = executor
    gen = torch.Generator().manual_seed(12)
    for _ in range(STEPS):
        grads = step_on(opt, params, gen)
        for i, g in enumerate(grads):
            g = g.double().cpu()
            h[i] = h[i] + g * g
            ref[i] = ref[i] - lr * (g / (h[i].sqrt() + eps) + wd * ref[i])
    assert opt.last_executor == expected_executor(executor, device)
    assert_params_close(params, ref, max_abs(ref), "adagrad_w_mode")


# ------------------------------------------------------------------ FusedLAMB
class RefLamb:
    """float64 LAMB as NVIDIA's FusedLAMB defines it (global clip, beta3, per-group step, trust ratio)."""

    def __init__(self, groups: List[dict], *, max_grad_norm, adam_w_mode, use_nvlamb):
        self.groups = groups  # each: params (float64 list), hyperparameters
        self.max_grad_norm, self.adam_w_mode, self.use_nvlamb = max_grad_norm, adam_w_mode, use_nvlamb
        for g in groups:
            g["m"] = [torch.zeros_like(p) for p in g["params"]]
            g["v"] = [torch.zeros_like(p) for p in g["params"]]
            g["step"] = 0

    def step(self, grads: List[List[Optional[torch.Tensor]]], unscale: float = 1.0):
        flat = [g * unscale for gs in grads for g in gs if g is not None]
        norm = math.sqrt(sum(float((g * g).sum()) for g in flat))
        clip = norm / self.max_grad_norm if self.max_grad_norm is not None and norm > self.max_grad_norm else 1.0
        for group, gs in zip(self.groups, grads):
            group["step"] += 1
            t = group["step"]
            b1, b2 = group["betas"]
            b3 = 1 - b1 if group["grad_averaging"] else 1.0
            bc1 = 1 - b1**t if group["bias_correction"] else 1.0
            bc2 = 1 - b2**t if group["bias_correction"] else 1.0
            wd = group["weight_decay"]
            for i, g in enumerate(gs):
                if g is None:
                    continue
                p = group["params"][i]
                g = g * unscale / clip
                if wd and not self.adam_w_mode:
                    g = g + wd * p
                m = group["m"][i] = b1 * group["m"][i] + b3 * g
                v = group["v"][i] = b2 * group["v"][i] + (1 - b2) * g * g
                u = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
                if wd and self.adam_w_mode:
                    u = u + wd * p
                ratio = 1.0
                if self.use_nvlamb or wd != 0:
                    pn, un = float(p.norm()), float(u.norm())
                    if pn != 0 and un != 0:
                        ratio = pn / un
                group["params"][i] = p - group["lr"] * ratio * u


LAMB_CASES = [
    dict(adam_w_mode=True, use_nvlamb=False, weight_decay=0.01, grad_averaging=True, bias_correction=True,
         grad_scale=1.0),
    dict(adam_w_mode=False, use_nvlamb=False, weight_decay=0.05, grad_averaging=False, bias_correction=True,
         grad_scale=3.0),
    dict(adam_w_mode=True, use_nvlamb=True, weight_decay=0.0, grad_averaging=True, bias_correction=False,
         grad_scale=0.3),
    dict(adam_w_mode=True, use_nvlamb=False, weight_decay=0.0, grad_averaging=True, bias_correction=True,
         grad_scale=1.0),  # no trust ratio at all
]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("case", range(len(LAMB_CASES)))
def test_fused_lamb_matches_reference(device, executor, case):
    c = LAMB_CASES[case]
    max_grad_norm = 2.0
    params = make_params(shapes_for(20 + case), device, seed=20 + case)
    half = len(params) // 2
    ours_groups = [{"params": params[:half]}, {"params": params[half:], "lr": 5e-3, "max_grad_norm": 1e9}]
    opt = FusedLAMB(ours_groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=c["weight_decay"],
                    adam_w_mode=c["adam_w_mode"], grad_averaging=c["grad_averaging"],
                    bias_correction=c["bias_correction"], max_grad_norm=max_grad_norm, use_nvlamb=c["use_nvlamb"])
    opt.executor = executor
    base = dict(betas=(0.9, 0.99), eps=1e-6, weight_decay=c["weight_decay"], grad_averaging=c["grad_averaging"],
                bias_correction=c["bias_correction"])
    ref = RefLamb([dict(base, params=[p.detach().double().cpu() for p in params[:half]], lr=1e-2),
                   dict(base, params=[p.detach().double().cpu() for p in params[half:]], lr=5e-3)],
                  max_grad_norm=max_grad_norm, adam_w_mode=c["adam_w_mode"], use_nvlamb=c["use_nvlamb"])
    gen = torch.Generator().manual_seed(30 + case)
    clipped = 0
    for step in range(STEPS):
        # alternate small and large grads: the global clip is active on some steps only
        grads = draw_grads(params, gen, scale=0.05 if step % 3 else 2.0, drop=(0,) if step == 4 else ())
        scaled = [None if g is None else g * c["grad_scale"] for g in grads]
        for p, g in zip(params, scaled):
            set_grad(p, g)
        # amp's folded unscale: the stored grads carry the loss scale; the norm must be the unscaled one
        opt.apex_grad_scale = None if c["grad_scale"] == 1.0 else 1.0 / c["grad_scale"]
        opt.step()
        opt.apex_grad_scale = None
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads if g is not None))
        clipped += norm > max_grad_norm
        ref.step([[None if g is None else g.double().cpu() for g in grads[:half]],
                  [None if g is None else g.double().cpu() for g in grads[half:]]])
    assert 0 < clipped < STEPS
    assert opt.last_executor == expected_executor(executor, device)
    assert [g["step"] for g in opt.param_groups] == [STEPS, STEPS]
    ref_params = ref.groups[0]["params"] + ref.groups[1]["params"]
    assert_params_close(params, ref_params, max_abs(ref_params), "lamb param")
    ref_m = ref.groups[0]["m"] + ref.groups[1]["m"]
    for i, p in enumerate(params):
        torch.testing.assert_close(opt.state[p]["exp_avg"].double().cpu(), ref_m[i], rtol=RTOL,
                                   atol=1e-6 * max(1.0, float(ref_m[i].abs().max())))


def test_fused_lamb_errors_and_defaults(device):
    params = make_params([(3,), (4,)], device)
    with pytest.raises(RuntimeError, match="FusedLAMB does not support the AMSGrad variant"):
        FusedLAMB(params, amsgrad=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        FusedLAMB(params, max_grad_norm=-1.0)
    opt = FusedLAMB(params)
    assert opt.defaults["eps"] == 1e-6 and opt.defaults["weight_decay"] == 0.01
    assert opt.defaults["max_grad_norm"] == 1.0 and opt.adam_w_mode == 1 and not opt.use_nvlamb
    # the user's grads are read, never overwritten (NVIDIA stores the update in them)
    for p in params:
        p.grad = torch.full_like(p, 3.0)
    opt.step()
    assert all(bool((p.grad == 3.0).all()) for p in params)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_fused_lamb_eps_zero_norms_cover_params_only(device, executor):
    """eps=0 is valid; the zero gaps between slots (0/0 there) stay out of the trust-ratio norms on every executor."""
    params = make_params([(3,), (5, 2), (7,)], device, seed=41)
    opt = FusedLAMB(params, lr=1e-2, betas=(0.9, 0.99), eps=0.0, weight_decay=0.01, max_grad_norm=None)
    opt.executor = executor
    base = dict(betas=(0.9, 0.99), eps=0.0, weight_decay=0.01, grad_averaging=True, bias_correction=True)
    ref = RefLamb([dict(base, params=[p.detach().double().cpu() for p in params], lr=1e-2)],
                  max_grad_norm=None, adam_w_mode=True, use_nvlamb=False)
    gen = torch.Generator().manual_seed(42)
    for _ in range(3):
        grads = draw_grads(params, gen)
        for p, g in zip(params, grads):
            set_grad(p, g)
        opt.step()
        ref.step([[g.double().cpu() for g in grads]])
    assert opt.last_executor == expected_executor(executor, device)
    assert all(bool(torch.isfinite(p).all()) for p in params)
    assert_params_close(params, ref.groups[0]["params"], max_abs(params), "lamb eps=0 param")


# ------------------------------------------------------------------ FusedNovoGrad
def ref_novograd(params, grads, state, *, step, lr, b1, b2, eps, wd, norm_type, init_zero, reg_inside_moment,
                 grad_averaging, bias_correction):
    b3 = 1 - b1 if grad_averaging else 1.0
    bc1 = 1 - b1**step if bias_correction else 1.0
    bc2 = math.sqrt(1 - b2**step) if bias_correction else 1.0
    out = []
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is None:
            out.append(p)
            continue
        n = float(g.norm()) if norm_type == 2 else float(g.abs().max())
        if i not in state:
            state[i] = {"m": torch.zeros_like(p), "gn": 0.0 if init_zero else n}
        st = state[i]
        if norm_type == 2:
            st["gn"] = math.sqrt(b2 * st["gn"] ** 2 + (1 - b2) * n * n)
        else:
            st["gn"] = b2 * st["gn"] + (1 - b2) * n
        d = st["gn"] / bc2 + eps
        if reg_inside_moment:
            st["m"] = b1 * st["m"] + b3 * (g / d + wd * p)
            out.append(p - lr * st["m"] / bc1)
        else:
            st["m"] = b1 * st["m"] + b3 * g
            out.append(p - lr * ((st["m"] / bc1) / d + wd * p))
    return out


NOVOGRAD_CASES = [
    dict(norm_type=2, init_zero=False, reg_inside_moment=False, grad_averaging=True, bias_correction=True, b1=0.95),
    dict(norm_type=0, init_zero=True, reg_inside_moment=False, grad_averaging=False, bias_correction=True, b1=0.9),
    dict(norm_type=2, init_zero=True, reg_inside_moment=True, grad_averaging=True, bias_correction=False, b1=0.9),
    dict(norm_type=0, init_zero=False, reg_inside_moment=True, grad_averaging=True, bias_correction=True, b1=0.8),
    dict(norm_type=2, init_zero=False, reg_inside_moment=False, grad_averaging=True, bias_correction=True, b1=0.0),
]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("case", range(len(NOVOGRAD_CASES)))
def test_fused_novograd_matches_reference(device, executor, case):
    c = dict(NOVOGRAD_CASES[case])
    b1 = c.pop("b1")
    hp = dict(lr=1e-2, b1=b1, b2=0.98, eps=1e-8, wd=0.01, **c)
    params = make_params(shapes_for(40 + case), device, seed=40 + case)
    opt = FusedNovoGrad(params, lr=hp["lr"], betas=(b1, hp["b2"]), eps=hp["eps"], weight_decay=hp["wd"], **c)
    opt.executor = executor
    ref = [p.detach().double().cpu() for p in params]
    state: Dict[int, dict] = {}
    gen = torch.Generator().manual_seed(50 + case)
    for step in range(1, STEPS + 1):
        grads = step_on(opt, params, gen, drop=(1,) if step in (1, 6) else ())
        ref = ref_novograd(ref, [None if g is None else g.double().cpu() for g in grads], state, step=step, **hp)
    want = "torch" if b1 == 0 else expected_executor(executor, device)  # beta1 = 0 runs the torch math
    assert opt.last_executor == want
    assert opt.param_groups[0]["step"] == STEPS
    assert_params_close(params, ref, max_abs(ref), "novograd param")
    for i, p in enumerate(params):
        assert set(opt.state[p]) == {"exp_avg", "exp_avg_sq"}
        assert opt.state[p]["exp_avg_sq"].dim() == 0
        torch.testing.assert_close(float(opt.state[p]["exp_avg_sq"]), state[i]["gn"], rtol=RTOL, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["exp_avg"].double().cpu(), state[i]["m"], rtol=RTOL,
                                   atol=1e-6 * max(1.0, float(state[i]["m"].abs().max())))


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("norm_type", [0, 2])
def test_fused_novograd_empty_param(device, executor, norm_type):
    """A param with no elements has norm 0 (max |grad| of nothing included: torch's inf norm of an empty tensor
    raises); it and its neighbours step as the reference says."""
    hp = dict(lr=1e-2, b1=0.9, b2=0.98, eps=1e-8, wd=0.01, norm_type=norm_type, init_zero=False,
              reg_inside_moment=False, grad_averaging=True, bias_correction=True)
    params = make_params([(3, 4), (0,), (5,)], device, seed=61)
    opt = FusedNovoGrad(params, lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=hp["wd"],
                        norm_type=norm_type)
    opt.executor = executor
    ref = [p.detach().double().cpu() for p in params]
    state: Dict[int, dict] = {}
    gen = torch.Generator().manual_seed(62)
    for step in range(1, 6):
        grads = step_on(opt, params, gen)
        dgrads = [g.double().cpu() for g in grads]
        ref = ref_novograd([r for k, r in enumerate(ref) if k != 1], [g for k, g in enumerate(dgrads) if k != 1],
                           state, step=step, **hp)
        ref.insert(1, params[1].detach().double().cpu())
    assert opt.last_executor == expected_executor(executor, device)
    assert_params_close(params, ref, max_abs(ref), "novograd param")
    assert float(opt.state[params[1]]["exp_avg_sq"]) == 0.0


def test_fused_novograd_errors_and_state_dict(device):
    params = make_params([(5,), (2, 3)], device)
    with pytest.raises(RuntimeError, match="FusedNovoGrad does not support the AMSGrad variant"):
        FusedNovoGrad(params, amsgrad=True)
    with pytest.raises(RuntimeError, match="only support l2/inf norm"):
        FusedNovoGrad(params, norm_type=1)
    gen = torch.Generator().manual_seed(60)
    seq = [draw_grads(params, gen) for _ in range(6)]

    def check_saved(saved):
        assert saved["state"][0]["exp_avg_sq"].dim() == 0

    check_resume_matches_twin(lambda ps: FusedNovoGrad(ps, lr=1e-2), params, seq, 3, check_saved)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("cls", [FusedLAMB, FusedMixedPrecisionLamb], ids=["fused_lamb", "fused_mp_lamb"])
def test_lamb_max_grad_norm_zero_clips_every_grad_to_zero(device, executor, cls):
    """max_grad_norm=0: the global clip divides the grads by infinity (NVIDIA's kernel: norm / 0), so the update
    is the one of zero grads; max_grad_norm=None turns clipping off instead."""
    params, zeros = make_params([(4,), (2, 3)], device, seed=7), make_params([(4,), (2, 3)], device, seed=7)
    clipped = cls(params, lr=1e-2, max_grad_norm=0)
    ref = cls(zeros, lr=1e-2, max_grad_norm=None)
    clipped.executor = ref.executor = executor
    gen = torch.Generator().manual_seed(8)
    for p, q in zip(params, zeros):
        set_grad(p, torch.randn(p.shape, generator=gen).to(device))
        set_grad(q, torch.zeros_like(q))
    clipped.step()
    ref.step()
    for p, q in zip(params, zeros):
        assert torch.equal(p.detach(), q.detach())


# ------------------------------------------------------------------ FusedMixedPrecisionLamb
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_lamb_masters(device, executor, dtype):
    """Low-precision model params, fp32 masters and moments: the masters follow the float64 LAMB
    reference, the model params are the masters rounded to the model dtype."""
    shapes = shapes_for(70)
    params = make_params(shapes, device, dtype=dtype, seed=70)
    ref = RefLamb([dict(params=[p.detach().double().cpu() for p in params], lr=1e-2, betas=(0.9, 0.99), eps=1e-6,
                        weight_decay=0.01, grad_averaging=True, bias_correction=True)],
                  max_grad_norm=1.0, adam_w_mode=True, use_nvlamb=False)
    opt = FusedMixedPrecisionLamb(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01,
                                  reduced_precision_dtype=dtype)
    opt.executor = executor
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) and opt.param_groups[0]["step"].tolist() == [0]
    gen = torch.Generator().manual_seed(71)
    for _ in range(STEPS):
        grads = step_on(opt, params, gen, scale=0.3)
        ref.step([[g.double().cpu() for g in grads]])  # the reference sees the grads as the model holds them
    assert opt.last_executor == expected_executor(executor, device)
    assert opt.param_groups[0]["step"].tolist() == [STEPS]
    masters = opt.param_groups_full_precision[0]["params"]
    assert all(m.dtype == torch.float32 for m in masters)
    assert_params_close(masters, ref.groups[0]["params"], max_abs(ref.groups[0]["params"]), "master")
    for p, m in zip(params, masters):
        assert p.dtype == dtype and torch.equal(p.detach(), m.detach().to(dtype))
        assert {k: v.dtype for k, v in opt.state[p].items()} == {"exp_avg": torch.float32,
                                                                  "exp_avg_sq": torch.float32}
    # checkpoints keep the fp32 moments (torch would cast them to the param dtype)
    saved = opt.state_dict()
    again = FusedMixedPrecisionLamb(clone_params(params), lr=1e-2, reduced_precision_dtype=dtype)
    again.load_state_dict(saved)
    assert all(v.dtype == torch.float32 for st in again.state.values() for v in st.values())


@pytest.mark.devices("cpu")
def test_mixed_precision_lamb_grad_scaler():
    """torch GradScaler: overflow steps are skipped (step count unchanged); otherwise the result equals the
    unscaled run."""
    model = torch.nn.Linear(6, 4).to(torch.bfloat16)
    twin = copy.deepcopy(model)
    opt = FusedMixedPrecisionLamb(model.parameters(), lr=1e-2, reduced_precision_dtype=torch.bfloat16)
    opt_twin = FusedMixedPrecisionLamb(twin.parameters(), lr=1e-2, reduced_precision_dtype=torch.bfloat16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    gen = torch.Generator().manual_seed(80)
    for it in range(4):
        x = torch.randn(3, 6, generator=gen).to(torch.bfloat16)
        loss = model(x).float().sum()
        scaler.scale(loss).backward()
        if it == 2:
            model.weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # the current GradScaler contract, not the deprecated one
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if it == 2:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            assert opt.param_groups[0]["step"].tolist() == [2]
            assert scaler.get_scale() == 2.0**3
            continue
        twin(x).float().sum().backward()
        opt_twin.step()
        opt_twin.zero_grad()
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert opt.param_groups[0]["step"].tolist() == [3]


def test_mixed_precision_lamb_errors(device):
    params = make_params([(3,)], device, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedMixedPrecisionLamb(params, amsgrad=True)
    with pytest.raises(ValueError, match="reduced_precision_dtype"):
        FusedMixedPrecisionLamb(params, reduced_precision_dtype=torch.float64)
    with pytest.raises(ValueError, match="FusedMixedPrecisionLamb: step must be >= 0, got -1"):
        FusedMixedPrecisionLamb(params, step=-1)
    for bad in (1.5, True, "3"):
        with pytest.raises(TypeError, match="FusedMixedPrecisionLamb: step must be an int"):
            FusedMixedPrecisionLamb(params, step=bad)
    opt = FusedMixedPrecisionLamb(params, reduced_precision_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="unexpected keyword"):
        opt.step(grads=1)


def test_mixed_precision_lamb_numpy_step(device):
    """A numpy integer start step is taken as the int it holds (the group's step tensor starts there)."""
    import numpy as np

    opt = FusedMixedPrecisionLamb(make_params([(3,)], device, dtype=torch.bfloat16), step=np.int64(2))
    assert opt.param_groups[0]["step"].tolist() == [2]


# ------------------------------------------------------------------ all of them on CPU: the C++ kernels ran
@pytest.mark.devices("cpu")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [
    lambda ps: FusedAdam(ps), lambda ps: FusedLAMB(ps), lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
    lambda ps: FusedAdagrad(ps), lambda ps: FusedNovoGrad(ps),
    lambda ps: FusedMixedPrecisionLamb(ps, reduced_precision_dtype=torch.bfloat16),
], ids=["adam", "lamb", "sgd", "adagrad", "novograd", "mp_lamb"])
def test_cpu_uses_kernels(make, dtype):
    params = make_params([(17,), (3, 5)], "cpu", dtype=dtype)
    opt = make(params)
    for _ in range(2):
        for p in params:
            set_grad(p, torch.randn(p.shape).to(dtype))
        opt.step()
    assert opt.last_executor == "apex_C"
    assert opt.recombine_count == 1  # combined once, sharing intact afterwards
    assert all(torch.isfinite(p.float()).all() for p in params)


# ------------------------------------------------------------------ kernel handles for subclasses
class _ListAdam(FusedAdam):
    """A subclass that replaces step() with its own loop, as code written against NVIDIA's FusedAdam does:
    fp32 copies of low-precision params and grads, the update through ``self.multi_tensor_adam``, the result
    copied back; one step count per group."""

    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            lists, low = [[], [], [], []], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                master = p.data.float() if p.dtype != torch.float32 else p.data
                if master is not p.data:
                    low.append((p, master))
                for lst, t in zip(lists, (p.grad.float(), master, state["exp_avg"], state["exp_avg_sq"])):
                    lst.append(t)
            beta1, beta2 = group["betas"]
            multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf, lists, group["lr"], beta1,
                                 beta2, group["eps"], group["step"], int(self.adam_w_mode),
                                 int(group["bias_correction"]), group["weight_decay"])
            for p, master in low:
                p.data.copy_(master)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_subclass_stepping_through_the_kernel_handles_matches_torch(device, adam_w_mode):
    params = make_params(shapes_for(3), device)
    ref = clone_params(params)
    opt = _ListAdam(params, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    torch_opt = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(ref, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        grads = draw_grads(params, gen)
        for p, q, g in zip(params, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        torch_opt.step()
    assert_params_close(params, ref, 1.0, "param")
    assert opt.state_dict()["param_groups"][0]["step"] == 5


def test_kernel_handles_are_upstreams_attributes(device):
    from apex.multi_tensor_apply import amp_C

    params = make_params([(3,), (2, 2)], device)
    handles = {
        FusedAdam: {"multi_tensor_adam": "multi_tensor_adam"},
        FusedLAMB: {"multi_tensor_lamb": "multi_tensor_lamb", "multi_tensor_l2norm": "multi_tensor_l2norm"},
        FusedSGD: {"multi_tensor_sgd": "multi_tensor_sgd"},
        FusedNovoGrad: {"multi_tensor_novograd": "multi_tensor_novograd"},
        FusedAdagrad: {"multi_tensor_adagrad": "multi_tensor_adagrad"},
        FusedMixedPrecisionLamb: {"multi_tensor_l2norm": "multi_tensor_l2norm_mp"},
    }
    for cls, names in handles.items():
        opt = cls(params, lr=0.1)
        for attr, op in names.items():
            assert getattr(opt, attr) is getattr(amp_C, op), (cls.__name__, attr)
        flag = opt._dummy_overflow_buf
        assert flag.dtype == torch.int32 and flag.shape == (1,) and flag.item() == 0
        assert flag.device == params[0].device and opt._dummy_overflow_buf is flag
        assert "_dummy_overflow_buf" not in opt.state_dict()
        assert copy.deepcopy(opt)._dummy_overflow_buf is not flag
    # CUDA-graph and mixed-precision stage kernels are not provided: hasattr says so, access names the kernel
    assert not hasattr(FusedAdam(params), "multi_tensor_adam_capturable")
    mp = FusedMixedPrecisionLamb(params)
    assert not hasattr(mp, "multi_tensor_lamb")
    with pytest.raises(AttributeError, match="multi_tensor_lamb_mp"):
        mp.multi_tensor_lamb  # noqa: B018
    assert FusedAdagrad([{"params": []}], lr=0.1)._dummy_overflow_buf.device.type == "cpu"  # no params: the CPU
    opt = FusedSGD(params, lr=0.1)
    opt.multi_tensor_sgd = len  # an instance may bind its own
    assert opt.multi_tensor_sgd is len


# ------------------------------------------------------------------ HF transformers (full tier)
def _tiny_trainer(tmp_path, model=None, **args):
    transformers = pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    if model is None:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    gen = torch.Generator().manual_seed(1)
    # a learnable sequence task: token t+1 = (token t + 1) mod 64
    starts = torch.randint(0, 64, (64, 1), generator=gen)
    data = (starts + torch.arange(16)) % 64

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i], "labels": data[i]}

    options = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=4, learning_rate=1e-2,
                   logging_steps=1, log_level="error", save_strategy="no", report_to=[], use_cpu=True,
                   disable_tqdm=True)
    targs = TrainingArguments(**{**options, **args})
    trainer = Trainer(model=model, args=targs, train_dataset=Data())
    return transformers, trainer


def _losses(trainer) -> List[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _assert_trained(losses: List[float]) -> None:
    assert len(losses) >= 8 and all(math.isfinite(x) for x in losses), losses
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.5 * first, f"loss did not halve: first steps {first:.3f}, last steps {last:.3f}"


@pytest.mark.full
def test_transformers_adamw_apex_fused(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, trainer = _tiny_trainer(tmp_path, optim="adamw_apex_fused")
    trainer.train()
    assert isinstance(getattr(trainer.optimizer, "optimizer", trainer.optimizer), FusedAdam)  # accelerate wraps it
    _assert_trained(_losses(trainer))


@pytest.mark.full
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
# HF builds its LR scheduler before amp.initialize patches optimizer.step; the patched step keeps the scheduler's
# record (NVIDIA's apex made torch warn here that step was overridden)
@pytest.mark.filterwarnings("error:Seems like `optimizer.step\\(\\)` has been overridden")
def test_transformers_half_precision_backend_apex(tmp_path, monkeypatch, opt_level):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("APEX_AMP_DTYPE", "float16")  # HF's fp16=True asks for fp16 (our CPU default is bf16)
    pytest.importorskip("apex.amp")
    _, trainer = _tiny_trainer(tmp_path, optim="adamw_apex_fused", fp16=True, half_precision_backend="apex",
                               fp16_opt_level=opt_level)
    trainer.train()
    assert trainer.use_apex
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(opt, FusedAdam) and hasattr(opt, "_amp_stash")  # went through amp.initialize
    _assert_trained(_losses(trainer))


@pytest.mark.full
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_transformers_apex_backend_second_trainer_on_the_same_model(tmp_path, monkeypatch, opt_level):
    """Two-phase training (a second Trainer on the model the first one trained) calls amp.initialize on a model
    amp prepared already: at O2 it comes in cast to fp16, and training goes on from the first phase's fp32
    master weights (the first phase's optimizer leaves amp with it)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("APEX_AMP_DTYPE", "float16")
    pytest.importorskip("apex.amp")
    kw = dict(optim="adamw_apex_fused", fp16=True, half_precision_backend="apex", fp16_opt_level=opt_level)
    _, first = _tiny_trainer(tmp_path / "a", **kw)
    first.train()
    _, second = _tiny_trainer(tmp_path / "b", model=first.model, **kw)
    second.train()
    assert second.use_apex and second.model is first.model
    losses = _losses(first) + _losses(second)
    assert all(math.isfinite(x) for x in losses)
    assert sum(_losses(second)[-4:]) < sum(_losses(first)[:4])


@pytest.mark.full
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_transformers_apex_backend_train_twice(tmp_path, monkeypatch, opt_level):
    """``trainer.train()`` a second time passes the model and optimizer amp returned to amp.initialize again, with
    the same options: they stay as prepared, and training goes on (upstream refused the optimizer)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("APEX_AMP_DTYPE", "float16")
    pytest.importorskip("apex.amp")
    _, trainer = _tiny_trainer(tmp_path, optim="adamw_apex_fused", fp16=True, half_precision_backend="apex",
                               fp16_opt_level=opt_level)
    trainer.train()
    first = _losses(trainer)
    trainer.train()
    second = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(math.isfinite(x) for x in first + second)
    assert sum(second[-4:]) < sum(first[:4])


@pytest.mark.full
def test_transformers_apex_backend_resume_keeps_the_loss_scale(tmp_path, monkeypatch):
    """Trainer saves and loads only the optimizer's state dict (never amp.state_dict()): the loss scale a run
    reached comes back with it on resume, instead of restarting at 2**16."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("APEX_AMP_DTYPE", "float16")
    pytest.importorskip("apex.amp")
    from transformers import TrainerCallback

    from apex import amp

    seen = {}

    class Scale(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:  # as if two steps had overflowed
                amp._amp_state.loss_scalers[0].load(2.0 ** 14, 0)
            if state.global_step == 5:  # the first step after the resume point
                seen.setdefault("step5", []).append(dict(amp.state_dict()["loss_scaler0"]))

        def on_train_begin(self, args, state, control, **kwargs):  # after the checkpoint was loaded
            seen.setdefault("begin", []).append(dict(amp.state_dict()["loss_scaler0"]))
            held = kwargs["optimizer"].state_dict()["apex_amp_loss_scalers"]["loss_scaler0"]
            seen.setdefault("held", []).append(dict(held))

    kw = dict(optim="adamw_apex_fused", fp16=True, half_precision_backend="apex", fp16_opt_level="O1",
              save_strategy="steps", save_steps=4, max_steps=6)
    _, first = _tiny_trainer(tmp_path, **kw)
    first.add_callback(Scale())
    first.train()
    _, second = _tiny_trainer(tmp_path, **kw)
    second.add_callback(Scale())
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert seen["begin"][0] == {"loss_scale": 2.0 ** 16, "unskipped": 0}
    # the resumed optimizer holds the checkpoint's scaler (two clean steps after the set) and restores it at its
    # first scale_loss: step 5 of both runs ends at the same scale and count
    assert seen["held"][1] == {"loss_scale": 2.0 ** 14, "unskipped": 2}
    assert seen["step5"] == [{"loss_scale": 2.0 ** 14, "unskipped": 3}] * 2


# ------------------------------------------------------------------ low precision
LOW_FACTORIES = {
    "adam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "adam_l2": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01, adam_w_mode=False, bias_correction=False),
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-2),
    "lamb_l2": lambda ps: FusedLAMB(ps, lr=1e-2, adam_w_mode=False),
    "sgd": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01),
    "adagrad": lambda ps: FusedAdagrad(ps, lr=1e-2, weight_decay=0.01),
    "novograd": lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01),
    "novograd_inf": lambda ps: FusedNovoGrad(ps, lr=1e-2, norm_type=0, reg_inside_moment=True),
}
# FusedLAMB keeps its moments in the param dtype, as NVIDIA's does: in fp16 the second moment of small grads
# underflows (a property of the format, not of our arithmetic), so fp16 LAMB does not track an fp32 run.
# FusedAdam keeps fp32 moments for fp16/bf16 params, as NVIDIA's does.
FP16_MOMENT_UNDERFLOW = {"lamb", "lamb_l2"}


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(LOW_FACTORIES))
def test_low_precision_tracks_fp32(device, executor, dtype, name):
    """bf16/fp16 params stay within a few storage ulps of the fp32 run (same grads, 8 steps)."""
    if dtype == torch.float16 and name in FP16_MOMENT_UNDERFLOW:
        pytest.skip("fp16 moments underflow for small grads (NVIDIA's FusedLAMB state layout)")
    params32 = make_params(shapes_for(90), device, seed=90)
    low = clone_params(params32, dtype)
    opt32, opt_low = LOW_FACTORIES[name](params32), LOW_FACTORIES[name](low)
    opt32.executor = opt_low.executor = executor
    gen = torch.Generator().manual_seed(91)
    for _ in range(8):
        grads = draw_grads(low, gen)  # drawn in the low dtype: both runs see the same values
        for p, q, g in zip(params32, low, grads):
            set_grad(p, g.float())
            set_grad(q, g)
        opt32.step()
        opt_low.step()
    assert opt_low.last_executor == expected_executor(executor, device)
    unit = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]  # unit roundoff of the storage dtype
    for a, b in zip(low, params32):
        torch.testing.assert_close(a.detach().float(), b.detach(), rtol=8 * unit,
                                   atol=8 * unit * max_abs(params32))


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_adam_low_precision_params_fp32_moments(device, executor, dtype):
    """NVIDIA's FusedAdam with fp16/bf16 params: fp32 moments, each param updated in fp32 from its stored value
    and rounded once. Per step, against float64 math from our previous params: within 1 ulp of the dtype."""
    hp = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, wd=0.01)
    params = make_params(shapes_for(95), device, dtype=dtype, seed=95)
    opt = FusedAdam(params, lr=hp["lr"], betas=(hp["b1"], hp["b2"]), eps=hp["eps"], weight_decay=hp["wd"])
    opt.executor = executor
    ms = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    vs = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    gen = torch.Generator().manual_seed(96)
    unit = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    for step in range(1, 11):
        before = [p.detach().double().cpu() for p in params]
        grads = step_on(opt, params, gen, scale=0.01 if step == 1 else 1.0)  # tiny first grads: fp16 v would underflow
        for i, (p, g) in enumerate(zip(params, grads)):
            want, ms[i], vs[i] = ref_adam64(before[i], g.double().cpu(), ms[i], vs[i], lr=hp["lr"], b1=hp["b1"],
                                            b2=hp["b2"], eps=hp["eps"], wd=hp["wd"], step=step, adam_w_mode=True,
                                            bias_correction=True)
            ulp = want.abs().clamp(min=2.0**-14) * (2 * unit)  # spacing of the dtype around the reference
            assert bool(((p.detach().double().cpu() - want).abs() <= ulp).all()), (step, i)
    assert opt.last_executor == expected_executor(executor, device)
    assert opt.recombine_count == 1
    for p in params:
        assert p.dtype == dtype
        assert {k: v.dtype for k, v in opt.state[p].items()} == {"exp_avg": torch.float32,
                                                                  "exp_avg_sq": torch.float32}
    saved = opt.state_dict()
    again = FusedAdam(clone_params(params), lr=hp["lr"])
    again.load_state_dict(saved)
    assert all(v.dtype == torch.float32 for st in again.state.values() for v in st.values())


@pytest.mark.devices("cpu")
def test_mixed_precision_lamb_grad_scaler_keyword():
    """NVIDIA's contract: step(grad_scaler=scaler) checks for inf itself, records it for scaler.update()."""
    model = torch.nn.Linear(5, 2).to(torch.float16)
    opt = FusedMixedPrecisionLamb(model.parameters(), lr=1e-2, reduced_precision_dtype=torch.float16)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    x = torch.randn(4, 5).to(torch.float16)
    scaler.scale(model(x).float().sum()).backward()
    model.bias.grad[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    opt.step(grad_scaler=scaler)
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() == 4.0 and opt.param_groups[0]["step"].tolist() == [0]
    opt.zero_grad()
    scaler.scale(model(x).float().sum()).backward()
    opt.step(grad_scaler=scaler)
    scaler.update()
    assert opt.param_groups[0]["step"].tolist() == [1]
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ------------------------------------------------------------------ FusedAdam capturable / master_weights
def _scaled_twin_runs(make_ours, steps, *, inf_at=(), unscale_at=(), autocast=False):
    """A small model trained by torch.optim.AdamW and by ``make_ours(params)`` beside it, each under its own
    torch GradScaler: the same inputs, an inf grad injected at ``inf_at``, ``scaler.unscale_`` + clipping at
    ``unscale_at``, forward passes under fp16 autocast with ``autocast``. Yields (step, reference model, our
    model, our optimizer, both scalers, our grads as they were just before ``scaler.step`` divided by the scale
    they still carried) after each step."""
    torch.manual_seed(0)
    ref_model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    model = copy.deepcopy(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01)
    opt = make_ours(list(model.parameters()))
    scalers = (torch.amp.GradScaler("cpu", init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10))
    gen = torch.Generator().manual_seed(1)
    for it in range(steps):
        x = torch.randn(5, 6, generator=gen)
        for m, o, scaler in ((ref_model, ref_opt, scalers[0]), (model, opt, scalers[1])):
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                loss = m(x).float().square().mean()
            scaler.scale(loss).backward()
            if it in inf_at:
                m[0].weight.grad[1, 2] = float("inf")
            if it in unscale_at:
                scaler.unscale_(o)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            carried = 1.0 if it in unscale_at else scaler.get_scale()
            expected = [q.grad / carried for q in m.parameters()]  # a power of two: exact
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # NVIDIA's step(grad_scaler=) contract
                scaler.step(o)
            scaler.update()
        yield it, ref_model, model, opt, scalers, expected
        ref_opt.zero_grad()
        opt.zero_grad()


@pytest.mark.devices("cpu")
@pytest.mark.parametrize("executor", EXECUTORS)
def test_fused_adam_capturable_grad_scaler(executor):
    """capturable=True: GradScaler hands over its scale and flags. Against torch.optim.AdamW under its own
    scaler: the same skips (the step count stays on an overflow), the same scale schedule, params within
    fp32 rounding; after each step the grads are the unscaled ones, bit for bit what torch's unscale_
    leaves, also when the user unscaled them first to clip."""

    def make(params):
        opt = FusedAdam(params, lr=1e-2, weight_decay=0.01, capturable=True)
        opt.executor = executor
        return opt

    steps = []
    runs = _scaled_twin_runs(make, 8, inf_at=(2, 5), unscale_at=(3, 6))
    for it, ref_model, model, opt, (s_ref, s_ours), expected in runs:
        assert s_ref.get_scale() == s_ours.get_scale()
        for a, b, want in zip(ref_model.parameters(), model.parameters(), expected):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
            if it not in (2, 5):  # an overflow step leaves the grads as they were, scaled (NVIDIA's kernel)
                assert torch.equal(b.grad, want)
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7)
        steps.append(opt.param_groups[0]["step"].tolist())
    assert steps == [[1], [2], [2], [3], [4], [4], [5], [6]]
    assert opt._step_supports_amp_scaling and opt.last_executor == expected_executor(executor, "cpu")
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and float(lr) == pytest.approx(1e-2)
    assert opt.param_groups[0]["step"].dtype == torch.int32


@pytest.mark.devices("cpu")
def test_fused_adam_capturable_without_scaler_and_lr_scheduler():
    """Without a GradScaler the capturable form is plain FusedAdam (bit for bit, same executor); an LR
    scheduler writes into the tensor lr."""
    params = make_params(shapes_for(110), "cpu", seed=110)
    twin = clone_params(params)
    opt = FusedAdam(params, lr=1e-2, capturable=True)
    plain = FusedAdam(twin, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sched_plain = torch.optim.lr_scheduler.StepLR(plain, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(111)
    for _ in range(5):
        grads = draw_grads(params, gen)
        for p, q, g in zip(params, twin, grads):
            set_grad(p, g)
            set_grad(q, g)
        opt.step()
        plain.step()
        sched.step()
        sched_plain.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin))
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(plain.param_groups[0]["lr"])
    assert opt.param_groups[0]["step"].tolist() == [5] and plain.param_groups[0]["step"] == 5


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_adam_master_weights(device, executor, dtype):
    """master_weights=True: fp32 masters of the fp16/bf16 params follow the float64 Adam reference (fp32
    rounding, not the dtype's), the params are the masters rounded; writes into the params are not read
    back (the masters are the optimizer's truth); fp32 params are their own masters. Checkpoints keep fp32
    moments; after a load the masters are made again from the params."""
    shapes = shapes_for(120)
    params = make_params(shapes, device, dtype=dtype, seed=120) + make_params([(3, 2)], device, seed=121)
    ref = [p.detach().double().cpu() for p in params]
    ms = [torch.zeros_like(r) for r in ref]
    vs = [torch.zeros_like(r) for r in ref]
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.01, capturable=True, master_weights=True)
    opt.executor = executor
    before = opt.param_groups_master[0]["params"]
    assert before[:-1] == [None] * (len(params) - 1) and before[-1] is params[-1]  # low ones: made at step 1
    gen = torch.Generator().manual_seed(122)
    for step in range(1, STEPS + 1):
        grads = step_on(opt, params, gen)
        for i, g in enumerate(grads):
            ref[i], ms[i], vs[i] = ref_adam64(ref[i], g.double().cpu(), ms[i], vs[i], lr=1e-2, b1=0.9, b2=0.999,
                                              eps=1e-8, wd=0.01, step=step, adam_w_mode=True, bias_correction=True)
        if step == 3:
            with torch.no_grad():
                params[0].add_(1.0)  # a write into a model param: the master does not read it back
    assert opt.last_executor == expected_executor(executor, device)
    masters = opt.param_groups_master[0]["params"]
    assert all(m.dtype == torch.float32 for m in masters) and masters[-1] is params[-1]
    assert_params_close(masters, ref, max_abs(ref), "master")
    for p, m in zip(params, masters):
        assert torch.equal(p.detach(), m.detach().to(p.dtype))
        assert {k: v.dtype for k, v in opt.state[p].items()} == {"exp_avg": torch.float32,
                                                                  "exp_avg_sq": torch.float32}
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = clone_params(params)
    with torch.no_grad():
        resumed_params[0].fill_(0.5)
    again = FusedAdam(resumed_params, lr=1e-2, capturable=True, master_weights=True)
    again.load_state_dict(saved)
    assert all(v.dtype == torch.float32 for st in again.state.values() for v in st.values())
    set_grad(resumed_params[0], torch.zeros_like(resumed_params[0]))
    again.step()  # zero grad, decayed: the new master starts from the param's 0.5, not the old master
    got = again.param_groups_master[0]["params"][0]
    assert bool(((got - 0.5).abs() < 0.01).all()) and again.param_groups[0]["step"].tolist() == [STEPS + 1]


@pytest.mark.devices("cpu")
def test_fused_adam_master_weights_grad_scaler():
    """NVIDIA's capturable + master weights with fp16 layers under GradScaler, against fp32 torch.optim.AdamW:
    masters follow the fp32 run closely, the fp16 params are the masters rounded."""

    def make(params):
        for p in params[:2]:
            p.data = p.data.half()
        return FusedAdam(params, lr=1e-2, weight_decay=0.01, capturable=True, master_weights=True)

    for _, ref_model, model, opt, _, _ in _scaled_twin_runs(make, 6, inf_at=(2,), autocast=True):
        masters = opt.param_groups_master[0]["params"]
        for a, m, p in zip(ref_model.parameters(), masters, model.parameters()):
            torch.testing.assert_close(m, a, rtol=2e-3, atol=2e-3)
            assert torch.equal(p.detach(), m.detach().to(p.dtype))
    assert opt.param_groups[0]["step"].tolist() == [5]


# ------------------------------------------------------------------ torch checkpoints asking for math we lack


def _torch_trained(make, steps=2):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    opt = make([p])
    for _ in range(steps):
        p.grad = torch.randn(4, dtype=torch.float64)
        opt.step()
    return p, opt


def _refuses_load(opt, sd, exc, fragment):
    """``load_state_dict(sd)`` raises and leaves the optimizer's state_dict as it was."""
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(exc, match=fragment) as info:
        opt.load_state_dict(copy.deepcopy(sd))
    assert type(opt).__name__ in str(info.value)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert after["state"].keys() == before["state"].keys()


def test_fused_adagrad_refuses_torch_lr_decay():
    _, ref = _torch_trained(lambda ps: torch.optim.Adagrad(ps, lr=0.01, lr_decay=0.1))
    opt = FusedAdagrad([torch.nn.Parameter(torch.zeros(4))], lr=0.01)
    _refuses_load(opt, ref.state_dict(), ValueError, r"param group 0: FusedAdagrad has no learning-rate decay .*: "
                                                     r"expected lr_decay=0, got lr_decay=0.1")
    with pytest.raises(ValueError, match="lr_decay"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr_decay": 0.5})
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["lr_decay"] = 0.1  # set later: refused at the step, before anything changes
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match="lr_decay"):
        opt.step()
    assert torch.equal(p, torch.zeros(4)) and not opt.state


def test_fused_adagrad_loads_torch_adagrad_without_lr_decay_and_matches():
    p, ref = _torch_trained(lambda ps: torch.optim.Adagrad(ps, lr=0.01, eps=1e-10))
    q = torch.nn.Parameter(p.detach().float().clone())
    opt = FusedAdagrad([q], lr=0.01)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    for t in range(3):
        g = torch.randn(4, generator=torch.Generator().manual_seed(t))
        p.grad, q.grad = g.double(), g.clone()
        ref.step()
        opt.step()
    torch.testing.assert_close(q.double(), p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_refuses_a_torch_checkpoint_of_the_other_decay_rule(adam_w_mode):
    other = torch.optim.Adam if adam_w_mode else torch.optim.AdamW
    _, ref = _torch_trained(lambda ps: other(ps, weight_decay=0.1))
    opt = FusedAdam([torch.nn.Parameter(torch.zeros(4))], adam_w_mode=adam_w_mode)
    _refuses_load(opt, ref.state_dict(), ValueError,
                  rf"FusedAdam\(adam_w_mode={adam_w_mode}\) applies .* weight decay; the group has "
                  rf"decoupled_weight_decay={not adam_w_mode}")
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": 0.1,
                             "decoupled_weight_decay": not adam_w_mode})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_continues_a_torch_checkpoint_of_its_decay_rule(adam_w_mode):
    same = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    p, ref = _torch_trained(lambda ps: same(ps, lr=1e-2, weight_decay=0.1))
    q = torch.nn.Parameter(p.detach().float().clone())
    opt = FusedAdam([q], adam_w_mode=adam_w_mode)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    for t in range(5):
        g = torch.randn(4, generator=torch.Generator().manual_seed(t))
        p.grad, q.grad = g.double(), g.clone()
        ref.step()
        opt.step()
    torch.testing.assert_close(q.double(), p.detach(), rtol=1e-5, atol=1e-6)


def test_fused_adam_without_decay_takes_either_torch_rule():
    """No decay: Adam and AdamW are one update, so torch.optim.Adam's default checkpoint loads into the default
    FusedAdam; a decay set later must then agree (checked at the step)."""
    _, ref = _torch_trained(lambda ps: torch.optim.Adam(ps, lr=1e-2))
    q = torch.nn.Parameter(torch.zeros(4))
    opt = FusedAdam([q], lr=1e-2)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    q.grad = torch.ones(4)
    opt.step()
    opt.param_groups[0]["weight_decay"] = 0.1
    before, step = q.detach().clone(), opt.param_groups[0]["step"]
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
        opt.step()
    assert torch.equal(q, before) and opt.param_groups[0]["step"] == step


def _amsgrad_sd():
    return _torch_trained(lambda ps: torch.optim.Adam(ps, amsgrad=True))[1].state_dict()


@pytest.mark.parametrize("make", [
    lambda ps: FusedAdam(ps, adam_w_mode=False),
    lambda ps: FusedLAMB(ps),
    lambda ps: FusedNovoGrad(ps),
    lambda ps: FusedMixedPrecisionLamb(ps),
], ids=["FusedAdam", "FusedLAMB", "FusedNovoGrad", "FusedMixedPrecisionLamb"])
def test_classes_without_amsgrad_refuse_it_in_loads_added_groups_and_steps(make):
    p = torch.nn.Parameter(torch.zeros(4))
    opt = make([p])
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["amsgrad"] = True
    _refuses_load(opt, sd, ValueError, "does not support the AMSGrad variant")
    with pytest.raises(ValueError, match="AMSGrad"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "amsgrad": True})
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["amsgrad"] = True
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match=r"param group 0: .* AMSGrad"):
        opt.step()
    assert torch.equal(p, torch.zeros(4)) and not opt.state
    opt.param_groups[0]["amsgrad"] = False  # torch's default value is accepted
    opt.step()


def test_fused_adam_refuses_a_torch_amsgrad_checkpoint():
    opt = FusedAdam([torch.nn.Parameter(torch.zeros(4))], adam_w_mode=False)
    _refuses_load(opt, _amsgrad_sd(), ValueError, "AMSGrad")


@pytest.mark.parametrize("cls", [FusedAdam, FusedAdagrad, FusedSGD, FusedLAMB, FusedNovoGrad])
@pytest.mark.parametrize("option", ["maximize", "capturable", "differentiable"])
def test_torch_only_options_refused_in_loads(cls, option):
    kw = dict(lr=0.1) if cls is FusedSGD else {}
    opt = cls([torch.nn.Parameter(torch.zeros(4))], **kw)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0][option] = True
    _refuses_load(opt, sd, ValueError, f"does not implement {option}=True")
    sd["param_groups"][0][option] = False
    sd["param_groups"][0].update(foreach=True, fused=True)  # executor choices: ours is fused either way
    opt.load_state_dict(sd)
