"""NpuFusedAdam / NpuFusedAdamW = torch.optim.Adam / AdamW (amsgrad, weight decay) on combined buffers.

fp32 against torch.optim over 30 steps with drawn hyperparameters and shapes
(rtol 1e-5, atol 1e-6 * max|p0|, states too); bf16/fp16 per step against the
float64 update from our previous values, rounded to the storage dtype (1 ulp).
Executors: the C++ kernel (CPU), torch's fused Adam op on the flat buffers,
and plain torch ops, each against the same references.
"""

import math
import random

import pytest
import torch
from _optim_harness import (
    LOW,
    Spec,
    assert_close_rel,
    assert_ulp,
    check_grad_scale_folded,
    check_invalid,
    check_low_precision,
    check_resume_bitwise,
    check_torch_state_dict,
    check_zero_grad,
    make_params,
    run_side_by_side,
)

from apex.optimizers import NpuFusedAdam, NpuFusedAdamW


def ref_adam(p, g, st, t, hp, new, decoupled=False):
    """float64 Adam(W) from the paper's formulas with torch's conventions (eps outside the sqrt).

    ``new``: the moments as our optimizer stored them; the update reads them back as stored,
    exactly like torch reading low-precision state tensors.
    """
    lr, (b1, b2), eps, wd = hp["lr"], hp["betas"], hp["eps"], hp["weight_decay"]
    if wd:
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
    zero = torch.zeros_like(p)
    m = b1 * st.get("exp_avg", zero) + (1 - b1) * g
    v = b2 * st.get("exp_avg_sq", zero) + (1 - b2) * g * g
    out = {"exp_avg": m, "exp_avg_sq": v}
    m_used = new["exp_avg"] if new is not None else m
    v_used = new["exp_avg_sq"] if new is not None else v
    if hp["amsgrad"]:
        vmax = torch.maximum(st.get("max_exp_avg_sq", zero), v_used)
        out["max_exp_avg_sq"] = vmax
        v_used = new["max_exp_avg_sq"] if new is not None else vmax
    step = t + 1
    denom = v_used.sqrt() / math.sqrt(1 - b2**step) + eps
    out["param"] = p - lr / (1 - b1**step) * m_used / denom
    return out


def ref_adamw(p, g, st, t, hp, new):
    return ref_adam(p, g, st, t, hp, new, decoupled=True)


def draw(rng: random.Random) -> dict:
    return dict(
        lr=rng.choice([1e-3, rng.uniform(1e-4, 5e-2)]),
        betas=rng.choice([(0.9, 0.999), (rng.uniform(0.5, 0.95), rng.uniform(0.9, 0.9999))]),
        eps=rng.choice([1e-8, rng.uniform(1e-10, 1e-3)]),
        weight_decay=rng.choice([0.0, rng.uniform(0.0, 0.2)]),
        amsgrad=rng.random() < 0.5,
    )


ADAM = Spec(ours=NpuFusedAdam, ref=ref_adam, draw=draw, torch_cls=torch.optim.Adam)
ADAMW = Spec(ours=NpuFusedAdamW, ref=ref_adamw, draw=draw, torch_cls=torch.optim.AdamW)
SPECS = {"adam": ADAM, "adamw": ADAMW}
HP = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.05, amsgrad=True)


def with_executor(spec: Spec, executor: str) -> Spec:
    """The spec with our optimizer forced onto an executor ("auto", "torch" or "torch_ops")."""

    def make(*args, **kwargs):
        opt = spec.ours(*args, **kwargs)
        opt.executor = executor
        return opt

    return Spec(ours=make, ref=spec.ref, draw=spec.draw, torch_cls=spec.torch_cls)


def expected(executor: str, device: str) -> str:
    return "apex_C" if executor == "auto" and device == "cpu" else "torch"


def fused_expected(executor: str, device: str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether torch's own fused Adam op should run: fp32 sets, torch executor, a device torch has it for."""
    return dtype == torch.float32 and (executor == "torch" or (executor == "auto" and device == "cuda"))


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts calls of torch._fused_adam_ / torch._fused_adamw_ (still running them)."""
    calls = []
    for name in ("_fused_adam_", "_fused_adamw_"):
        real = getattr(torch, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, counted)
    return calls


# ------------------------------------------------------------------ fp32 vs torch.optim
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_matches_torch_random_hyperparameters(name, seed, device):
    """30 steps, drawn hyperparameters and shapes (seeded), params and every state vs torch.optim."""
    spec = SPECS[name]
    hp = draw(random.Random(1000 + seed))
    ours, *_ = run_side_by_side(spec, [(5, hp)], device=device, seed=seed, ref_kind="torch")
    assert ours.last_executor == expected("auto", device)


@pytest.mark.parametrize("executor", ["torch", "torch_ops"])
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_torch_executors_match_torch(name, executor, device, fused_calls):
    """The executors for other devices (torch's fused op on the flat buffer; plain ops), forced on this one."""
    spec = with_executor(SPECS[name], executor)
    ours, *_ = run_side_by_side(spec, [(3, HP), (2, dict(HP, amsgrad=False, lr=0.002))], device=device, seed=7,
                                ref_kind="torch", skip=lambda step, k: k == 1 and step % 4 == 0)
    assert ours.last_executor == expected(executor, device)
    assert bool(fused_calls) == fused_expected(executor, device)


def test_float64_reference_matches_torch():
    """The float64 reference used for low precision agrees with torch.optim on its own (sanity)."""
    run_side_by_side(ADAM, [(3, HP)], device="cpu", seed=2, ref_kind="f64", steps=10)


# ------------------------------------------------------------------ low precision
@pytest.mark.parametrize("executor", ["auto", "torch", "torch_ops"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_low_precision_within_one_ulp(name, dtype, executor, device, fused_calls):
    """bf16/fp16 params and states: each stored value within 1 ulp of float64 math from our previous values."""
    spec = with_executor(SPECS[name], executor)
    for amsgrad in (False, True):
        opt = check_low_precision(spec, dict(HP, amsgrad=amsgrad), dtype, device=device, seed=31,
                                  skip=lambda step, k: k == 0 and step in (3, 4))
        assert opt.last_executor == expected(executor, device)
    assert bool(fused_calls) == fused_expected(executor, device, dtype)


def test_low_precision_tiny_second_moment(device):
    """fp16 second moments fall into the subnormal range (g ~ 1e-3): still within 1 ulp."""
    check_low_precision(ADAM, dict(HP, amsgrad=False, weight_decay=0.0), torch.float16, device=device, seed=5,
                        steps=12, gscale=1e-3)


# ------------------------------------------------------------------ executors
@pytest.mark.devices("cpu")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cpu_runs_the_kernel_and_torch_executors_agree(dtype, fused_calls):
    """CPU: apex_C runs for every dtype; from the same params, states and grads, one step of each
    forced torch executor gives what the kernel gives (fp32: rtol 1e-6; bf16/fp16: within 1 ulp)."""
    gen = torch.Generator().manual_seed(4)
    shapes = [(33, 7), (5,), (), (2, 3, 4)]
    params = make_params(shapes, dtype, "cpu", gen)
    warm = NpuFusedAdamW(params, **HP)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        warm.step()
    assert warm.last_executor == "apex_C"
    saved, p_saved = warm.state_dict(), [p.detach().clone() for p in params]
    grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in params]
    out = {}
    for executor in ("auto", "torch", "torch_ops"):
        ps = [torch.nn.Parameter(t.clone()) for t in p_saved]
        opt = NpuFusedAdamW(ps, **HP)
        opt.load_state_dict(saved)
        opt.executor = executor
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        n_fused = len(fused_calls)
        opt.step()
        assert opt.last_executor == ("apex_C" if executor == "auto" else "torch")
        assert (len(fused_calls) > n_fused) == fused_expected(executor, "cpu", dtype)
        out[executor] = [(p.detach(), {n: v for n, v in opt.state[p].items() if n != "step"}) for p in ps]
    for executor in ("torch", "torch_ops"):
        for k, ((a, sa), (b, sb)) in enumerate(zip(out[executor], out["auto"])):
            for what, x, y in [("param", a, b), *((n, sa[n], sb[n]) for n in sb)]:
                if dtype == torch.float32:
                    torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7 * float(y.abs().max()))
                else:
                    assert_ulp(x, y, dtype, x.double().abs(), f"{executor} vs apex_C, param {k} {what}")


def test_executor_setting_is_validated():
    opt = NpuFusedAdam([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="executor must be one of"):
        opt.executor = "gpu"
    assert opt.executor == "auto"


# ------------------------------------------------------------------ semantics shared with the harness
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_with_backward(set_to_none, device):
    check_zero_grad(ADAM, dict(HP, amsgrad=False), set_to_none, device=device, ref_kind="torch")


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_state_dict_interchange_with_torch(name, device):
    check_torch_state_dict(SPECS[name], HP, device=device)


@pytest.mark.parametrize("executor", ["auto", "torch", "torch_ops"])
def test_resume_is_bitwise(executor, device):
    check_resume_bitwise(with_executor(ADAMW, executor), HP, device=device, executor=expected(executor, device))


def test_grad_scale_folded(device):
    """amp's folded unscale: the torch executors fall back from torch's fused op (which would unscale grads)."""
    check_grad_scale_folded(ADAM, HP, device=device)
    check_grad_scale_folded(with_executor(ADAMW, "torch"), HP, device=device)


def test_invalid_hyperparameters(device):
    bad = [
        (dict(lr=-1e-3), "learning rate"),
        (dict(eps=-1e-8), "epsilon"),
        (dict(betas=(1.0, 0.999)), "beta parameter at index 0"),
        (dict(betas=(-0.1, 0.999)), "beta parameter at index 0"),
        (dict(betas=(0.9, 1.5)), "beta parameter at index 1"),
        (dict(betas=(0.9,)), "betas"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(lr=float("nan")), "learning rate"),
    ]
    check_invalid(ADAM, bad, device=device)


def test_adam_and_adamw_state_dicts_do_not_mix():
    """decoupled_weight_decay is part of torch's state_dict: loading AdamW's into Adam is an error."""
    p = torch.nn.Parameter(torch.randn(3))
    sd = torch.optim.AdamW([p]).state_dict()
    with pytest.raises(ValueError, match="decoupled_weight_decay"):
        NpuFusedAdam([p]).load_state_dict(sd)
    NpuFusedAdamW([p]).load_state_dict(sd)


def test_defaults_are_torchs():
    p = torch.nn.Parameter(torch.randn(3))
    for ours, theirs in ((NpuFusedAdam, torch.optim.Adam), (NpuFusedAdamW, torch.optim.AdamW)):
        a, b = ours([p]).param_groups[0], theirs([p]).param_groups[0]
        for key in ("lr", "betas", "eps", "weight_decay", "amsgrad"):
            assert a[key] == b[key], key


def test_amsgrad_switched_on_mid_run(device):
    """Turning amsgrad on adds max_exp_avg_sq (starting from zeros, i.e. the current v) at the next step."""
    gen = torch.Generator().manual_seed(2)
    params = make_params([(4, 3), (6,)], torch.float32, device, gen)
    opt = NpuFusedAdam(params, lr=0.01)
    for step in range(6):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        if step == 3:
            opt.param_groups[0]["amsgrad"] = True
            before = {id(p): {n: v.double().clone() for n, v in opt.state[p].items() if n != "step"}
                      for p in params}
            prev = [p.detach().double().clone() for p in params]
            t = [int(opt.state[p]["step"]) for p in params]
        opt.step()
        if step == 3:
            for k, p in enumerate(params):
                exp = ref_adam(prev[k], p.grad.double(), before[id(p)], t[k], opt.param_groups[0], None)
                assert_close_rel(p, exp["param"], 1.0, f"param {k}")
                assert_close_rel(opt.state[p]["max_exp_avg_sq"], exp["max_exp_avg_sq"], 1.0, "max_exp_avg_sq")
