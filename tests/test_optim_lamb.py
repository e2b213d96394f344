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

import math

import _optim_harness as harness
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


def make_params(dtype=torch.float32, seed=0, scale=1.0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec in GROUPS:
        out.append([(torch.randn(s, generator=gen, dtype=torch.float64) * scale).to(device, dtype).requires_grad_()
                    for s in spec["shapes"]])
    return out


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


class RefLamb(harness.MomentsRef):
    """float64 LAMB from the formulas; `low` rounds m, v to that dtype after each update."""

    def __init__(self, params, groups, adam, use_global):
        super().__init__(params)
        self.groups, self.adam, self.use_global = groups, adam, use_global
        self.last_norm = None

    def step(self, grads, low=None, stored=None):
        """One update. `stored`: (m, v) lists the optimizer stored this step; u is then formed from them
        (the kernel forms u from its stored moments)."""
        flat = [g.double().cpu() for gs in grads for g in gs if g is not None]
        norm = math.sqrt(sum(float((g * g).sum()) for g in flat))
        self.last_norm = norm
        c = 1.0 / norm if self.use_global and norm > 1 else 1.0
        for gi, spec in enumerate(self.groups):
            for pi, g in enumerate(grads[gi]):
                if g is None:
                    continue
                g = g.double().cpu() * c
                p = self.p[gi][pi]
                m, v = self.moments(gi, pi, g, spec["betas"], low, stored)
                u = m / (v.sqrt() + spec["eps"]) + spec["weight_decay"] * p
                wn, un = min(float(p.norm()), 10.0), float(u.norm())
                r = 1.0 if (self.adam or wn == 0 or un == 0) else wn / un
                self.p[gi][pi] = p - spec["lr"] * r * u
                self.steps[gi][pi] += 1


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
    executor = harness.select_executor(opt, executor, device)
    ref = RefLamb(params, GROUPS, adam, use_global)

    def grads_left_alone(grads):  # the global-norm divisor is applied inside the update
        for ps, gs in zip(params, grads):
            for p, g in zip(ps, gs):
                if g is not None:
                    assert torch.equal(p.grad, g)

    harness.step_with_ref(opt, ref, params, lambda step: draw_grads(params, step, gscale, torch.float32), 12,
                          executor, after=grads_left_alone)
    if use_global:  # the branch under test was taken
        assert (ref.last_norm > 1) == (gscale > 1)
    harness.assert_grouped_fp32(opt, params, ref, scaled_atol=True)
    # first combine, + 1 when the new grad object after the `grad = None` gap is copied in (the torch executor);
    # the kernel, global norm included, reads it where it is
    assert opt.recombine_count == 1 + (executor == "torch")


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
        harness.set_grads([[big, zero_p, still]], grads)
        opt.step()
        ref.step(grads)
    assert float(big.detach().norm()) > 10
    for ours, theirs in zip((big, zero_p, still), ref.p[0]):
        torch.testing.assert_close(ours.detach().double(), theirs, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(still) == 0


def test_eps_zero():
    """eps=0 is accepted (as by the Ascend patch): the zero gaps between slots must stay out of the norms
    (their update would be 0/0)."""
    params = make_params()
    groups = [dict(spec, eps=0.0) for spec in GROUPS]
    opt = NpuFusedLamb(group_dicts(params, eps=0.0))
    ref = RefLamb(params, groups, adam=False, use_global=False)
    harness.step_with_ref(opt, ref, params, lambda step: draw_grads(params, step, 1.0, torch.float32), 3)
    harness.assert_grouped_fp32(opt, params, ref, scaled_atol=True)


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
    executor = harness.select_executor(opt, executor, device)
    ref = RefLamb(params, GROUPS, adam=False, use_global=use_global)
    harness.check_low_precision_grouped(opt, params, ref, lambda step: draw_grads(params, step, 3.0, dtype), dtype,
                                        executor)


# --------------------------------------------------------------------------- executors
def _run(params, steps, executor="auto", **kw):
    opt = NpuFusedLamb(group_dicts(params), **kw)
    opt.executor = executor
    for step in range(steps):
        harness.set_grads(params, draw_grads(params, step, 4.0, torch.float32))
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
    for a, b in zip(harness.flat(pt), harness.flat(pn)):
        assert torch.equal(a, b)
    harness.assert_executors_agree(ok, pk, ot, pt)


@pytest.mark.parametrize(**KWS)
def test_reference_class_matches_fused(kw, device):
    pf, pr = make_params(device=device), make_params(device=device)
    of = NpuFusedLamb(group_dicts(pf), **kw)
    orf = Lamb(group_dicts(pr), **kw)
    harness.lockstep(pf, of, pr, orf, lambda step: draw_grads(pf, step, 4.0, torch.float32), 6)
    for a, b in zip(harness.flat(pf), harness.flat(pr)):
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
    harness.lockstep(pa, oa, pb, ob, lambda step: draw_grads(pa, step, 2.0, torch.float32), 4, scale_b=s)
    for a, b in zip(harness.flat(pa), harness.flat(pb)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


def test_state_dict_resume_is_bitwise(device):
    def check_saved(sd):
        assert sd["param_groups"][0]["use_global_grad_norm"] is True and sd["param_groups"][0]["adam"] is False

    harness.check_resume_grouped(lambda ps: NpuFusedLamb(group_dicts(ps), use_global_grad_norm=True),
                                 lambda: make_params(device=device),
                                 lambda ps, step: draw_grads(ps, step, 3.0, torch.float32), check_saved, "exp_avg_sq")


def test_states_are_views_of_flat_buffers_and_stay_combined():
    params = make_params()
    opt = NpuFusedLamb(group_dicts(params))
    grads = draw_grads(params, 100, 1.0, torch.float32)  # step 100: every param has a grad
    harness.set_grads(params, grads)
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
    harness.check_rejected_option(cls, kw, exc, torch.zeros(3, requires_grad=True))


@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "stepped"])
@pytest.mark.parametrize("cls", [NpuFusedLamb, Lamb])
def test_bad_params_and_grads_leave_state_unchanged(cls, stepped):
    with pytest.raises(TypeError, match=r"floating point params; param 0 has dtype torch\.int64"):
        cls([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(TypeError, match=r"complex params \(param 0 has dtype torch.complex64\).*view_as_real"):
        cls([torch.zeros(3, dtype=torch.complex64, requires_grad=True)])
    harness.check_sparse_grad_rejected(cls, stepped=stepped)


def test_reference_lamb_takes_a_generator_in_a_group_dict():
    lin = torch.nn.Linear(3, 2)
    opt = Lamb([{"params": lin.parameters()}])
    assert opt.param_groups[0]["params"] == list(lin.parameters())


def test_reference_lamb_rejects_a_grad_of_another_shape_before_any_update():
    """``p.data = <other shape>`` leaves the old grad behind; Lamb raises before updating the params before it."""
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))]
    opt = Lamb(params, lr=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    params[1].data = torch.randn(5)
    snap = harness.snapshot(opt, params)
    with pytest.raises(RuntimeError, match=r"grad of param 1 has shape \(4,\); expected the param's \(5,\)"):
        opt.step()
    harness.assert_unchanged(opt, params, snap)



@pytest.mark.parametrize("cls", [NpuFusedLamb, Lamb])
def test_load_without_an_option_takes_the_default_and_trains_on(cls):
    import copy

    p = torch.nn.Parameter(torch.randn(4))
    opt = cls([p], lr=0.1)
    p.grad = torch.randn(4)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    del sd["param_groups"][0]["lr"], sd["param_groups"][0]["use_global_grad_norm"]
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["use_global_grad_norm"] is False
    assert "differentiable" not in opt.defaults and "differentiable" not in opt.param_groups[0]
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # a second load spreads nothing either
    assert set(opt.param_groups[0]) == set(opt.defaults) | {"params"}
    opt.step()


@pytest.mark.parametrize("option", ["maximize", "capturable", "differentiable"])
@pytest.mark.parametrize("cls", [NpuFusedLamb, Lamb])
def test_torch_only_options_refused_everywhere(cls, option):
    import copy

    msg = rf"param group \d: {cls.__name__} does not implement {option}=True"
    p = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match=msg):
        cls([{"params": [p], option: True}], lr=0.1)
    opt = cls([p], lr=0.1)
    with pytest.raises(ValueError, match=msg):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], option: True})
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0][option] = True
    snap = harness.snapshot(opt, [p])
    with pytest.raises(ValueError, match=msg):
        opt.load_state_dict(sd)
    harness.assert_unchanged(opt, [p], snap)
    opt.param_groups[0][option] = True
    p.grad = torch.ones(4)
    snap = harness.snapshot(opt, [p])
    with pytest.raises(ValueError, match=msg):
        opt.step()
    harness.assert_unchanged(opt, [p], snap)


@pytest.mark.parametrize("cls", [NpuFusedLamb, Lamb])
def test_a_state_entry_that_is_not_a_dict_is_named_before_any_update(cls):
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))]
    opt = cls(params, lr=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    step0 = float(opt.state[params[0]]["step"])
    opt.state[params[1]] = 5
    with pytest.raises(TypeError, match=r"state of param 1 .*group 0.*dict.*got int|group 0.*state of param 1 .*dict"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert float(opt.state[params[0]]["step"]) == step0 and opt.state[params[1]] == 5
    opt.state[params[1]] = {}  # a fresh start is fine
    opt.step()


def test_reference_lamb_global_norm_takes_float64_params():
    """float64 params (the reference class takes any float dtype): the global norm works and matches the norm
    of the grads as the update reads them (float32), so the result is that of float32 copies of the params."""
    g64 = [torch.randn(4, dtype=torch.float64) * 3, torch.randn(5, dtype=torch.float64) * 3]
    p64 = [torch.nn.Parameter(torch.randn(s.shape, dtype=torch.float64)) for s in g64]
    p32 = [torch.nn.Parameter(p.detach().float()) for p in p64]
    o64, o32 = Lamb(p64, lr=0.1, use_global_grad_norm=True), Lamb(p32, lr=0.1, use_global_grad_norm=True)
    for p, q, g in zip(p64, p32, g64):
        p.grad, q.grad = g.clone(), g.float()
    o64.step()
    o32.step()
    for p, q in zip(p64, p32):
        torch.testing.assert_close(p.detach().float(), q.detach(), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- timm (optional outside peer)
@pytest.mark.parametrize("use_global", [False, True])
def test_matches_timm_lamb(use_global):
    """timm's Lamb with bias_correction=False, always_adapt=True and max_grad_norm=1 (or None) is the same
    algorithm as long as ||p|| < 10 (timm does not clamp the weight norm)."""
    timm_lamb = harness.import_timm_module("lamb")
    pa, pb = make_params(scale=0.5), make_params(scale=0.5)
    spec = GROUPS[0]
    ours = NpuFusedLamb(pa[0], lr=spec["lr"], eps=spec["eps"], weight_decay=spec["weight_decay"],
                        use_global_grad_norm=use_global)
    theirs = timm_lamb.Lamb(pb[0], lr=spec["lr"], eps=spec["eps"], weight_decay=spec["weight_decay"],
                            bias_correction=False, always_adapt=True, max_grad_norm=1.0 if use_global else None)
    harness.lockstep(pa[:1], ours, pb[:1], theirs, lambda step: draw_grads(pa, step, 3.0, torch.float32)[:1], 6)
    for a, b in zip(pa[0], pb[0]):
        assert float(b.detach().norm()) < 10
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
