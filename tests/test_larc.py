"""apex.parallel.LARC: upstream semantics around any optimizer, accepted by amp.initialize.

Reference: the LARC rule written here in float64 (You et al. 2017, as upstream applies it):
local = tc * ||p|| / (||g|| + wd * ||p|| + eps); clip: factor = min(local / lr, 1), else local;
grad <- (grad + wd * p) * factor where both norms are non-zero (untouched otherwise); the wrapped
step runs with weight_decay 0, which is restored afterwards. fp32 results within
assert_close(rtol=1e-5, atol=1e-6 * max|p0|) after 20 steps.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from apex.optimizers import FusedAdam, FusedSGD
from apex.parallel import LARC

STEPS = 20


def make_params(device, seed=0, zero_param=True):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (5,), (2, 2, 2), (3,)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    if zero_param:
        with torch.no_grad():
            ps[-1].zero_()  # ||p|| = 0: LARC leaves its grad alone (and drops its weight decay, as upstream)
    return ps


def ref_larc_sgd(params64, grads64, bufs, *, lr, momentum, wd, tc, clip, eps):
    """float64: LARC's grad rewrite, then torch SGD with momentum and no weight decay."""
    out = []
    for i, (p, g) in enumerate(zip(params64, grads64)):
        if g is None:
            out.append(p)
            continue
        pn, gn = float(p.norm()), float(g.norm())
        if pn != 0 and gn != 0:
            local = tc * pn / (gn + pn * wd + eps)
            factor = min(local / lr, 1.0) if clip else local
            g = (g + wd * p) * factor
        bufs[i] = g.clone() if bufs[i] is None else momentum * bufs[i] + g
        out.append(p - lr * bufs[i])
    return out


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("inner", ["torch", "fused"])
def test_larc_matches_reference(device, clip, inner):
    lr, momentum, wd, tc, eps = 0.1, 0.9, 5e-3, 0.02, 1e-8
    params = make_params(device)
    ref = [p.detach().double().cpu() for p in params]
    cls = torch.optim.SGD if inner == "torch" else FusedSGD
    base = cls(params, lr=lr, momentum=momentum, weight_decay=wd)
    opt = LARC(base, trust_coefficient=tc, clip=clip, eps=eps)
    bufs = [None] * len(params)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params]
        if step == 3:
            grads[1] = torch.zeros_like(grads[1])  # ||g|| = 0: untouched
        if step == 4:
            grads[2] = None  # no grad: skipped
        for p, g in zip(params, grads):
            if g is None:
                p.grad = None
            elif p.grad is None:
                p.grad = g.to(device=device, dtype=p.dtype)
            else:
                p.grad.copy_(g)
        opt.step()
        assert base.param_groups[0]["weight_decay"] == wd  # restored after the wrapped step
        ref = ref_larc_sgd(ref, grads, bufs, lr=lr, momentum=momentum, wd=wd, tc=tc, clip=clip, eps=eps)
    scale = max(float(r.abs().max()) for r in ref)
    for i, (p, r) in enumerate(zip(params, ref)):
        torch.testing.assert_close(p.detach().double().cpu(), r, rtol=1e-5, atol=1e-6 * scale,
                                   msg=lambda m, i=i: f"param {i}: {m}")
    if inner == "fused":
        # LARC rewrites grads in place, so sharing holds: the only event is the first combine (the grad bound
        # anew after it was dropped at step 4 is read where it is)
        assert base.recombine_count == 1


def test_larc_lr_zero_and_missing_weight_decay(device):
    """clip with lr 0 divides by zero upstream (factor min(inf, 1) = 1); a group without weight_decay keeps none."""

    class Plain(torch.optim.Optimizer):
        def __init__(self, params, lr):
            super().__init__(params, dict(lr=lr))

        @torch.no_grad()
        def step(self, closure=None):
            seen.append(dict(self.param_groups[0]))
            for p in self.param_groups[0]["params"]:
                p.add_(p.grad, alpha=-self.param_groups[0]["lr"])

    seen = []
    params = make_params(device, zero_param=False)
    opt = LARC(Plain(params, lr=0.0))
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    assert seen[0]["weight_decay"] == 0  # folded for the wrapped step
    assert "weight_decay" not in opt.param_groups[0]  # and not left behind
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))  # factor 1, no decay


def test_larc_restores_weight_decay_when_step_raises(device):
    params = make_params(device)
    base = torch.optim.SGD(params, lr=0.1, weight_decay=0.3)
    opt = LARC(base)

    def boom(*args, **kwargs):
        raise RuntimeError("inner step failed")

    base.step = boom
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="inner step failed"):
        opt.step()
    assert base.param_groups[0]["weight_decay"] == 0.3


def test_larc_delegation_scheduler_pickle(device):
    params = make_params(device, zero_param=False)
    base = FusedAdam(params, lr=1e-2, weight_decay=0.01)
    opt = LARC(base, trust_coefficient=0.05, clip=False)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is base.param_groups and opt.state is base.state and opt.defaults is base.defaults
    extra = torch.nn.Parameter(torch.randn(3, device=device))
    opt.add_param_group({"params": [extra]})
    assert base.param_groups[-1]["params"] == [extra]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for p in [*params, extra]:
        p.grad = torch.randn_like(p)
    opt.step()
    sched.step()
    assert base.param_groups[0]["lr"] == pytest.approx(5e-3)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["step"] == 1
    opt.zero_grad()
    assert all(p.grad is None for p in params)  # FusedAdam's set_grad_none
    clone = copy.deepcopy(opt)
    assert isinstance(clone.optim, FusedAdam) and clone.trust_coefficient == 0.05 and clone.clip is False
    again = pickle.loads(pickle.dumps(LARC(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))))
    assert again.eps == 1e-8 and isinstance(again.optim, torch.optim.SGD)
    other = LARC(FusedAdam(make_params(device, zero_param=False), lr=1e-2, weight_decay=0.01))
    other.load_state_dict(_first_group_state(base))  # the wrapped optimizer's checkpoint, through LARC
    assert other.param_groups[0]["step"] == 1


def _first_group_state(opt) -> dict:
    sd = opt.state_dict()
    first = sd["param_groups"][0]
    return {"state": {k: v for k, v in sd["state"].items() if k in first["params"]}, "param_groups": [first]}


def test_larc_errors():
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        LARC(object())
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARC(opt, trust_coefficient=-1.0)
    with pytest.raises(TypeError, match="eps"):
        LARC(opt, eps="small")


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(trust_coefficient=float("inf"), clip=False), ValueError,
     r"LARC: trust_coefficient must be a finite number > 0 within float32's normal range "
     r"\[1\.17549e-38, 3\.40282e\+38\], got inf"),
    (dict(trust_coefficient=1e300, clip=False), ValueError, "trust_coefficient must be .*got 1e\\+300"),
    (dict(trust_coefficient=4e38), ValueError, "trust_coefficient must be a finite number > 0"),
    (dict(trust_coefficient=10**400), ValueError, "trust_coefficient must be a finite number > 0"),
    (dict(trust_coefficient=0.0), ValueError, "trust_coefficient must be a finite number > 0 .*got 0.0"),
    (dict(trust_coefficient=0), ValueError, "trust_coefficient must be a finite number > 0 .*got 0"),
    (dict(trust_coefficient=1e-300), ValueError, "trust_coefficient must be .*got 1e-300"),
    (dict(trust_coefficient=-1.0), ValueError, "trust_coefficient must be a finite number > 0"),
    (dict(trust_coefficient=float("nan")), ValueError, "trust_coefficient must be .*got nan"),
    (dict(trust_coefficient="0.02"), TypeError, r"LARC: trust_coefficient must be a real number, got '0.02' \(str\)"),
    (dict(trust_coefficient=True), TypeError, r"trust_coefficient must be a real number, got True \(bool\)"),
    (dict(eps=float("inf")), ValueError, r"LARC: eps must be a finite number >= 0 within float32's range "
                                         r"\(<= 3\.40282e\+38\), got inf"),
    (dict(eps=1e300), ValueError, "eps must be a finite number >= 0"),
    (dict(eps=-1e-8), ValueError, "eps must be a finite number >= 0"),
    (dict(eps=float("nan")), ValueError, "eps must be .*got nan"),
    (dict(eps="small"), TypeError, "eps must be a real number"),
    (dict(clip="no"), TypeError, r"LARC: clip must be True or False, got 'no' \(str\)"),
    (dict(clip=None), TypeError, r"LARC: clip must be True or False, got None"),
    (dict(clip=2), ValueError, r"LARC: clip must be True or False \(or 0/1\), got 2"),
])
def test_larc_refuses_values_that_would_corrupt_or_freeze_the_weights(kwargs, error, match):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, weight_decay=1e-4)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(error, match=match):
        LARC(opt, **kwargs)
    assert opt.state_dict() == before and not hasattr(opt, "optim")
    assert torch.equal(p.detach(), torch.ones(3))


def test_larc_accepts_the_edges_of_the_ranges_and_upstream_flags():
    np = pytest.importorskip("numpy")
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    assert LARC(opt, clip=0).clip is False
    assert LARC(opt, clip=np.bool_(True)).clip is True
    assert LARC(opt, eps=0).eps == 0.0
    assert LARC(opt, trust_coefficient=3.4e38, eps=3.4e38).trust_coefficient == 3.4e38
    larc = LARC(opt, trust_coefficient=1.2e-38, clip=1)
    p.grad = torch.full((3,), 0.5)
    larc.step()
    assert torch.isfinite(p).all()


def _train(model, opt, steps, amp_module=None, seed=3):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        if amp_module is None:
            loss.backward()
        else:
            with amp_module.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.devices("cpu")
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_larc_through_amp_initialize(opt_level):
    amp = pytest.importorskip("apex.amp")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    plain = copy.deepcopy(model)
    opt = LARC(FusedSGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4), trust_coefficient=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    try:
        assert isinstance(opt, LARC)
        losses = _train(model, opt, 40, amp)
        assert losses[-1] < 0.5 * losses[0], losses
        if opt_level == "O0":  # fp32, loss scale 1: exactly LARC without amp
            ref_opt = LARC(FusedSGD(plain.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4),
                           trust_coefficient=0.1)
            ref_losses = _train(plain, ref_opt, 40)
            assert losses == ref_losses
    finally:
        amp.deinitialize()


def test_an_expanded_grad_is_copied_not_failed_on():
    """An expanded grad (stride 0: one value broadcast) refuses in-place writes. torch's optimizers only read
    grads and step on it; LARC scales grads in place, so it replaces that grad by a copy first instead of
    failing after the earlier grads were rescaled. The step equals the one on a materialized grad, and the
    caller's expanded tensor is left as it was."""
    def params():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    ps, ref = params(), params()
    grads = [torch.randn(3, 4), torch.tensor([-0.7]).expand(5)]
    ps[0].grad, ps[1].grad = grads[0].clone(), grads[1]
    ref[0].grad, ref[1].grad = grads[0].clone(), grads[1].contiguous()
    for group in (ps, ref):
        LARC(torch.optim.SGD(group, lr=0.1, weight_decay=0.01), trust_coefficient=0.02, clip=True).step()
    for p, q in zip(ps, ref):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert torch.equal(grads[1], torch.full((5,), -0.7))
