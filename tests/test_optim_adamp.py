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

import math

import _optim_harness as harness
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


def make_params(dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
             for s in spec["shapes"]] for spec in GROUPS]


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


def _cos(g, p, eps):
    return (g * p).sum(1).abs() / (g.norm(dim=1).clamp_min(eps) * p.norm(dim=1).clamp_min(eps))


class RefAdamP(harness.MomentsRef):
    """float64 AdamP from the formulas; `low` rounds m, v to that dtype after each update."""

    def __init__(self, params, groups=GROUPS):
        super().__init__(params)
        self.groups = groups
        self.branches = set()

    def step(self, grads, low=None, stored=None):
        """One update. `stored`: (m, v) lists the optimizer stored this step; the perturbation is then formed
        from them (as the kernel does)."""
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
                m, v = self.moments(gi, pi, g, spec["betas"], low, stored)
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


ALL_BRANCHES = {("channel", "channel"), ("layer", "layer"), ("none", "none"), ("1d", "1d")}


# --------------------------------------------------------------------------- fp32 vs float64
@pytest.mark.parametrize("nesterov", [None, True], ids=["as-groups", "all-nesterov"])
@pytest.mark.parametrize("executor", ["apex_C", "torch"])
def test_fp32_matches_float64_reference(nesterov, executor, device):
    groups = GROUPS if nesterov is None else [dict(spec, nesterov=nesterov) for spec in GROUPS]
    params = make_params(device=device)
    opt = NpuFusedAdamP(group_dicts(params, groups))
    executor = harness.select_executor(opt, executor, device)
    ref = RefAdamP(params, groups)
    harness.step_with_ref(opt, ref, params, lambda step: draw_grads(params, step, torch.float32), 10, executor)
    assert ref.branches == ALL_BRANCHES  # each kind of grad took its branch, and only that one
    harness.assert_grouped_fp32(opt, params, ref)


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
    harness.step_with_ref(opt, ref, params, lambda step: draw_grads(params, step, torch.float32), 4)
    assert ref.branches == ALL_BRANCHES
    harness.assert_grouped_fp32(opt, params, ref, states=False)


# --------------------------------------------------------------------------- bf16 / fp16 per step
@pytest.mark.parametrize("executor", ["apex_C", "torch"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_each_step_within_one_ulp(dtype, executor, device):
    params = make_params(dtype, device=device)
    opt = NpuFusedAdamP(group_dicts(params))
    executor = harness.select_executor(opt, executor, device)
    ref = RefAdamP(params)
    harness.check_low_precision_grouped(opt, params, ref, lambda step: draw_grads(params, step, dtype), dtype, executor)
    assert ref.branches == ALL_BRANCHES


# --------------------------------------------------------------------------- executors
def grads_of(params):
    """grads_at for lockstep: the grads drawn from these params at each step."""
    return lambda step: draw_grads(params, step, torch.float32)


@pytest.mark.parametrize("no_extension", [False, True], ids=["executor-torch", "without-extension"])
def test_torch_executor_equals_kernel(no_extension, monkeypatch):
    pk, pt = make_params(), make_params()
    ok = NpuFusedAdamP(group_dicts(pk))
    ok.step()  # no grads yet: combines with the kernel executor, updates nothing
    if no_extension:  # flat sets built without kernel arguments, as on a machine without apex_C
        monkeypatch.setattr(_core, "uses_kernel", lambda *tensors: False)
    ot = NpuFusedAdamP(group_dicts(pt))
    ot.executor = "auto" if no_extension else "torch"
    harness.lockstep(pk, ok, pt, ot, grads_of(pk), 6)
    assert (ok.last_executor, ot.last_executor) == ("apex_C", "torch")
    harness.assert_executors_agree(ok, pk, ot, pt)


def test_folded_unscale(device):
    """amp's apex_grad_scale: grads stored x S and multiplied by 1/S inside the step (the decision included)."""
    pa, pb = make_params(device=device), make_params(device=device)
    oa, ob = NpuFusedAdamP(group_dicts(pa)), NpuFusedAdamP(group_dicts(pb))
    ob.apex_grad_scale = 1.0 / 1024
    harness.lockstep(pa, oa, pb, ob, grads_of(pa), 4, scale_b=1024.0)
    for a, b in zip(harness.flat(pa), harness.flat(pb)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_state_dict_resume_is_bitwise(device):
    def check_saved(sd):
        assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}

    harness.check_resume_grouped(lambda ps: NpuFusedAdamP(group_dicts(ps)), lambda: make_params(device=device),
                                 lambda ps, step: draw_grads(ps, step, torch.float32), check_saved, "exp_avg")


def test_stays_combined_without_breaking_actions():
    params = make_params()
    opt = NpuFusedAdamP(group_dicts(params))
    grads = draw_grads(params, 50, torch.float32)  # step 50: every param has a grad
    harness.set_grads(params, grads)
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
    harness.check_rejected_option(NpuFusedAdamP, kw, exc, torch.zeros(3, 2, requires_grad=True))


def test_sparse_grad_leaves_state_unchanged():
    harness.check_sparse_grad_rejected(NpuFusedAdamP)


# --------------------------------------------------------------------------- timm (optional outside peer)
def test_matches_timm_adamp():
    timm_adamp = harness.import_timm_module("adamp")
    pa, pb = make_params(), make_params()
    ours = NpuFusedAdamP(group_dicts(pa))
    theirs = timm_adamp.AdamP(group_dicts(pb))
    harness.lockstep(pa, ours, pb, theirs, grads_of(pa), 6)
    for a, b in zip(harness.flat(pa), harness.flat(pb)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
