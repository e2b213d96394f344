"""Shared checks for the fused optimizers' tests (imported by tests/test_optim_*.py).

An optimizer under test is described by a `Spec`: our class, its torch.optim
equivalent (if torch has one) and a float64 reference step written from the
formulas in the test file. The checks drive our optimizer and a reference
side by side; the reference always receives copies of *our* grads, so both
see exactly the same inputs whatever the grads came from (random draws,
backward through a model, None for skipped params).

Reference step signature: ``ref(p, g, st, t, hp, new) -> dict`` with float64
tensors: ``p``/``g`` the param and grad before the update, ``st`` the states
before it (``{}`` at a param's first update), ``t`` the number of updates the
param had before this one, ``hp`` the param group. It returns ``"param"`` and
every state. ``new`` (or None) holds the states our optimizer stored in this
step: the fused kernels read a state back *as stored* after writing it, so in
low precision the reference uses those values for the terms computed after
the state update. Every stored value is then checked to be the correctly
rounded result of its stored inputs (within 1 ulp).
"""

from __future__ import annotations

import copy
import inspect
import random
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from apex import _core
from apex.optimizers import CombinedOptimizer

LOW = (torch.bfloat16, torch.float16)
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
RTOL = 1e-5


@dataclass
class Spec:
    ours: type
    ref: Callable[..., Dict[str, torch.Tensor]]
    draw: Callable[[random.Random], dict]  # random hyperparameters (our keyword names)
    torch_cls: Optional[type] = None
    has_step: bool = True
    state_fill: Dict[str, float] = field(default_factory=dict)
    #: kwargs every constructor needs (e.g. a required lr)
    base: Dict[str, float] = field(default_factory=dict)


# ------------------------------------------------------------------ helpers
def expected_executor(device: str) -> str:
    return "apex_C" if device == "cpu" else "torch"


def use_executor(monkeypatch, executor: str, device: str) -> str:
    """Select the executor as if the extension were unusable; returns the expected `last_executor`.

    "apex_C": the C++ kernels (CPU only). "torch": torch on the flat buffers, as non-CPU devices
    and a missing extension run it (torch's own fused op where it has one). "torch_ops": the same
    without torch's fused ops (plain torch ops only).
    """
    if executor == "apex_C" and device != "cpu":
        pytest.skip("the C++ kernels run on CPU buffers")
    if executor in ("torch", "torch_ops"):
        monkeypatch.setattr(_core, "uses_kernel", lambda *tensors: False)
    if executor == "torch_ops":
        monkeypatch.setattr(CombinedOptimizer, "_torch_fused_allowed", lambda self: False)
    return "apex_C" if executor == "apex_C" else "torch"


def random_shapes(rng: random.Random, n: Optional[int] = None) -> List[Tuple[int, ...]]:
    n = rng.randint(3, 6) if n is None else n
    shapes = []
    for _ in range(n):
        rank = rng.choice([0, 1, 1, 2, 2, 3])
        shapes.append(tuple(rng.randint(1, 9) for _ in range(rank)))
    return shapes


def make_params(shapes, dtype, device, gen: torch.Generator, scale: float = 1.0) -> List[torch.Tensor]:
    out = []
    for s in shapes:
        t = (torch.randn(s, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)
        out.append(torch.nn.Parameter(t))
    return out


def set_grad(p: torch.Tensor, g: Optional[torch.Tensor]) -> None:
    """Writes into the existing grad when there is one (keeps our combined views), else binds a new tensor."""
    if g is None:
        p.grad = None
    elif p.grad is None:
        p.grad = g.detach().clone().to(dtype=p.dtype)
    else:
        p.grad.copy_(g)


def mirror_grads(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    for p, q in zip(src, dst):
        q.grad = None if p.grad is None else p.grad.detach().to(dtype=q.dtype).clone()


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` values at |x| (float64), subnormal spacing below the smallest normal."""
    tiny = torch.finfo(dtype).tiny
    _, e = torch.frexp(x.double().abs().clamp(min=tiny))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), e - 1 - MANTISSA[dtype])


def assert_ulp(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor, what: str) -> None:
    """|ours - ref| <= 1 ulp of `dtype`, plus fp32 evaluation slack relative to the operands' size `scale`.

    The kernels compute in fp32 (torch's opmath), so the exact result is known to them only up
    to a few fp32 roundings of the operands; that matters only under cancellation.
    """
    ours64 = ours.detach().double().reshape(-1)
    ref64 = ref.detach().double().reshape(-1)
    assert torch.isfinite(ours64).all(), f"{what}: non-finite values"
    tol = torch.maximum(ulp(ref64, dtype), ulp(ours64, dtype)) + 2.0**-21 * scale.double().reshape(-1)
    err = (ours64 - ref64).abs()
    bad = err > tol
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements beyond 1 ulp ({dtype}); first at {i}: "
            f"ours {ours64[i].item()!r}, reference {ref64[i].item()!r}, tolerance {tol[i].item()!r}"
        )


def assert_close_rel(ours: torch.Tensor, ref: torch.Tensor, atol_scale: float, what: str) -> None:
    """The issue's fp32 criterion: rtol 1e-5, atol 1e-6 * (size of the initial values)."""
    torch.testing.assert_close(
        ours.detach().double().cpu(), ref.detach().double().cpu(), rtol=RTOL, atol=1e-6 * atol_scale,
        msg=lambda m: f"{what}: {m}",
    )


# -------------------------------------------------------- float64 reference
class RefOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer running a Spec's float64 reference step per param (torch's skip rule)."""

    def __init__(self, params, spec: Spec, defaults: dict):
        self._spec = spec
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                t = int(st["step"]) if "step" in st else int(st.get("_count", 0))
                prev = {k: v for k, v in st.items() if k not in ("step", "_count")}
                out = self._spec.ref(p.double(), p.grad.double(), prev, t, group, None)
                p.copy_(out.pop("param"))
                if self._spec.has_step:
                    st["step"] = torch.tensor(float(t + 1))
                else:
                    st["_count"] = t + 1
                st.update(out)


def reference_for(spec: Spec, groups, kind: str):
    """'torch': spec.torch_cls as is; 'f64': the float64 reference optimizer."""
    if kind == "torch":
        return spec.torch_cls(groups, **spec.base)
    # the same defaults as our class's signature
    sig = inspect.signature(spec.ours).parameters.values()
    defaults = {a.name: a.default for a in sig if a.default is not inspect.Parameter.empty}
    return RefOptimizer(groups, spec, dict(defaults, **spec.base))


def group_dicts(params: Sequence[torch.Tensor], layout: Sequence[Tuple[int, dict]]) -> List[dict]:
    """Splits params into consecutive groups: layout = [(count, hyperparameters), ...]."""
    groups, i = [], 0
    for n, hp in layout:
        groups.append(dict(hp, params=list(params[i:i + n])))
        i += n
    return groups


def assert_states(ours, ours_params, ref, ref_params, what: str, exact_keys: bool = True) -> None:
    for k, (p, q) in enumerate(zip(ours_params, ref_params)):
        sa = {n: v for n, v in ours.state.get(p, {}).items()}
        sb = {n: v for n, v in ref.state.get(q, {}).items() if n != "_count"}
        keys_a, keys_b = (list(sa), list(sb)) if exact_keys else (sorted(sa), sorted(sb))
        assert keys_a == keys_b, f"{what}: param {k} state keys {keys_a} != reference {keys_b}"
        for n, v in sb.items():
            if n == "step":
                assert float(sa[n]) == float(v), f"{what}: param {k} step {float(sa[n])} != {float(v)}"
                continue
            scale = max(float(v.detach().double().abs().max()), 1e-30) if v.numel() else 1.0
            assert sa[n].dtype == p.dtype and sa[n].shape == p.shape, f"{what}: param {k} state {n} layout"
            assert_close_rel(sa[n], v, scale, f"{what}: param {k} state {n!r}")


# ------------------------------------------------------------------ checks
def run_side_by_side(
    spec: Spec,
    layout: Sequence[Tuple[int, dict]],
    *,
    device: str,
    seed: int,
    ref_kind: str,
    steps: int = 30,
    shapes=None,
    skip: Callable[[int, int], bool] = lambda step, k: False,
    frozen: Sequence[int] = (),
    between: Optional[Callable[[int, object, object], None]] = None,
    gscale: Optional[Callable[[int], float]] = None,
):
    """Runs ours and a reference for `steps` steps on the same random grads; asserts params/states match.

    ``skip(step, k)``: param k has grad None at that step. ``frozen``: params with requires_grad=False.
    ``between(step, ours, ref)``: called before each step (LR schedulers, hyperparameter changes).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n = sum(c for c, _ in layout)
    shapes = shapes or random_shapes(rng, n)
    ref_dtype = torch.float32 if ref_kind == "torch" else torch.float64
    p0 = make_params(shapes, torch.float32, "cpu", gen)
    ours_params = [torch.nn.Parameter(t.detach().clone().to(device)) for t in p0]
    ref_params = [torch.nn.Parameter(t.detach().clone().to(device=device, dtype=ref_dtype)) for t in p0]
    for k in frozen:
        ours_params[k].requires_grad_(False)
        ref_params[k].requires_grad_(False)
    ours = spec.ours(group_dicts(ours_params, layout), **spec.base)
    ref = reference_for(spec, group_dicts(ref_params, layout), ref_kind)
    p0max = max(float(t.detach().abs().max()) for t in p0 if t.numel())
    gscale = gscale or (lambda k: 1.0)
    for step in range(steps):
        if between is not None:
            between(step, ours, ref)
        for k, p in enumerate(ours_params):
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64) * gscale(k)
            set_grad(p, None if (k in frozen or skip(step, k)) else g.to(device=device, dtype=torch.float32))
        mirror_grads(ours_params, ref_params)
        ours.step()
        ref.step()
        assert ours.last_executor in ("apex_C", "torch")
    for k, (p, q) in enumerate(zip(ours_params, ref_params)):
        assert_close_rel(p, q, p0max, f"param {k}")
    # torch's key order too; the float64 reference's dicts are compared as sets
    assert_states(ours, ours_params, ref, ref_params, "states", exact_keys=ref_kind == "torch")
    return ours, ours_params, ref, ref_params


def check_low_precision(spec: Spec, hp: dict, dtype: torch.dtype, *, device: str, seed: int, steps: int = 30,
                        gscale: float = 1.0, skip: Callable[[int, int], bool] = lambda step, k: False):
    """Per step, every stored value within 1 ulp of the float64 update from our previous values."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    params = make_params(random_shapes(rng), dtype, device, gen)
    opt = spec.ours(params, **dict(spec.base, **hp))
    group = opt.param_groups[0]
    for step in range(steps):
        prev = []
        for k, p in enumerate(params):
            st = opt.state.get(p, {})
            t = int(st["step"]) if "step" in st else 0
            prev.append((p.detach().double().clone(), {n: v.double().clone() for n, v in st.items() if n != "step"}, t))
            g = None if skip(step, k) else (torch.randn(p.shape, generator=gen) * gscale).to(device=device, dtype=dtype)
            set_grad(p, g)
        opt.step()
        for k, p in enumerate(params):
            p_prev, st_prev, t = prev[k]
            if p.grad is None:
                assert torch.equal(p.detach().double(), p_prev), f"step {step}: param {k} without grad changed"
                continue
            st_new = {n: v.double() for n, v in opt.state[p].items() if n != "step"}
            exp = spec.ref(p_prev, p.grad.double(), st_prev, t, group, st_new)
            assert_ulp(p, exp["param"], dtype, p_prev.abs() + exp["param"].abs(), f"step {step} param {k}")
            for n, v in st_new.items():
                scale = exp[n].abs() + (st_prev[n].abs() if n in st_prev else spec.state_fill.get(n, 0.0))
                assert_ulp(v, exp[n], dtype, scale, f"step {step} param {k} state {n!r}")
            assert sorted(st_new) == sorted(n for n in exp if n != "param")
    return opt


def check_zero_grad(spec: Spec, hp: dict, set_to_none: bool, *, device: str, ref_kind: str, steps: int = 6):
    """Grads from backward through a model, zeroed either way between steps; ours vs the reference."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(device)
    ref_dtype = torch.float32 if ref_kind == "torch" else torch.float64
    ref_model = copy.deepcopy(model).to(ref_dtype)
    ours = spec.ours(model.parameters(), **dict(spec.base, **hp))
    ref = reference_for(spec, [dict(hp, params=list(ref_model.parameters()))], ref_kind)
    x = torch.randn(11, 5, device=device)
    p0max = max(float(p.detach().abs().max()) for p in model.parameters())
    for step in range(steps):
        ours.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            assert all(p.grad is None for p in model.parameters())
        elif step:
            assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        model(x * (1 + step)).pow(2).mean().backward()
        mirror_grads(list(model.parameters()), list(ref_model.parameters()))
        ours.step()
        ref.step()
        assert ours.last_executor == expected_executor(device)
    for k, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters())):
        assert_close_rel(p, q, p0max, f"param {k}")


def check_grad_scale_folded(spec: Spec, hp: dict, *, device: str, steps: int = 5):
    """apex_grad_scale (amp's folded unscale) = the same step on unscaled grads; p.grad is left scaled."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(4, 3), (5,), ()]
    a = make_params(shapes, torch.float32, device, gen)
    b = [torch.nn.Parameter(t.detach().clone()) for t in a]
    oa = spec.ours(a, **dict(spec.base, **hp))
    ob = spec.ours(b, **dict(spec.base, **hp))
    for _ in range(steps):
        for p, q in zip(a, b):
            g = torch.randn(p.shape, generator=gen).to(device)
            set_grad(p, g * 1024.0)
            set_grad(q, g)
        oa.apex_grad_scale = 1.0 / 1024.0
        oa.step()
        ob.step()
        for p, q in zip(a, b):
            assert torch.equal(p.grad, q.grad * 1024.0), "the scaled grads must be left as they were"
    for k, (p, q) in enumerate(zip(a, b)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"param {k}: {m}")


def check_invalid(spec: Spec, bad: Sequence[Tuple[dict, str]], *, device: str) -> None:
    """Each bad hyperparameter: ValueError naming what was expected and received; nothing changes."""
    p = torch.nn.Parameter(torch.randn(3, device=device))
    q = torch.nn.Parameter(torch.randn(2, device=device))
    for kwargs, pattern in bad:
        with pytest.raises(ValueError, match=pattern) as info:
            spec.ours([p], **dict(spec.base, **kwargs))
        msg = str(info.value)
        assert "expected" in msg and "got" in msg, f"error lacks expected/received: {msg}"
    opt = spec.ours([p], **spec.base)
    p.grad = torch.randn_like(p)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    p_before = p.detach().clone()
    for kwargs, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            opt.add_param_group(dict(kwargs, params=[q]))
        assert len(opt.param_groups) == 1
        sd = copy.deepcopy(before)
        sd["param_groups"][0].update(kwargs)
        with pytest.raises(ValueError, match=pattern):
            opt.load_state_dict(sd)
        assert_same_state_dict(opt.state_dict(), before)
    opt.step()  # still usable, and the failed calls changed nothing it uses
    assert not torch.equal(p.detach(), p_before)


def assert_same_state_dict(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert list(a["state"]) == list(b["state"])
    for k in a["state"]:
        assert list(a["state"][k]) == list(b["state"][k])
        for n, v in a["state"][k].items():
            w = b["state"][k][n]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, f"state {k} {n}"


def check_resume_bitwise(spec: Spec, hp: dict, *, device: str, executor: str, steps: int = 8) -> None:
    """state_dict mid-run, load into a fresh optimizer: the rest of the run is bit-for-bit the same."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(6, 4), (3,), (2, 2, 2)]
    p0 = make_params(shapes, torch.float32, device, gen)
    grads = [[torch.randn(s, generator=gen).to(device) for s in shapes] for _ in range(steps)]
    a = [torch.nn.Parameter(t.detach().clone()) for t in p0]
    oa = spec.ours(a, **dict(spec.base, **hp))
    b = [torch.nn.Parameter(t.detach().clone()) for t in p0]
    ob = spec.ours(b, **dict(spec.base, **hp))
    for i in range(steps):
        for p, q, g in zip(a, b, grads[i]):
            set_grad(p, g)
            set_grad(q, g)
        oa.step()
        ob.step()
        if i == steps // 2:
            saved = copy.deepcopy(ob.state_dict())
            b = [torch.nn.Parameter(q.detach().clone()) for q in b]
            ob = spec.ours(b, **dict(spec.base, **hp))
            ob.load_state_dict(saved)
    assert ob.last_executor == executor
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    for p, q in zip(a, b):
        for n, v in oa.state[p].items():
            assert torch.equal(v, ob.state[q][n]), n


def check_torch_state_dict(spec: Spec, hp: dict, *, device: str, steps: int = 5) -> None:
    """Same state_dict layout as torch.optim; torch -> ours and ours -> torch continue as torch would."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(5, 3), (4,), ()]
    p0 = make_params(shapes, torch.float32, device, gen)
    grads = [[torch.randn(s, generator=gen).to(device) for s in shapes] for _ in range(2 * steps)]

    def run(opt, params, span):
        for i in span:
            for p, g in zip(params, grads[i]):
                set_grad(p, g)
            opt.step()

    def fresh(cls, **kw):
        params = [torch.nn.Parameter(t.detach().clone()) for t in p0]
        return cls(params, **dict(spec.base, **hp, **kw)), params

    ours, po = fresh(spec.ours)
    ref, pr = fresh(spec.torch_cls)
    run(ours, po, range(steps))
    run(ref, pr, range(steps))
    so, sr = ours.state_dict(), ref.state_dict()
    assert [list(g) for g in so["param_groups"]] == [list(g) for g in sr["param_groups"]]
    assert so["param_groups"] == sr["param_groups"]
    assert list(so["state"]) == list(sr["state"])
    for k in sr["state"]:
        assert list(so["state"][k]) == list(sr["state"][k])
        for n, v in sr["state"][k].items():
            w = so["state"][k][n]
            assert type(w) is type(v) and w.dtype == v.dtype and w.shape == v.shape, (k, n)
            # compact: a saved entry holds only its own elements, not the combined buffer
            assert w.untyped_storage().nbytes() == w.numel() * w.element_size(), (k, n)
    p_mid = [p.detach().clone() for p in pr]

    # torch -> ours
    ours2, po2 = fresh(spec.ours)
    with torch.no_grad():
        for p, t in zip(po2, p_mid):
            p.copy_(t)
    ours2.load_state_dict(copy.deepcopy(sr))
    # ours -> torch
    ref2, pr2 = fresh(spec.torch_cls)
    with torch.no_grad():
        for p, t in zip(pr2, po):
            p.copy_(t)
    ref2.load_state_dict(copy.deepcopy(so))
    run(ref, pr, range(steps, 2 * steps))
    run(ours2, po2, range(steps, 2 * steps))
    run(ref2, pr2, range(steps, 2 * steps))
    p0max = max(float(t.detach().abs().max()) for t in p0)
    for k in range(len(p0)):
        assert_close_rel(po2[k], pr[k], p0max, f"torch -> ours: param {k}")
        assert_close_rel(pr2[k], pr[k], p0max, f"ours -> torch: param {k}")
    assert_states(ours2, po2, ref, pr, "torch -> ours")


def lr_schedule_hook(kind: str):
    """`between` hook attaching the same LR scheduler to both optimizers and stepping it each step."""
    made = {}

    def between(step, ours, ref):
        if not made:
            for name, opt in (("ours", ours), ("ref", ref)):
                if kind == "step":
                    made[name] = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.3)
                else:
                    made[name] = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
        elif step:
            made["ours"].step()
            made["ref"].step()
            assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]

    return between
