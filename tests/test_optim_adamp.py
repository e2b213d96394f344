"""NpuFusedAdamP against a float64 reference written from the formulas (Heo et al. 2021; ANCHORS.md section 2).

Reference per param at its own step t::

    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
    d = (nesterov ? b1 m + (1-b1) g : m) / (sqrt(v) / sqrt(1-b2^t) + eps)
    for dim > 1, views channel = p.view(p.size(0), -1), then layer = p.view(1, -1):
        cos_r = |g_r.p_r| / (max(||g_r||, eps) max(||p_r||, eps))        (torch's cosine_similarity)
        if max_r cos_r < delta / sqrt(row length):
            p_n = p_r / (||p_r|| + eps);  d_r -= p_n <p_n, d_r>;  ratio = wd_ratio;  stop
    p = p (1 - lr wd ratio) - lr / (1-b1^t) d

Grads are built from the current params so that each branch fires: rows
orthogonal to the param's rows (channel), orthogonal only as a whole (layer),
or correlated with the param (no projection); 1-D params never project.

fp32: whole runs vs the reference (rtol 1e-5). bf16/fp16: every step, from our
previous values, m and v within 1 ulp of their float64 values and the param
within 1 ulp of the float64 update formed from the m, v we stored (both
executors form the perturbation from the stored moments).
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
from apex.optimizers import NpuFusedAdamP

pytestmark = pytest.mark.skipif(not _core.ext_available(), reason="apex_C extension not built")

LOW = (torch.bfloat16, torch.float16)

GROUPS = [
    dict(shapes=[(6, 5), (6,), (3, 4, 2, 2), (8, 3)], kinds=["channel", "1d", "layer", "none"],
         lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, delta=0.1, wd_ratio=0.1, nesterov=False),
    dict(shapes=[(5, 4), (7,), (4, 6)], kinds=["channel", "1d", "layer"],
         lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, delta=0.2, wd_ratio=0.3, nesterov=True),
]
NO_GRAD_STEPS = {(0, 3): (2, 3), (1, 0): (1,)}  # (group, param) -> steps without a grad
OPTS = ("lr", "betas", "eps", "weight_decay", "delta", "wd_ratio", "nesterov")


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


def make_params(dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
             for s in spec["shapes"]] for spec in GROUPS]


def select_executor(opt, executor: str, device: str) -> str:
    """executor "apex_C" (CPU kernels, the default there) or "torch" (torch ops on the flat buffers, as on
    other devices); returns the expected `last_executor`."""
    if executor == "apex_C" and device != "cpu":
        pytest.skip("the C++ kernels run on CPU buffers")
    opt.executor = "auto" if executor == "apex_C" else "torch"
    return executor


def group_dicts(params, groups=GROUPS):
    return [dict({k: spec[k] for k in OPTS}, params=ps) for spec, ps in zip(groups, params)]


def shaped_grad(p: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
    """A random grad whose cosine similarity with `p` makes the `kind` branch fire."""
    p = p.detach().double().cpu()
    r = torch.randn(p.shape, generator=gen, dtype=torch.float64)
    if kind == "channel":  # every row orthogonal to the param's row
        pr, rr = p.reshape(p.shape[0], -1), r.reshape(p.shape[0], -1)
        rr -= pr * (rr * pr).sum(1, keepdim=True) / (pr * pr).sum(1, keepdim=True)
    elif kind == "layer":  # orthogonal as a whole only
        r -= p * (r * p).sum() / (p * p).sum()
    elif kind == "none":  # clearly aligned with the param
        r += 3 * p / p.pow(2).mean().sqrt()
    return r


def draw_grads(params, step, dtype):
    gen = torch.Generator().manual_seed(2000 + step)
    grads = []
    for gi, (spec, ps) in enumerate(zip(GROUPS, params)):
        row = []
        for pi, (p, kind) in enumerate(zip(ps, spec["kinds"])):
            g = shaped_grad(p, kind, gen).to(p.device, dtype)
            row.append(None if step in NO_GRAD_STEPS.get((gi, pi), ()) else g)
        grads.append(row)
    return grads


def set_grads(params, grads, scale=1.0):
    for ps, gs in zip(params, grads):
        for p, g in zip(ps, gs):
            if g is None:
                p.grad = None
            elif p.grad is None:
                p.grad = g * scale
            else:
                p.grad.copy_(g * scale)  # in place: the combined grad views stay bound


def _cos(g, p, eps):
    return (g * p).sum(1).abs() / (g.norm(dim=1).clamp_min(eps) * p.norm(dim=1).clamp_min(eps))


class RefAdamP:
    """float64 AdamP from the formulas; `low` rounds m, v to that dtype after each update."""

    def __init__(self, params, groups=GROUPS):
        self.groups = groups
        self.p = [[p.detach().double().cpu() for p in ps] for ps in params]
        self.m = [[torch.zeros_like(p) for p in ps] for ps in self.p]
        self.v = [[torch.zeros_like(p) for p in ps] for ps in self.p]
        self.steps = [[0 for _ in ps] for ps in self.p]
        self.branches = set()

    def step(self, grads, low=None, stored=None):
        """One update. `stored`: (m, v) lists the optimizer stored this step; the perturbation is then formed
        from them (as the kernel does; those moments are checked against ours separately)."""
        for gi, spec in enumerate(self.groups):
            b1, b2 = spec["betas"]
            eps, lr, wd = spec["eps"], spec["lr"], spec["weight_decay"]
            for pi, g in enumerate(grads[gi]):
                if g is None:
                    continue
                g = g.double().cpu()
                p = self.p[gi][pi]
                self.steps[gi][pi] += 1
                t = self.steps[gi][pi]
                m = b1 * self.m[gi][pi] + (1 - b1) * g
                v = b2 * self.v[gi][pi] + (1 - b2) * g * g
                if low is not None:
                    m, v = m.to(low).double(), v.to(low).double()
                self.m[gi][pi], self.v[gi][pi] = m, v
                if stored is not None:
                    m, v = stored[0][gi][pi].double().cpu(), stored[1][gi][pi].double().cpu()
                denom = v.sqrt() / math.sqrt(1 - b2**t) + eps
                d = ((b1 * m + (1 - b1) * g) if spec["nesterov"] else m) / denom
                ratio, branch = 1.0, "1d"
                if p.dim() > 1:
                    branch = "none"
                    for name, rows in (("channel", p.shape[0]), ("layer", 1)):
                        pv, gv = p.reshape(rows, -1), g.reshape(rows, -1)
                        if float(_cos(gv, pv, eps).max()) < spec["delta"] / math.sqrt(pv.shape[1]):
                            pn = pv / (pv.norm(dim=1, keepdim=True) + eps)
                            dv = d.reshape(rows, -1)
                            d = (dv - pn * (pn * dv).sum(1, keepdim=True)).reshape(p.shape)
                            ratio, branch = spec["wd_ratio"], name
                            break
                self.branches.add((spec["kinds"][pi], branch))
                self.p[gi][pi] = p * (1 - lr * wd * ratio) - lr / (1 - b1**t) * d

    def load_from(self, opt, params):
        for gi, ps in enumerate(params):
            for pi, p in enumerate(ps):
                self.p[gi][pi] = p.detach().double().cpu()
                st = opt.state.get(p)
                if st:
                    self.m[gi][pi] = st["exp_avg"].double().cpu()
                    self.v[gi][pi] = st["exp_avg_sq"].double().cpu()


ALL_BRANCHES = {("channel", "channel"), ("layer", "layer"), ("none", "none"), ("1d", "1d")}


# --------------------------------------------------------------------------- fp32 vs float64
@pytest.mark.parametrize("nesterov", [None, True], ids=["as-groups", "all-nesterov"])
@pytest.mark.parametrize("executor", ["apex_C", "torch"])
def test_fp32_matches_float64_reference(nesterov, executor, device):
    groups = GROUPS if nesterov is None else [dict(spec, nesterov=nesterov) for spec in GROUPS]
    params = make_params(device=device)
    opt = NpuFusedAdamP(group_dicts(params, groups))
    executor = select_executor(opt, executor, device)
    ref = RefAdamP(params, groups)
    for step in range(10):
        grads = draw_grads(params, step, torch.float32)
        set_grads(params, grads)
        opt.step()
        ref.step(grads)
        assert opt.last_executor == executor
    assert ref.branches == ALL_BRANCHES  # each kind of grad took its branch, and only that one
    for gi, ps in enumerate(params):
        for pi, p in enumerate(ps):
            torch.testing.assert_close(p.detach().double().cpu(), ref.p[gi][pi], rtol=1e-5, atol=1e-6)
            st = opt.state[p]
            torch.testing.assert_close(st["exp_avg"].double().cpu(), ref.m[gi][pi], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(st["exp_avg_sq"].double().cpu(), ref.v[gi][pi], rtol=1e-5, atol=1e-9)
            assert int(st["step"]) == ref.steps[gi][pi]  # params without a grad do not advance


@pytest.mark.parametrize("kind,radial", [("channel", False), ("layer", False), ("none", True)])
def test_projection_removes_the_radial_part(kind, radial):
    """Without weight decay a projected step is orthogonal to the param (row by row for the channel view)."""
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(6, 8, generator=gen, dtype=torch.float64).float().requires_grad_()
    p0 = p.detach().double().clone()
    opt = NpuFusedAdamP([p], lr=0.01)
    p.grad = shaped_grad(p, kind, gen).float()
    opt.step()
    dp = p.detach().double() - p0
    rows = 6 if kind == "channel" else 1
    dots = ((dp.reshape(rows, -1) * p0.reshape(rows, -1)).sum(1).abs()
            / (dp.reshape(rows, -1).norm(dim=1) * p0.reshape(rows, -1).norm(dim=1)))
    if radial:
        assert float(dots.max()) > 0.1
    else:
        assert float(dots.max()) < 1e-5


def test_eps_zero():
    """eps=0 is accepted: the zero gaps between slots must stay out of the row sums (0/0 there)."""
    groups = [dict(spec, eps=0.0) for spec in GROUPS]
    params = make_params()
    opt = NpuFusedAdamP(group_dicts(params, groups))
    ref = RefAdamP(params, groups)
    for step in range(4):
        grads = draw_grads(params, step, torch.float32)
        set_grads(params, grads)
        opt.step()
        ref.step(grads)
    assert ref.branches == ALL_BRANCHES
    for gi, ps in enumerate(params):
        for pi, p in enumerate(ps):
            torch.testing.assert_close(p.detach().double(), ref.p[gi][pi], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- bf16 / fp16 per step
@pytest.mark.parametrize("executor", ["apex_C", "torch"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_each_step_within_one_ulp(dtype, executor, device):
    params = make_params(dtype, device=device)
    opt = NpuFusedAdamP(group_dicts(params))
    executor = select_executor(opt, executor, device)
    ref = RefAdamP(params)
    for step in range(6):
        ref.load_from(opt, params)
        grads = draw_grads(params, step, dtype)
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
    assert ref.branches == ALL_BRANCHES


# --------------------------------------------------------------------------- executors
def _lockstep(pa, oa, pb, ob, steps, scale_b=1.0):
    """Both optimizers get the same grads, drawn from the first one's params."""
    for step in range(steps):
        grads = draw_grads(pa, step, torch.float32)
        set_grads(pa, grads)
        set_grads(pb, grads, scale_b)
        oa.step()
        ob.step()


@pytest.mark.parametrize("no_extension", [False, True], ids=["executor-torch", "without-extension"])
def test_torch_executor_equals_kernel(no_extension, monkeypatch):
    pk, pt = make_params(), make_params()
    ok = NpuFusedAdamP(group_dicts(pk))
    ok.step()  # no grads yet: combines with the kernel executor, updates nothing
    if no_extension:  # flat sets built without kernel arguments, as on a machine without apex_C
        monkeypatch.setattr(_core, "uses_kernel", lambda *tensors: False)
    ot = NpuFusedAdamP(group_dicts(pt))
    ot.executor = "auto" if no_extension else "torch"
    _lockstep(pk, ok, pt, ot, 6)
    assert (ok.last_executor, ot.last_executor) == ("apex_C", "torch")
    for a, b in zip(flat(pk), flat(pt)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
        for name, atol in (("exp_avg", 1e-7), ("exp_avg_sq", 1e-9)):  # m may cancel to ~0: absolute floor
            torch.testing.assert_close(ok.state[a][name], ot.state[b][name], rtol=1e-5, atol=atol)


def test_folded_unscale(device):
    """amp's apex_grad_scale: grads stored x S and multiplied by 1/S inside the step (the decision included)."""
    pa, pb = make_params(device=device), make_params(device=device)
    oa, ob = NpuFusedAdamP(group_dicts(pa)), NpuFusedAdamP(group_dicts(pb))
    ob.apex_grad_scale = 1.0 / 1024
    _lockstep(pa, oa, pb, ob, 4, scale_b=1024.0)
    for a, b in zip(flat(pa), flat(pb)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_state_dict_resume_is_bitwise(device):
    full, half = make_params(device=device), make_params(device=device)
    o_full, o_half = NpuFusedAdamP(group_dicts(full)), NpuFusedAdamP(group_dicts(half))
    for step in range(3):
        for ps, o in ((full, o_full), (half, o_half)):
            set_grads(ps, draw_grads(ps, step, torch.float32))
            o.step()
    sd = copy.deepcopy(o_half.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    resumed = [[p.detach().clone().requires_grad_() for p in ps] for ps in half]
    o_res = NpuFusedAdamP(group_dicts(resumed))
    o_res.load_state_dict(sd)
    for step in range(3, 6):
        for ps, o in ((full, o_full), (resumed, o_res)):
            set_grads(ps, draw_grads(ps, step, torch.float32))
            o.step()
    for a, b in zip(flat(full), flat(resumed)):
        assert torch.equal(a, b)
        assert torch.equal(o_full.state[a]["exp_avg"], o_res.state[b]["exp_avg"])


def test_stays_combined_without_breaking_actions():
    params = make_params()
    opt = NpuFusedAdamP(group_dicts(params))
    grads = draw_grads(params, 50, torch.float32)  # step 50: every param has a grad
    set_grads(params, grads)
    for _ in range(5):
        opt.step()
    assert opt.recombine_count == 1
    for ps in params:
        assert len({p.untyped_storage().data_ptr() for p in ps}) == 1
        assert len({opt.state[p]["exp_avg_sq"].untyped_storage().data_ptr() for p in ps}) == 1


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kw,exc",
    [
        (dict(lr=-1e-3), ValueError),
        (dict(eps=-1e-8), ValueError),
        (dict(betas=(1.0, 0.999)), ValueError),
        (dict(betas=(0.9, 1.5)), ValueError),
        (dict(betas=0.9), ValueError),
        (dict(weight_decay=-1.0), ValueError),
        (dict(delta=-0.1), ValueError),
        (dict(wd_ratio=-0.1), ValueError),
        (dict(nesterov="no"), TypeError),
    ],
)
def test_invalid_arguments(kw, exc):
    p = torch.zeros(3, 2, requires_grad=True)
    with pytest.raises(exc):
        NpuFusedAdamP([p], **kw)
    opt = NpuFusedAdamP([p])
    with pytest.raises(exc):
        opt.add_param_group(dict(params=[torch.zeros(2, requires_grad=True)], **kw))
    assert len(opt.param_groups) == 1


def test_sparse_grad_leaves_state_unchanged():
    p = torch.randn(4, 3, requires_grad=True)
    before = p.detach().clone()
    opt = NpuFusedAdamP([p], lr=0.1)
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


def test_matches_timm_adamp():
    timm_adamp = _import_timm_module("adamp")
    pa, pb = make_params(), make_params()
    ours = NpuFusedAdamP(group_dicts(pa))
    theirs = timm_adamp.AdamP(group_dicts(pb))
    for step in range(6):
        grads = draw_grads(pa, step, torch.float32)
        set_grads(pa, grads)
        set_grads(pb, grads)
        ours.step()
        theirs.step()
    for a, b in zip(flat(pa), flat(pb)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
