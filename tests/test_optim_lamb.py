"""NpuFusedLamb / Lamb against a float64 reference written from the formulas (ANCHORS.md section 2).

Reference per param (no bias correction)::

    g = grad * c            c = 1/||all grads|| if use_global_grad_norm and that norm > 1, else 1
    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
    u = m / (sqrt(v) + eps) + wd p
    r = min(||p||, 10) / ||u||   (1 if either norm is 0, or adam=True)
    p = p - lr r u

fp32: whole runs vs the float64 reference (rtol 1e-5). bf16/fp16: every step,
from our previous values: the stored m, v within 1 ulp of their float64 values;
the param within 1 ulp of the float64 update formed from the m, v we stored
(as both executors do by design: u is built from the stored moments, so a
1-ulp moment difference, large relative to a tiny fp16 v, is not charged to p
a second time).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
import sys
import types

import pytest
import torch

from apex import _core
from apex.optimizers import Lamb, NpuFusedLamb

pytestmark = pytest.mark.skipif(not _core.ext_available(), reason="apex_C extension not built")

LOW = (torch.bfloat16, torch.float16)

# two groups with different hyperparameters; 1-D, 2-D and 4-D params
GROUPS = [
    dict(shapes=[(6, 5), (17,), (3, 4, 2, 2)], lr=0.02, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01),
    dict(shapes=[(9, 7), (5,)], lr=0.05, betas=(0.8, 0.99), eps=1e-4, weight_decay=0.0),
]
NO_GRAD_STEPS = {(0, 1): (2, 3)}  # (group, param) -> steps at which that param has no grad


def flat(groups):
    return [p for ps in groups for p in ps]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at |x| (subnormal spacing below the smallest normal)."""
    fi = torch.finfo(dtype)
    a = x.abs().double().clamp_min(fi.smallest_normal)
    return torch.exp2(torch.floor(torch.log2(a))) * fi.eps


def assert_within_ulp(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    ours64 = ours.double().cpu()
    tol = ulp(torch.maximum(ours64.abs(), ref.abs()), dtype)
    err = (ours64 - ref).abs()
    bad = err > tol
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} elements off by more than 1 ulp of {dtype}; worst error "
        f"{float((err / tol).max()):.3f} ulp"
    )


def make_params(dtype=torch.float32, seed=0, scale=1.0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec in GROUPS:
        out.append([(torch.randn(s, generator=gen, dtype=torch.float64) * scale).to(device, dtype).requires_grad_()
                    for s in spec["shapes"]])
    return out


def select_executor(opt, executor: str, device: str) -> str:
    """executor "apex_C" (CPU kernels, the default there) or "torch" (torch ops on the flat buffers, as on
    other devices); returns the expected `last_executor`."""
    if executor == "apex_C" and device != "cpu":
        pytest.skip("the C++ kernels run on CPU buffers")
    opt.executor = "auto" if executor == "apex_C" else "torch"
    return executor


def group_dicts(params, **overrides):
    out = []
    for spec, ps in zip(GROUPS, params):
        g = {k: v for k, v in spec.items() if k != "shapes"}
        g.update(overrides)
        g["params"] = ps
        out.append(g)
    return out


def draw_grads(params, step, scale, dtype):
    gen = torch.Generator().manual_seed(1000 + step)
    grads = []
    for gi, ps in enumerate(params):
        row = []
        for pi, p in enumerate(ps):
            g = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale).to(p.device, dtype)
            row.append(None if step in NO_GRAD_STEPS.get((gi, pi), ()) else g)
        grads.append(row)
    return grads


def set_grads(params, grads):
    for ps, gs in zip(params, grads):
        for p, g in zip(ps, gs):
            if g is None:
                p.grad = None
            elif p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)  # in place: the combined grad views stay bound


class RefLamb:
    """float64 LAMB from the formulas; `low` rounds m, v to that dtype after each update."""

    def __init__(self, params, groups, adam, use_global):
        self.p = [[p.detach().double().cpu() for p in ps] for ps in params]
        self.m = [[torch.zeros_like(p) for p in ps] for ps in self.p]
        self.v = [[torch.zeros_like(p) for p in ps] for ps in self.p]
        self.steps = [[0 for _ in ps] for ps in self.p]
        self.groups, self.adam, self.use_global = groups, adam, use_global
        self.last_norm = None

    def step(self, grads, low=None, stored=None):
        """One update. `stored`: (m, v) lists the optimizer stored this step; u is then formed from them
        (the kernel forms u from its stored moments; those are checked against ours separately)."""
        flat = [g.double().cpu() for gs in grads for g in gs if g is not None]
        norm = math.sqrt(sum(float((g * g).sum()) for g in flat))
        self.last_norm = norm
        c = 1.0 / norm if self.use_global and norm > 1 else 1.0
        for gi, spec in enumerate(self.groups):
            b1, b2 = spec["betas"]
            for pi, g in enumerate(grads[gi]):
                if g is None:
                    continue
                g = g.double().cpu() * c
                p, m, v = self.p[gi][pi], self.m[gi][pi], self.v[gi][pi]
                m = b1 * m + (1 - b1) * g
                v = b2 * v + (1 - b2) * g * g
                if low is not None:
                    m, v = m.to(low).double(), v.to(low).double()
                self.m[gi][pi], self.v[gi][pi] = m, v
                if stored is not None:
                    m, v = stored[0][gi][pi].double().cpu(), stored[1][gi][pi].double().cpu()
                u = m / (v.sqrt() + spec["eps"]) + spec["weight_decay"] * p
                wn, un = min(float(p.norm()), 10.0), float(u.norm())
                r = 1.0 if (self.adam or wn == 0 or un == 0) else wn / un
                self.p[gi][pi] = p - spec["lr"] * r * u
                self.steps[gi][pi] += 1

    def load_from(self, opt, params):
        """Restart from the optimizer's current values (per-step low-precision checks)."""
        for gi, ps in enumerate(params):
            for pi, p in enumerate(ps):
                self.p[gi][pi] = p.detach().double().cpu()
                st = opt.state.get(p)
                if st:
                    self.m[gi][pi] = st["exp_avg"].double().cpu()
                    self.v[gi][pi] = st["exp_avg_sq"].double().cpu()


def check_states_fp32(opt, params, ref):
    for gi, ps in enumerate(params):
        for pi, p in enumerate(ps):
            atol = 1e-6 * max(1.0, float(ref.p[gi][pi].abs().max()))
            torch.testing.assert_close(p.detach().double().cpu(), ref.p[gi][pi], rtol=1e-5, atol=atol)
            st = opt.state[p]
            torch.testing.assert_close(st["exp_avg"].double().cpu(), ref.m[gi][pi], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(st["exp_avg_sq"].double().cpu(), ref.v[gi][pi], rtol=1e-5, atol=1e-9)
            assert int(st["step"]) == ref.steps[gi][pi]


# --------------------------------------------------------------------------- fp32 vs float64
@pytest.mark.parametrize(
    "adam,use_global,gscale",
    [(False, False, 1.0), (False, True, 4.0), (False, True, 0.01), (True, False, 1.0), (True, True, 4.0)],
    ids=["lamb", "global-norm>1", "global-norm<1", "adam", "adam-global"],
)
@pytest.mark.parametrize("executor", ["apex_C", "torch"])
def test_fp32_matches_float64_reference(adam, use_global, gscale, executor, device):
    params = make_params(device=device)
    opt = NpuFusedLamb(group_dicts(params), adam=adam, use_global_grad_norm=use_global)
    executor = select_executor(opt, executor, device)
    ref = RefLamb(params, GROUPS, adam, use_global)
    for step in range(12):
        grads = draw_grads(params, step, gscale, torch.float32)
        set_grads(params, grads)
        opt.step()
        ref.step(grads)
        assert opt.last_executor == executor
        # user grads are left as they are (the global-norm divisor is applied inside the update)
        for ps, gs in zip(params, grads):
            for p, g in zip(ps, gs):
                if g is not None:
                    assert torch.equal(p.grad, g)
    if use_global:  # the branch under test was taken
        assert (ref.last_norm > 1) == (gscale > 1)
    check_states_fp32(opt, params, ref)
    assert opt.recombine_count == 1 + 1  # first combine + the new grad object after the `grad = None` gap


def test_weight_norm_clamp_and_zero_norms():
    """||p|| > 10 is clamped; a zero param or a zero update gets ratio 1."""
    big = (torch.randn(40, 5, dtype=torch.float64) * 5).float().requires_grad_()  # ||p|| ~ 70
    zero_p = torch.zeros(8, requires_grad=True)
    still = torch.zeros(6, requires_grad=True)  # zero param, zero grad: u = 0, stays 0
    opt = NpuFusedLamb([big, zero_p, still], lr=0.1, weight_decay=0.1)
    spec = [dict(lr=0.1, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1)]
    ref = RefLamb([[big, zero_p, still]], spec, adam=False, use_global=False)
    for _ in range(3):
        grads = [[torch.randn(40, 5), torch.randn(8), torch.zeros(6)]]
        set_grads([[big, zero_p, still]], grads)
        opt.step()
        ref.step(grads)
    assert float(big.detach().norm()) > 10
    for ours, theirs in zip((big, zero_p, still), ref.p[0]):
        torch.testing.assert_close(ours.detach().double(), theirs, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(still) == 0


def test_eps_zero():
    """eps=0 is accepted (as by the seed): the zero gaps between slots must stay out of the norms
    (their update would be 0/0)."""
    params = make_params()
    groups = [dict(spec, eps=0.0) for spec in GROUPS]
    opt = NpuFusedLamb(group_dicts(params, eps=0.0))
    ref = RefLamb(params, groups, adam=False, use_global=False)
    for step in range(3):
        grads = draw_grads(params, step, 1.0, torch.float32)
        set_grads(params, grads)
        opt.step()
        ref.step(grads)
    check_states_fp32(opt, params, ref)


# --------------------------------------------------------------------------- bf16 / fp16 per step
@pytest.mark.parametrize("executor", ["apex_C", "torch"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("use_global", [False, True])
def test_low_precision_each_step_within_one_ulp(dtype, use_global, executor, device):
    """Both executors meet the same per-step contract. (Comparing the two executors' low-precision runs
    with each other over several steps is not meaningful: a 1-ulp difference in a stored moment, e.g. from
    torch's fused multiply-add, persists in the moving average.)"""
    params = make_params(dtype, device=device)
    opt = NpuFusedLamb(group_dicts(params), use_global_grad_norm=use_global)
    executor = select_executor(opt, executor, device)
    ref = RefLamb(params, GROUPS, adam=False, use_global=use_global)
    for step in range(6):
        ref.load_from(opt, params)
        grads = draw_grads(params, step, 3.0, dtype)
        set_grads(params, grads)
        opt.step()
        assert opt.last_executor == executor
        stored = tuple([[opt.state[p][k] if p in opt.state else None for p in ps] for ps in params]
                       for k in ("exp_avg", "exp_avg_sq"))
        ref.step(grads, low=dtype, stored=stored)
        for gi, ps in enumerate(params):
            for pi, p in enumerate(ps):
                if grads[gi][pi] is None:
                    continue
                st = opt.state[p]
                assert p.dtype == st["exp_avg"].dtype == dtype
                assert_within_ulp(st["exp_avg"], ref.m[gi][pi], dtype, f"exp_avg {gi}.{pi} step {step}")
                assert_within_ulp(st["exp_avg_sq"], ref.v[gi][pi], dtype, f"exp_avg_sq {gi}.{pi} step {step}")
                assert_within_ulp(p.detach(), ref.p[gi][pi], dtype, f"param {gi}.{pi} step {step}")


# --------------------------------------------------------------------------- executors
def _run(params, steps, executor="auto", **kw):
    opt = NpuFusedLamb(group_dicts(params), **kw)
    opt.executor = executor
    for step in range(steps):
        set_grads(params, draw_grads(params, step, 4.0, torch.float32))
        opt.step()
    return opt


KWS = dict(argnames="kw", argvalues=[dict(), dict(use_global_grad_norm=True), dict(adam=True)],
           ids=["lamb", "global", "adam"])


@pytest.mark.parametrize(**KWS)
def test_torch_executor_equals_kernel(kw, monkeypatch):
    pk = make_params()
    ok = _run(pk, 6, **kw)
    assert ok.last_executor == "apex_C"
    pt = make_params()
    ot = _run(pt, 6, executor="torch", **kw)
    assert ot.last_executor == "torch"
    # also as on a machine without the extension (flat sets without kernel arguments)
    pn = make_params()
    monkeypatch.setattr(_core, "uses_kernel", lambda *tensors: False)
    on = _run(pn, 6, **kw)
    assert on.last_executor == "torch"
    for a, b in zip(flat(pt), flat(pn)):
        assert torch.equal(a, b)
    for a, b in zip(flat(pk), flat(pt)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
        for name, atol in (("exp_avg", 1e-7), ("exp_avg_sq", 1e-9)):  # m may cancel to ~0: absolute floor
            torch.testing.assert_close(ok.state[a][name], ot.state[b][name], rtol=1e-5, atol=atol)


@pytest.mark.parametrize(**KWS)
def test_reference_class_matches_fused(kw, device):
    pf, pr = make_params(device=device), make_params(device=device)
    of = NpuFusedLamb(group_dicts(pf), **kw)
    orf = Lamb(group_dicts(pr), **kw)
    for step in range(6):
        grads = draw_grads(pf, step, 4.0, torch.float32)
        set_grads(pf, grads)
        set_grads(pr, grads)
        of.step()
        orf.step()
    for a, b in zip(flat(pf), flat(pr)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
        assert set(orf.state[b]) >= {"step", "exp_avg", "exp_avg_sq", "weight_norm", "adam_norm", "trust_ratio"}
        assert int(of.state[a]["step"]) == int(orf.state[b]["step"])


def test_folded_unscale_uses_unscaled_global_norm(device):
    """amp's apex_grad_scale: grads stored x S and multiplied by 1/S inside the step; the global norm is the
    unscaled one."""
    s = 1024.0
    pa, pb = make_params(device=device), make_params(device=device)
    oa = NpuFusedLamb(group_dicts(pa), use_global_grad_norm=True)
    ob = NpuFusedLamb(group_dicts(pb), use_global_grad_norm=True)
    ob.apex_grad_scale = 1.0 / s
    for step in range(4):
        grads = draw_grads(pa, step, 2.0, torch.float32)
        set_grads(pa, grads)
        set_grads(pb, [[None if g is None else g * s for g in gs] for gs in grads])
        oa.step()
        ob.step()
    for a, b in zip(flat(pa), flat(pb)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_state_dict_resume_is_bitwise(device):
    full = make_params(device=device)
    o_full = NpuFusedLamb(group_dicts(full), use_global_grad_norm=True)
    half = make_params(device=device)
    o_half = NpuFusedLamb(group_dicts(half), use_global_grad_norm=True)
    for step in range(3):
        set_grads(full, draw_grads(full, step, 3.0, torch.float32))
        o_full.step()
        set_grads(half, draw_grads(half, step, 3.0, torch.float32))
        o_half.step()
    sd = copy.deepcopy(o_half.state_dict())
    assert sd["param_groups"][0]["use_global_grad_norm"] is True and sd["param_groups"][0]["adam"] is False
    resumed = [[p.detach().clone().requires_grad_() for p in ps] for ps in half]
    o_res = NpuFusedLamb(group_dicts(resumed), use_global_grad_norm=True)
    o_res.load_state_dict(sd)
    for step in range(3, 6):
        set_grads(full, draw_grads(full, step, 3.0, torch.float32))
        o_full.step()
        set_grads(resumed, draw_grads(resumed, step, 3.0, torch.float32))
        o_res.step()
    for a, b in zip(flat(full), flat(resumed)):
        assert torch.equal(a, b)
        assert torch.equal(o_full.state[a]["exp_avg_sq"], o_res.state[b]["exp_avg_sq"])


def test_states_are_views_of_flat_buffers_and_stay_combined():
    params = make_params()
    opt = NpuFusedLamb(group_dicts(params))
    grads = draw_grads(params, 100, 1.0, torch.float32)  # step 100: every param has a grad
    set_grads(params, grads)
    for _ in range(5):
        opt.step()
        for ps in params:
            for p in ps:
                p.grad.mul_(0.9)  # in place: nothing to heal
    assert opt.recombine_count == 1
    for ps in params:
        keys = {p.untyped_storage().data_ptr() for p in ps}
        keys_m = {opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in ps}
        keys_g = {p.grad.untyped_storage().data_ptr() for p in ps}
        assert len(keys) == len(keys_m) == len(keys_g) == 1


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kw,exc",
    [
        (dict(lr=-1e-3), ValueError),
        (dict(eps=-1.0), ValueError),
        (dict(betas=(1.0, 0.999)), ValueError),
        (dict(betas=(0.9, -0.1)), ValueError),
        (dict(betas=(0.9,)), ValueError),
        (dict(weight_decay=-0.1), ValueError),
        (dict(adam="yes"), TypeError),
        (dict(use_global_grad_norm=1), TypeError),
    ],
)
@pytest.mark.parametrize("cls", [NpuFusedLamb, Lamb])
def test_invalid_arguments(cls, kw, exc):
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(exc):
        cls([p], **kw)
    opt = cls([p])
    q = torch.zeros(2, requires_grad=True)
    with pytest.raises(exc):
        opt.add_param_group(dict(params=[q], **kw))
    assert len(opt.param_groups) == 1


def test_bad_params_and_grads_leave_state_unchanged():
    with pytest.raises(TypeError, match="floating point"):
        NpuFusedLamb([torch.zeros(3, dtype=torch.int64)])
    p = torch.randn(4, 3, requires_grad=True)
    before = p.detach().clone()
    opt = NpuFusedLamb([p], lr=0.1)
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(p.detach(), before)
    assert len(opt.state) == 0


# --------------------------------------------------------------------------- timm (optional outside peer)
def _import_timm_module(name):
    """timm's optimizer files need only torch; `import timm` itself pulls torchvision, so it is bypassed."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("timm is not installed (optional outside peer)")
    root = next(iter(spec.submodule_search_locations))
    saved = {k: sys.modules.get(k) for k in ("timm", "timm.optim")}
    try:
        for pkg, path in (("timm", root), ("timm.optim", os.path.join(root, "optim"))):
            if pkg not in sys.modules:
                mod = types.ModuleType(pkg)
                mod.__path__ = [path]
                sys.modules[pkg] = mod
        return importlib.import_module(f"timm.optim.{name}")
    except Exception as exc:  # pragma: no cover - depends on the installed timm
        pytest.skip(f"timm.optim.{name} cannot be imported here: {exc}")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


@pytest.mark.parametrize("use_global", [False, True])
def test_matches_timm_lamb(use_global):
    """timm's Lamb with bias_correction=False, always_adapt=True and max_grad_norm=1 (or None) is the same
    algorithm as long as ||p|| < 10 (timm does not clamp the weight norm)."""
    timm_lamb = _import_timm_module("lamb")
    pa, pb = make_params(scale=0.5), make_params(scale=0.5)
    spec = GROUPS[0]
    ours = NpuFusedLamb(pa[0], lr=spec["lr"], eps=spec["eps"], weight_decay=spec["weight_decay"],
                        use_global_grad_norm=use_global)
    theirs = timm_lamb.Lamb(pb[0], lr=spec["lr"], eps=spec["eps"], weight_decay=spec["weight_decay"],
                            bias_correction=False, always_adapt=True, max_grad_norm=1.0 if use_global else None)
    for step in range(6):
        grads = draw_grads(pa, step, 3.0, torch.float32)[:1]
        set_grads(pa[:1], grads)
        set_grads(pb[:1], grads)
        ours.step()
        theirs.step()
    for a, b in zip(pa[0], pb[0]):
        assert float(b.detach().norm()) < 10
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
