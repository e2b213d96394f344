"""clip_optimizer_grad_norm_fused against torch.nn.utils.clip_grad_norm_ (and float64 math for bf16/fp16).

The method clips the combined grads of all param groups of a fused optimizer
in place and returns the total norm; params whose ``.grad is None`` are
ignored, including slots that still hold a stale grad in the flat buffer.
"""

from __future__ import annotations

import math

import pytest
import torch

from apex import _core
from apex.optimizers import CombinedOptimizer, NpuFusedAdam, NpuFusedLamb, NpuFusedSGD

pytestmark = pytest.mark.skipif(not _core.ext_available(), reason="apex_C extension not built")

SHAPES = [[(7, 5), (13,), (3, 2, 2, 2)], [(11,), (4, 4)]]
MISSING = {(0, 1)}  # (group, param) whose grad is None when clipping


def build(opt_cls=NpuFusedAdam, dtype=torch.float32, scale=3.0, seed=0, device="cpu", executor="auto"):
    """Params in two groups, one step taken (so buffers are combined and every slot holds a grad),
    then fresh grads for all params but those in MISSING (their slots keep the old, stale values)."""
    gen = torch.Generator().manual_seed(seed)
    params = [[torch.randn(s, generator=gen).to(device, dtype).requires_grad_() for s in shapes] for shapes in SHAPES]
    opt = opt_cls([dict(params=ps) for ps in params], lr=1e-3)
    opt.executor = executor
    for ps in params:
        for p in ps:
            # large: must not leak into the norm
            p.grad = (torch.randn(p.shape, generator=gen) * 100).to(device, dtype)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for gi, ps in enumerate(params):
        for pi, p in enumerate(ps):
            if (gi, pi) not in MISSING:
                p.grad = (torch.randn(p.shape, generator=gen) * scale).to(device, dtype)
    return params, opt


def grads_of(params):
    return [p.grad.detach().clone() for ps in params for p in ps if p.grad is not None]


def torch_clip(grads, max_norm, norm_type, **kw):
    dummies = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for d, g in zip(dummies, grads):
        d.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(dummies, max_norm, norm_type, **kw)
    return total, [d.grad for d in dummies]


@pytest.mark.parametrize("opt_cls", [NpuFusedAdam, NpuFusedLamb])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0, 3.0, "inf"], ids=str)
@pytest.mark.parametrize("clips", [True, False], ids=["clips", "below-max"])
def test_matches_torch(opt_cls, norm_type, clips, device):
    params, opt = build(opt_cls, device=device)
    before = grads_of(params)
    true_norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in before]), float(norm_type)))
    max_norm = true_norm / 4 if clips else true_norm * 2
    ref_total, ref_grads = torch_clip(before, max_norm, float(norm_type))
    count = opt.recombine_count
    total = opt.clip_optimizer_grad_norm_fused(max_norm, norm_type)
    assert total.dtype == torch.float32 and total.dim() == 0 and total.device.type == device
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
    for ours, ref, raw in zip(grads_of(params), ref_grads, before):
        if clips:
            torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(ours, raw)
    # the new grad objects (set after zero_grad(set_to_none=True)) were adopted once, by the clip; the
    # clipped grads are the combined views that step() then uses without another re-bind
    assert opt.recombine_count == count + 1
    opt.step()
    assert opt.recombine_count == count + 1
    assert opt.last_executor == ("apex_C" if device == "cpu" else "torch")


def test_first_call_combines():
    """Called before any step, the method combines (once) and the next step keeps that layout."""
    gen = torch.Generator().manual_seed(1)
    ps = [torch.randn(5, 3, generator=gen, requires_grad=True), torch.randn(4, generator=gen, requires_grad=True)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    ref_total, ref_grads = torch_clip([p.grad for p in ps], 0.5, 2.0)
    opt = NpuFusedSGD(ps, lr=0.1)
    total = opt.clip_optimizer_grad_norm_fused(0.5)
    assert opt.recombine_count == 1
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
    for p, ref in zip(ps, ref_grads):
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)
    opt.step()
    assert opt.recombine_count == 1


@pytest.mark.parametrize("norm_type", [0.0, -1.0, -math.inf], ids=str)
def test_nonpositive_orders_match_torch(norm_type, device):
    params, opt = build(device=device)
    before = grads_of(params)
    before[0][0, 0] = 0.0  # zeros matter for these orders
    params[0][0].grad[0, 0] = 0.0
    ref_total, ref_grads = torch_clip(before, 0.5, norm_type)
    total = opt.clip_optimizer_grad_norm_fused(0.5, norm_type)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
    for ours, ref in zip(grads_of(params), ref_grads):
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=str)
def test_low_precision_against_float64(dtype, norm_type):
    """The norm is accumulated in float64 and returned as float32; each grad is its float64 product with
    the clip coefficient, rounded (within 1 ulp)."""
    params, opt = build(dtype=dtype)
    before = [g.double() for g in grads_of(params)]
    norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in before]), norm_type))
    max_norm = norm / 3
    total = opt.clip_optimizer_grad_norm_fused(max_norm, norm_type)
    assert total.dtype == torch.float32
    assert abs(float(total) - norm) <= 1e-6 * norm
    coef = max_norm / (norm + 1e-6)
    fi = torch.finfo(dtype)
    for ours, raw in zip(grads_of(params), before):
        ref = raw * coef
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(fi.smallest_normal)))) * fi.eps
        assert bool(((ours.double() - ref).abs() <= ulp).all())


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0], ids=str)
@pytest.mark.parametrize("no_extension", [False, True], ids=["executor-torch", "without-extension"])
def test_torch_executor_equals_kernel(norm_type, no_extension, monkeypatch):
    pk, ok = build()
    if no_extension:  # flat sets built without kernel arguments, as on a machine without apex_C
        monkeypatch.setattr(_core, "uses_kernel", lambda *tensors: False)
    pt, ot = build(executor="auto" if no_extension else "torch")
    assert ot.last_executor == "torch"
    tk = ok.clip_optimizer_grad_norm_fused(1.0, norm_type)
    tt = ot.clip_optimizer_grad_norm_fused(1.0, norm_type)
    torch.testing.assert_close(tt, tk, rtol=1e-6, atol=0)
    for a, b in zip(grads_of(pk), grads_of(pt)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_folded_unscale_reports_and_clips_the_unscaled_norm(device):
    """With amp's apex_grad_scale set, grads are stored x S: the norm is that of the unscaled grads and
    the stored grads stay scaled by S."""
    s = 512.0
    pa, oa = build(device=device)
    pb, ob = build(device=device)
    for ps in pb:
        for p in ps:
            if p.grad is not None:
                p.grad.mul_(s)
    ob.apex_grad_scale = 1.0 / s
    ta = oa.clip_optimizer_grad_norm_fused(1.0)
    tb = ob.clip_optimizer_grad_norm_fused(1.0)
    torch.testing.assert_close(tb, ta, rtol=1e-6, atol=0)
    for a, b in zip(grads_of(pa), grads_of(pb)):
        torch.testing.assert_close(b / s, a, rtol=1e-6, atol=1e-9)


def test_nonfinite(device):
    params, opt = build(device=device)
    params[1][0].grad[3] = math.inf
    before = grads_of(params)
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_optimizer_grad_norm_fused(1.0, error_if_nonfinite=True)
    for a, b in zip(grads_of(params), before):
        assert torch.equal(a, b)
    # without the check: torch's result (coefficient 0, so inf * 0 = nan where the inf was)
    ref_total, ref_grads = torch_clip(before, 1.0, 2.0)
    total = opt.clip_optimizer_grad_norm_fused(1.0)
    assert math.isinf(float(total)) and math.isinf(float(ref_total))
    for ours, ref in zip(grads_of(params), ref_grads):
        torch.testing.assert_close(ours, ref, equal_nan=True)


@pytest.mark.parametrize(
    "args,exc",
    [((-1.0,), ValueError), ((math.nan,), ValueError), (("big",), TypeError), ((1.0, math.nan), ValueError)],
)
def test_invalid_arguments_change_nothing(args, exc):
    params, opt = build()
    before = grads_of(params)
    with pytest.raises(exc):
        opt.clip_optimizer_grad_norm_fused(*args)
    for a, b in zip(grads_of(params), before):
        assert torch.equal(a, b)


def test_no_grads_gives_zero():
    p = torch.randn(3, requires_grad=True)
    opt = NpuFusedAdam([p])
    total = opt.clip_optimizer_grad_norm_fused(1.0)
    assert float(total) == 0.0 and p.grad is None


def test_is_a_method_of_every_fused_optimizer():
    assert CombinedOptimizer.clip_optimizer_grad_norm_fused is not None
    assert NpuFusedSGD.clip_optimizer_grad_norm_fused is CombinedOptimizer.clip_optimizer_grad_norm_fused


@pytest.mark.parametrize("executor", ["auto", "torch"])
@pytest.mark.parametrize("norm_type", [math.inf, 2.0, 1.5, -0.5, 0.0])
@pytest.mark.parametrize("empty_dtype", [torch.float32, torch.float16], ids=["same-set", "own-set"])
def test_empty_grads_are_left_out_of_the_norm(empty_dtype, norm_type, executor):
    """An empty grad (a param with a 0-size dim) changes no norm: the total and the clipped grads are torch's over
    the non-empty grads, whether the empty one shares a set with them or forms its own (torch's infinity and
    non-positive orders raise on an empty tensor; they used to raise here only when it formed its own set). Only
    empty grads: the norm is 0 and nothing changes."""
    torch.manual_seed(0)
    p = torch.randn(3, 4, requires_grad=True)
    e = torch.randn(0, 2, dtype=empty_dtype, requires_grad=True)
    p.grad, e.grad = torch.randn(3, 4), torch.randn(0, 2, dtype=empty_dtype)
    ref = p.detach().clone().requires_grad_()
    ref.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_([ref], 0.05, norm_type)
    opt = NpuFusedSGD([p, e], lr=0.1)
    opt.executor = executor
    got = opt.clip_optimizer_grad_norm_fused(0.05, norm_type)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(p.grad, ref.grad, rtol=1e-6, atol=0)
    only = NpuFusedSGD([e], lr=0.1)
    only.executor = executor
    assert float(only.clip_optimizer_grad_norm_fused(0.05, norm_type)) == 0.0
