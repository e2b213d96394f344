"""Grads read where autograd left them (torch's default ``zero_grad(set_to_none=True)`` pattern).

After ``zero_grad(set_to_none=True)`` (optimizer's or module's) autograd hands over fresh grad
tensors every step. The kernel-backed optimizers then read them through a per-slot address table
instead of copying them into the flat grad buffer: ``p.grad`` stays the caller's tensor, nothing is
re-combined, and the update is bitwise the update of the combined path (same kernel arithmetic).
amp unscales and checks such grads in place, one apex_C call per buffer.

The flat grad buffer is made on demand: in the default pattern (first step included) it never exists, so the
optimizer holds no second copy of the grads. Grads that a step read in place and that are still the params'
grads at the next step (kept: ``zero_grad(set_to_none=False)``) are adopted into it then, once, and later
steps read the buffer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _optim_harness import assert_close_rel, assert_unchanged, snapshot
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from apex import _core
from apex.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
    NpuFusedAdadelta,
    NpuFusedAdam,
    NpuFusedAdamP,
    NpuFusedAdamW,
    NpuFusedBertAdam,
    NpuFusedLamb,
    NpuFusedRMSprop,
    NpuFusedRMSpropTF,
    NpuFusedSGD,
)
from apex.optimizers._nvidia import ShadowSet

pytestmark = pytest.mark.skipif(_core.ext is None, reason="the gather path is the apex_C kernel's")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(7, 5), (0,), (5,), (3, 4, 2), (), (33,), (2, 9)]

# (name, class, kwargs): every optimizer whose kernel step can read grads through the table
GATHER = [
    ("adam", NpuFusedAdam, dict(lr=1e-2, weight_decay=0.1)),
    ("adam_amsgrad", NpuFusedAdam, dict(lr=1e-2, amsgrad=True)),
    ("adamw", NpuFusedAdamW, dict(lr=1e-2)),
    ("sgd", NpuFusedSGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("sgd_nesterov", NpuFusedSGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("sgd_plain", NpuFusedSGD, dict(lr=0.1)),
    ("adadelta", NpuFusedAdadelta, dict(lr=1.0, weight_decay=0.01)),
    ("rmsprop", NpuFusedRMSprop, dict(lr=1e-2, momentum=0.9, centered=True)),
    ("rmsprop_tf", NpuFusedRMSpropTF, dict(lr=1e-2, momentum=0.9)),
    ("fused_adagrad", FusedAdagrad, dict(lr=1e-2, weight_decay=0.01)),
    ("fused_adam", FusedAdam, dict(lr=1e-2, weight_decay=0.01)),
    ("fused_adam_master", FusedAdam, dict(lr=1e-2, weight_decay=0.01, capturable=True, master_weights=True)),
    ("fused_sgd", FusedSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01, wd_after_momentum=True)),
    ("lamb", NpuFusedLamb, dict(lr=1e-2, weight_decay=0.01)),
    ("lamb_adam", NpuFusedLamb, dict(lr=1e-2, adam=True)),
    ("lamb_global_norm", NpuFusedLamb, dict(lr=1e-2, weight_decay=0.01, use_global_grad_norm=True)),
    ("fused_lamb", FusedLAMB, dict(lr=1e-2, max_grad_norm=0.5)),
    ("fused_lamb_nvlamb", FusedLAMB, dict(lr=1e-2, weight_decay=0.0, use_nvlamb=True, max_grad_norm=None)),
    ("fused_mp_lamb", FusedMixedPrecisionLamb, dict(lr=1e-2, max_grad_norm=0.5)),
    ("novograd", FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01)),
    ("novograd_inf_reg_inside", FusedNovoGrad, dict(lr=1e-2, norm_type=0, reg_inside_moment=True, init_zero=True)),
    ("bert_adam", NpuFusedBertAdam, dict(lr=1e-2, max_grad_norm=1.0)),
    ("bert_adam_schedule", NpuFusedBertAdam, dict(lr=1e-2, warmup=0.2, t_total=8, max_grad_norm=0.5)),
    ("bert_adam_noclip", NpuFusedBertAdam, dict(lr=1e-2, max_grad_norm=-1.0)),
    ("adamp", NpuFusedAdamP, dict(lr=1e-2, weight_decay=0.01, delta=1.0)),
    ("adamp_nesterov", NpuFusedAdamP, dict(lr=1e-2, weight_decay=0.01, nesterov=True)),
]
IDS = [g[0] for g in GATHER]


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _groups(params, cls):
    lr = GATHER_LR.get(cls, 1e-2)
    return [{"params": params[:3]}, {"params": params[3:5], "lr": lr * 0.5}, {"params": params[5:]}]


GATHER_LR = {NpuFusedSGD: 0.1, FusedSGD: 0.1, NpuFusedAdadelta: 1.0}


def _draw(gen, params, step, dtype):
    """Grads of one step; None for some params on some steps (torch's skip rule)."""
    out = []
    for k, p in enumerate(params):
        if (step + k) % 4 == 3:
            out.append(None)
        else:
            out.append(torch.randn(p.shape, generator=gen).to(dtype))
    return out


def _kept(p, g):
    """grads-kept mode: written into the existing grad (our slot view once combined)."""
    if g is None:
        p.grad = None
    elif p.grad is None:
        p.grad = g.clone()
    else:
        p.grad.copy_(g)


def _fresh(p, g):
    """set_to_none mode: a new tensor every step, as autograd makes after zero_grad(set_to_none=True)."""
    p.grad = None if g is None else g.clone()


def _sets(opt):
    return [s for c in opt._groups.values() for s in c.sets]


def _assert_bitwise(oa, pa, ob, pb, what):
    for k, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"{what}: param {k} differs"
        sa, sb = oa.state.get(x, {}), ob.state.get(y, {})
        assert sorted(sa) == sorted(sb), f"{what}: state keys of param {k}"
        for n in sa:
            va, vb = sa[n], sb[n]
            if isinstance(va, torch.Tensor):
                assert torch.equal(va, vb), f"{what}: state {n!r} of param {k} differs"
            else:
                assert va == vb


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,cls,kw", GATHER, ids=IDS)
def test_gather_bitwise_equals_combined(name, cls, kw, dtype):
    """Fresh grads every step (read in place) vs grads copied into the flat buffer: same bits."""
    pa, pb = _params(dtype), _params(dtype)
    oa, ob = cls(_groups(pa, cls), **kw), cls(_groups(pb, cls), **kw)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        grads = _draw(gen, pa, step, dtype)
        for p, g in zip(pa, grads):
            _kept(p, g)
        fresh = [None if g is None else g.clone() for g in grads]
        for p, g in zip(pb, fresh):
            p.grad = g
        count = ob.recombine_count
        oa.step()
        ob.step()
        _assert_bitwise(oa, pa, ob, pb, f"{name} step {step}")
        if step:
            assert ob.recombine_count == count, "fresh grads were adopted (copied) instead of read in place"
            assert any(s.gathered for s in _sets(ob))
            assert ob.last_executor == "apex_C"
            for p, g in zip(pb, fresh):
                assert p.grad is g, "p.grad must stay the caller's tensor"


def _grad_buffers(opt):
    return [s.has_grad_buffer for s in _sets(opt)]


def _paired_steps(make, seed, steps, set_a, set_b, dtype=torch.float32):
    """Twin params and optimizers (``make(params)``) fed the same drawn grads, `set_a` / `set_b` binding them;
    yields (step, oa, pa, ob, pb) after both stepped."""
    pa, pb = _params(dtype, seed), _params(dtype, seed)
    oa, ob = make(pa), make(pb)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for p, q, g in zip(pa, pb, _draw(gen, pa, step, dtype)):
            set_a(p, g)
            set_b(q, g)
        oa.step()
        ob.step()
        yield step, oa, pa, ob, pb


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,cls,kw", GATHER, ids=IDS)
def test_default_zero_grad_never_makes_a_flat_grad_buffer(name, cls, kw, dtype):
    """torch's default pattern from the first step on: grads read in place, no flat grad buffer made (no second
    copy of the grads held), nothing counted as re-combined after the first step; bitwise the kept-grads run."""
    for step, oa, pa, ob, pb in _paired_steps(lambda ps: cls(_groups(ps, cls), **kw), 4, 5, _fresh, _kept, dtype):
        _assert_bitwise(oa, pa, ob, pb, f"{name} step {step}")
        assert _grad_buffers(oa) == [False] * len(_sets(oa)), f"step {step}: a flat grad buffer was made"
        masters = [m for s in _sets(oa) if isinstance(s, ShadowSet) for m in s.params]
        assert all(m.grad is None for m in masters), "master weights read the model grads: no grads of their own"
        assert oa.recombine_count == 1
        oa.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in pa)


@pytest.mark.parametrize("name,cls,kw", GATHER, ids=IDS)
def test_kept_grads_are_adopted_once_at_the_second_step(name, cls, kw):
    """zero_grad(set_to_none=False) + in-place accumulation: the first step reads the grads in place, the second
    sees the same tensors again and adopts them (one copy, not counted as a re-combine), later steps read the flat
    buffer through the slot views, and every step is bitwise the fresh-grads run."""
    pa, pb = _params(torch.float32, 5), _params(torch.float32, 5)
    oa, ob = cls(_groups(pa, cls), **kw), cls(_groups(pb, cls), **kw)
    gen = torch.Generator().manual_seed(5)
    for step in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in pa]
        oa.zero_grad(set_to_none=False)
        for p, q, g in zip(pa, pb, grads):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.add_(g)  # backward accumulating into the kept grad
            _fresh(q, g)
        kept = [p.grad for p in pa]
        oa.step()
        ob.step()
        _assert_bitwise(oa, pa, ob, pb, f"{name} step {step}")
        assert oa.recombine_count == 1
        sets = [s for s in _sets(oa) if s.nseg]
        if step == 0:
            assert all(s.gathered for s in sets if s.total), "the first step reads the grads in place"
            assert all(p.grad is g for p, g in zip(pa, kept))
        else:
            bound = {id(v) for s in sets for v in s.grad_views}
            assert all(id(p.grad) in bound for p in pa), f"step {step}: grads are not the flat buffer's views"
            assert not any(s.gathered for s in sets), f"step {step}: kept grads still read in place"
            if step == 1:
                # the adopted values are the caller's grads of this step (copied, then rebound)
                assert all(torch.equal(p.grad, g) for p, g in zip(pa, kept))


def test_kept_grads_of_a_mark_from_another_optimizer_are_read_in_place():
    """The mark is per flat set: grads read in place by one optimizer and then handed to another's params are
    not taken for kept grads by the second."""
    pa, pb = _params(torch.float32, 6), _params(torch.float32, 6)
    oa, ob = NpuFusedAdam(pa, lr=1e-2), NpuFusedAdam(pb, lr=1e-2)
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(p.shape, generator=gen) for p in pa]
    for p, g in zip(pa, grads):
        p.grad = g.clone()
    oa.step()
    for p, q in zip(pa, pb):
        q.grad, p.grad = p.grad, None
    ob.step()  # grads marked by oa: read in place by ob, not adopted
    assert all(s.gathered for s in _sets(ob) if s.total)
    assert not any(s.has_grad_buffer for s in _sets(ob))
    ob.step()  # the same tensors again, now marked by ob at its last step: kept, adopted
    assert any(s.has_grad_buffer for s in _sets(ob))
    assert not any(s.gathered for s in _sets(ob))


@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "kept"])
@pytest.mark.parametrize("name,cls,kw", GATHER, ids=IDS)
def test_grads_viewing_a_buffer_someone_else_owns_are_read_in_place_every_step(name, cls, kw, set_to_none):
    """Grads that are views into another owner's flat buffer, bound to ``p.grad`` by the owner (what torch DDP's
    ``gradient_as_bucket_view=True`` does, again after every ``zero_grad(set_to_none=True)``): never adopted,
    since the owner would bind its views again and copy ours back, but read in place at every step, in both
    zero_grad modes; ``p.grad`` stays the owner's view; bitwise the fresh-grads run."""
    pa, pb = _params(torch.float32, 7), _params(torch.float32, 7)
    oa, ob = cls(_groups(pa, cls), **kw), cls(_groups(pb, cls), **kw)
    bucket = torch.zeros(sum(p.numel() for p in pa) + 5)
    views, at = [], 5  # an offset as a bucket has: the views need no alignment beyond the element size
    for p in pa:
        views.append(bucket[at:at + p.numel()].view(p.shape))
        at += p.numel()
    gen = torch.Generator().manual_seed(7)
    for step in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in pa]
        for p, v, q, g in zip(pa, views, pb, grads):
            if p.grad is None:  # after zero_grad(set_to_none=True) the owner writes the new grad into its view
                v.copy_(g)
                p.grad = v
            else:  # kept: the backward accumulates into the view, still the param's grad
                assert p.grad is v
                v.add_(g)
            _fresh(q, g)
        oa.step()
        ob.step()
        _assert_bitwise(oa, pa, ob, pb, f"{name} step {step}")
        assert all(p.grad is v for p, v in zip(pa, views)), f"step {step}: a grad was rebound"
        assert not any(s.has_grad_buffer for s in _sets(oa)), f"step {step}: grads were adopted"
        assert oa.recombine_count == 1
        oa.zero_grad(set_to_none=set_to_none)
        ob.zero_grad()
        if not set_to_none:
            assert not bucket.any()  # zeroed where they are


@pytest.mark.parametrize("cls,kw", [(NpuFusedSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
                                    (NpuFusedAdam, dict(lr=1e-2, weight_decay=0.1))], ids=["sgd", "adam"])
def test_torch_executor_fresh_and_kept_grads_are_bitwise_equal(cls, kw, monkeypatch):
    """The torch executor's fused op runs once per slot whether it reads fresh grads in place or the slot views:
    torch's CPU fused kernels round a slot differently as its own tensor (vector tail) than inside a flat run, so
    calls over flat runs would make the kept-grads run differ from the fresh-grads run in the last bit."""
    monkeypatch.setattr(_core, "uses_kernel", lambda *tensors: False)
    for step, oa, pa, ob, pb in _paired_steps(lambda ps: cls(_groups(ps, cls), **kw), 9, 6, _fresh, _kept):
        assert oa.last_executor == ob.last_executor == "torch"
        assert all(s.gathered for s in _sets(oa) if s.total)
        assert not any(s.has_grad_buffer for s in _sets(oa))
        _assert_bitwise(oa, pa, ob, pb, f"step {step}")


@pytest.mark.parametrize("name,cls,kw", GATHER, ids=IDS)
def test_mixed_modes_between_and_within_steps(name, cls, kw):
    """Some grads slot views, some fresh, some None; modes switching between steps."""
    dtype = torch.float32
    pa, pb = _params(dtype, 3), _params(dtype, 3)
    oa, ob = cls(_groups(pa, cls), **kw), cls(_groups(pb, cls), **kw)
    gen = torch.Generator().manual_seed(2)
    for step in range(8):
        grads = _draw(gen, pa, step, dtype)
        for p, g in zip(pa, grads):
            _kept(p, g)
        for k, (p, g) in enumerate(zip(pb, grads)):
            (_fresh if (step + k) % 3 == 0 or step in (2, 3) else _kept)(p, g)
        if step == 5:
            ob.zero_grad(set_to_none=False)  # zeroes the fresh grads in place; backward-like add follows
            for p, g in zip(pb, grads):
                if g is not None and p.grad is not None:
                    p.grad.add_(g)
                elif g is not None:
                    p.grad = g.clone()
                else:
                    p.grad = None
        oa.step()
        ob.step()
        _assert_bitwise(oa, pa, ob, pb, f"{name} step {step}")


TORCH_EQ = [
    ("adam", NpuFusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    ("adamw", NpuFusedAdamW, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    ("sgd", NpuFusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("adadelta", NpuFusedAdadelta, torch.optim.Adadelta, dict(lr=1.0)),
    ("rmsprop", NpuFusedRMSprop, torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    # NVIDIA's classes where torch computes the same math (FusedAdam's default adam_w_mode is AdamW)
    ("fused_adam", FusedAdam, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    ("fused_sgd", FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("fused_adagrad", FusedAdagrad, torch.optim.Adagrad, dict(lr=1e-2, weight_decay=0.01)),
]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3))


@pytest.mark.parametrize("mode", ["optimizer_none", "module_none", "kept", "alternate"])
@pytest.mark.parametrize("name,ours,ref,kw", TORCH_EQ, ids=[t[0] for t in TORCH_EQ])
def test_matches_torch_in_every_zero_grad_mode(name, ours, ref, kw, mode):
    m = _model()
    r = copy.deepcopy(m)
    params = list(m.parameters())
    groups = [{"params": params[:2]}, {"params": params[2:4], "lr": kw["lr"] * 0.5}, {"params": params[4:]}]
    rparams = list(r.parameters())
    rgroups = [{"params": rparams[:2]}, {"params": rparams[2:4], "lr": kw["lr"] * 0.5}, {"params": rparams[4:]}]
    o, t = ours(groups, **kw), ref(rgroups, **kw)
    x = torch.randn(9, 6)
    p0max = max(float(p.detach().abs().max()) for p in params)
    # NVIDIA's classes count steps per group, so a param that misses a step is bias-corrected unlike torch's
    per_param_steps = ours._has_step
    for step in range(7):
        set_to_none = mode != "kept" and not (mode == "alternate" and step % 2)
        if mode == "module_none":
            m.zero_grad()
            r.zero_grad()
        else:
            o.zero_grad(set_to_none=set_to_none)
            t.zero_grad(set_to_none=set_to_none)
        if step == 3 and per_param_steps:  # the last layer gets no grad this step: skipped, step count kept
            m[4].requires_grad_(False)
            r[4].requires_grad_(False)
        m(x * (1 + step)).pow(2).mean().backward()
        r(x * (1 + step)).pow(2).mean().backward()
        m[4].requires_grad_(True)
        r[4].requires_grad_(True)
        o.step()
        t.step()
        if set_to_none and step:
            assert any(s.gathered for s in _sets(o)), "fresh grads should be read in place"
    for k, (p, q) in enumerate(zip(params, rparams)):
        assert_close_rel(p, q, p0max, f"param {k}")
        for n, v in t.state[q].items():
            if n == "step":
                # NVIDIA's FusedAdagrad keeps no count (its math does not use one)
                got = o.state[p]["step"] if per_param_steps else o.param_groups[k // 2].get("step")
                assert got is None or float(got) == float(v), f"param {k} step"
            else:
                # fp32 rounding differs from torch's op order; centered RMSprop amplifies it in its buffers
                assert_close_rel(o.state[p][n], v, 10 * float(v.abs().max()) + 1e-12, f"param {k} state {n}")


def test_grads_that_cannot_be_read_in_place_are_copied():
    """Strides unlike the param's slot, or memory the update writes: copied, results unchanged."""
    pa, pb = _params(torch.float32, 5), _params(torch.float32, 5)
    oa, ob = NpuFusedAdam(pa, lr=1e-2), NpuFusedAdam(pb, lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        grads = _draw(gen, pa, step, torch.float32)
        grads = [g if g is not None else torch.randn(p.shape, generator=gen) for p, g in zip(pa, grads)]
        for p, g in zip(pa, grads):
            _kept(p, g)
        for p, g in zip(pb, grads):
            p.grad = g.clone()
        # a transposed (non-contiguous) grad of equal values
        pb[0].grad = grads[0].t().contiguous().t()
        if step >= 1:
            # a grad living inside the optimizer's own state buffer, which the update writes: copied first
            view = _sets(ob)[0].state_views["exp_avg_sq"][2]
            pb[2].grad = view
            pa[2].grad.copy_(view)
        oa.step()
        ob.step()
        _assert_bitwise(oa, pa, ob, pb, f"step {step}")


def _read_in_place(opt):
    """Per param of the first flat set: whether this step's grad would be read where it is (not copied)."""
    s = _sets(opt)[0]
    gs, ptrs = s.scan_grads()
    table, todo, _ = s.plan_gather(gs, ptrs)
    copied = {k for k, _ in todo}
    return [k not in copied for k in range(s.nseg)], table


@pytest.mark.parametrize("param_layout", ["contiguous", "transposed"])
def test_grad_layout_rules_for_reading_in_place(param_layout):
    """A grad is read in place iff its elements lie as in the param's slot: for contiguous params any contiguous
    grad (strides of size-1 dims do not matter), else the same strides; others are copied. Results are bitwise
    those of the grads-kept path either way."""
    gen = torch.Generator().manual_seed(7)
    base = [torch.randn(4, 1, 3, generator=gen), torch.randn(5, 6, generator=gen)]
    if param_layout == "transposed":  # params that are not contiguous: the flat set keeps their strides
        base = [t.transpose(0, -1).contiguous().transpose(0, -1) for t in base]
    pa = [torch.nn.Parameter(t.clone()) for t in base]
    pb = [torch.nn.Parameter(t.clone()) for t in base]
    oa, ob = NpuFusedAdam(pa, lr=1e-2), NpuFusedAdam(pb, lr=1e-2)
    for step in range(3):
        grads = [torch.randn(t.shape, generator=gen) for t in base]
        for p, g in zip(pa, grads):
            _kept(p, g)
        # grad 0: size-1 dim with an odd stride (still contiguous); grad 1: the param's strides, or transposed
        g0 = torch.empty_strided((4, 1, 3), (3, 99, 1))
        g0.copy_(grads[0])
        g1 = torch.empty_strided(pb[1].shape, pb[1].stride()) if step != 1 else grads[1].t().contiguous().t()
        g1.copy_(grads[1])
        pb[0].grad, pb[1].grad = g0, g1
        if step >= 1:
            readable, table = _read_in_place(ob)
            same_layout_1 = g1.stride() == pb[1].stride() or (g1.is_contiguous() and pb[1].is_contiguous())
            assert readable == [pb[0].is_contiguous(), same_layout_1], (param_layout, step)
            if readable[0]:
                assert int(table[0]) == g0.data_ptr()
        oa.step()
        ob.step()
        _assert_bitwise(oa, pa, ob, pb, f"{param_layout} step {step}")


def test_zero_grad_drops_every_grad_under_torchs_profiler_label():
    ps = _params(torch.float32, 9)
    opt = NpuFusedAdam(_groups(ps, NpuFusedAdam), lr=1e-2)
    for _ in range(2):
        for k, p in enumerate(ps):
            p.grad = None if k == 2 else torch.ones_like(p)  # one param without a grad: stays None
        opt.step()
        with torch.autograd.profiler.profile() as prof:
            opt.zero_grad()
        assert all(p.grad is None for p in ps)
        assert f"Optimizer.zero_grad#{type(opt).__name__}.zero_grad" in {e.name for e in prof.function_events}
    ref = torch.optim.Adam([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2)
    assert opt._zero_grad_profile_name.replace(type(opt).__name__, "Adam") == ref._zero_grad_profile_name


def test_fused_lamb_l2_mode_copies_fresh_grads():
    """FusedLAMB with adam_w_mode=False and weight decay forms g/c + wd*p from the flat grad buffer: fresh grads
    are copied in there (not read in place) and the update matches the grads-kept path bitwise."""
    pa, pb = _params(torch.float32, 11), _params(torch.float32, 11)
    kw = dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False, max_grad_norm=0.5)
    oa, ob = FusedLAMB(_groups(pa, FusedLAMB), **kw), FusedLAMB(_groups(pb, FusedLAMB), **kw)
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        grads = _draw(gen, pa, step, torch.float32)
        for p, g in zip(pa, grads):
            _kept(p, g)
        for p, g in zip(pb, grads):
            _fresh(p, g)
        oa.step()
        ob.step()
        _assert_bitwise(oa, pa, ob, pb, f"step {step}")
        assert not any(s.gathered for s in _sets(ob))


@pytest.mark.parametrize("cls,kw", [(FusedLAMB, dict(max_grad_norm=1.0)), (FusedLAMB, dict(max_grad_norm=None)),
                                    (FusedNovoGrad, {}), (NpuFusedLamb, dict(use_global_grad_norm=True)),
                                    (FusedAdam, {}), (FusedMixedPrecisionLamb, {})],
                         ids=["fused_lamb", "fused_lamb_noclip", "novograd", "lamb_global_norm", "fused_adam",
                              "fused_mp_lamb"])
def test_bad_fresh_grad_leaves_group_steps_and_states_unchanged(cls, kw):
    """Optimizers that read every grad before the first update (global norms, per-group step counts) reject a
    bad fresh grad in the last group before any count, norm or state moves."""
    _check_bad_last_grad_changes_nothing(cls, kw, torch.float32, torch.float64, seed=12)


def _check_bad_last_grad_changes_nothing(cls, kw, dtype, bad_dtype, seed):
    """One good step, then fresh grads whose last one has `bad_dtype`: the step raises and changes nothing."""
    ps = _params(dtype, seed)
    opt = cls(_groups(ps, cls), lr=1e-2, **kw)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    for p in ps:
        p.grad = torch.ones_like(p)
    ps[-1].grad.data = torch.ones(ps[-1].shape, dtype=bad_dtype)
    snap = snapshot(opt, ps)
    with pytest.raises(RuntimeError, match="dtype"):
        opt.step()
    assert_unchanged(opt, ps, snap)


SHADOWED = [
    ("fused_adam_master", FusedAdam, dict(capturable=True, master_weights=True)),
    ("fused_mp_lamb", FusedMixedPrecisionLamb, dict(max_grad_norm=0.5)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name,cls,kw", SHADOWED, ids=[t[0] for t in SHADOWED])
def test_shadowed_params_read_model_grads_in_place(name, cls, kw, dtype, monkeypatch):
    """fp16/bf16 params updated through fp32 master weights: the kernel reads the model grads where they are, in
    the model dtype (no converted copy); bitwise the update from converted copies (`mirror_grads`, forced here); a
    model grad that cannot be read in place (transposed) sends its set back to the copies for that step."""
    from apex.optimizers._nvidia import ShadowSet

    if cls is FusedMixedPrecisionLamb:
        kw = dict(kw, reduced_precision_dtype=dtype)
    pa, pb = _params(dtype, 13), _params(dtype, 13)
    oa, ob = cls(_groups(pa, cls), lr=1e-2, **kw), cls(_groups(pb, cls), lr=1e-2, **kw)
    mirror_only = ShadowSet.bind_model_grads
    gen = torch.Generator().manual_seed(14)
    for step in range(6):
        grads = _draw(gen, pa, step, dtype)
        if step == 4:  # a non-contiguous grad of the right shape: not readable in place
            grads[0] = torch.randn(5, 7, generator=gen).to(dtype).t()
        for p, g in zip(pa, grads):
            _fresh(p, g)
        fresh = [None if g is None else g.clone() for g in grads]
        for p, g in zip(pb, fresh):
            p.grad = g
        monkeypatch.setattr(ShadowSet, "bind_model_grads", lambda self: False)
        oa.step()
        monkeypatch.setattr(ShadowSet, "bind_model_grads", mirror_only)
        ob.step()
        _assert_bitwise(oa, pa, ob, pb, f"{name} step {step}")
        gathered = [s.gathered for s in _sets(ob) if isinstance(s, ShadowSet)]
        assert len(gathered) == 3 and not any(s.gathered for s in _sets(oa))
        assert gathered == ([False, True, True] if step == 4 else [True] * 3), gathered
        assert ob.last_executor == "apex_C" and ob.recombine_count == 1
        for p, g in zip(pb, fresh):
            assert p.grad is g, "p.grad must stay the caller's tensor"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_adam_low_precision_params_hold_only_fp32_moments(dtype):
    """NVIDIA's FusedAdam layout for fp16/bf16 params without master weights: the params are updated in place, in
    their dtype (the set's flat buffer is the params' own memory, no fp32 copy of them), the moments are fp32, and
    with torch's default zero_grad() no grad buffer is made: the optimizer holds 8 bytes per param, as NVIDIA's."""
    from apex.optimizers._nvidia import ShadowSet

    ps = _params(dtype, 21)
    opt = FusedAdam(_groups(ps, FusedAdam), lr=1e-2)
    gen = torch.Generator().manual_seed(22)
    for step in range(4):
        for p, g in zip(ps, _draw(gen, ps, step, dtype)):
            _fresh(p, g)
        opt.step()
        opt.zero_grad()
    sets = _sets(opt)
    assert sets and not any(isinstance(s, ShadowSet) for s in sets)
    for s in sets:
        assert s.dtype == dtype and s.state_dtype == torch.float32 and not s.has_grad_buffer
        assert [p.data_ptr() for p in s.params] == s.param_ptrs  # the params live in the set's buffer
        assert all(flat.dtype == torch.float32 for flat in s.flat_s.values())
    held = sum(f.numel() * f.element_size() for s in sets for f in s.flat_s.values())
    assert held == 8 * sum(s.total for s in sets)
    assert {v.dtype for st in opt.state.values() for v in st.values()} == {torch.float32}


LOW_PRECISION_UPDATES = [("fused_adam", FusedAdam, {}), *SHADOWED]


@pytest.mark.parametrize("name,cls,kw", LOW_PRECISION_UPDATES, ids=[t[0] for t in LOW_PRECISION_UPDATES])
def test_bad_model_grad_of_a_low_precision_param_raises_before_any_change(name, cls, kw):
    if cls is FusedMixedPrecisionLamb:
        kw = dict(kw, reduced_precision_dtype=torch.bfloat16)
    _check_bad_last_grad_changes_nothing(cls, kw, torch.bfloat16, torch.float32, seed=15)


def test_a_grad_view_whose_storage_was_swapped_is_not_written_through():
    """Kept grads live in the flat buffer as slot views; ``p.grad.data = x`` makes that view object view ``x``.
    When a later grad cannot be read in place (expanded here) and is copied into its slot, the copy goes into the
    flat buffer through a new view: the update uses the new grad, and the caller's ``x`` is not written."""
    a, t = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    ours, ref = NpuFusedSGD([a], lr=1.0), torch.optim.SGD([t], lr=1.0)
    a.grad, t.grad = torch.ones(4), torch.ones(4)
    for _ in range(2):  # kept: adopted into the flat grad buffer at the second step
        ours.step()
        ref.step()
    x = torch.full((4,), 5.0)
    a.grad.data = x
    a.grad = torch.tensor(-2.0).expand(4)
    t.grad = torch.tensor(-2.0).expand(4)
    ours.step()
    ref.step()
    assert torch.equal(a.detach(), t.detach())
    assert torch.equal(x, torch.full((4,), 5.0)), "the caller's tensor was written"


@pytest.mark.parametrize("name,cls,kw", [("sgd", NpuFusedSGD, dict(lr=1.0)), ("fused_adam", FusedAdam, dict(lr=0.1))],
                         ids=["sgd", "fused_adam"])
def test_a_grad_with_the_negation_bit_is_read_by_value(name, cls, kw):
    """A grad whose memory holds the negated values behind torch's lazy negation bit (``x.conj().imag``) is
    copied (which resolves it) instead of read in place: the update is that of its values."""
    z = torch.tensor([1 + 2j, 3 - 4j, 0.5 + 0j]).conj().imag
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    oa, ob = cls([a], **kw), cls([b], **kw)
    a.grad, b.grad = z, z.resolve_neg()
    oa.step()
    ob.step()
    assert torch.equal(a.detach(), b.detach()) and torch.equal(a.grad, z.resolve_neg())


def test_grad_overlapping_the_param_buffer_is_copied_first():
    p = torch.nn.Parameter(torch.randn(6, 4))
    q = torch.nn.Parameter(p.detach().clone())
    oa, ob = NpuFusedSGD([p], lr=0.5), NpuFusedSGD([q], lr=0.5)
    q.grad = torch.ones(6, 4)
    p.grad = torch.ones(6, 4)
    oa.step()
    ob.step()
    g = p.detach().clone()
    # the grad is the param itself: the kernel must not read what it is writing
    p.grad = p.detach()
    q.grad = g
    oa.step()
    ob.step()
    assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("bad", ["dtype", "shape", "sparse"])
def test_bad_fresh_grads_raise_before_any_change(bad):
    ps = _params(torch.float32, 6)
    opt = NpuFusedAdam([{"params": ps[:3]}, {"params": ps[3:]}], lr=1e-2)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    for p in ps:
        p.grad = torch.ones_like(p)
    snap = snapshot(opt, ps)
    if bad == "dtype":
        ps[5].grad.data = torch.ones(ps[5].shape, dtype=torch.float64)
        match = "dtype"
    elif bad == "shape":
        ps[5].grad.data = torch.ones(3, 3)
        match = "shape"
    else:
        ps[5].grad = torch.ones_like(ps[5]).to_sparse()
        match = "sparse"
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    assert_unchanged(opt, ps, snap)


@pytest.mark.parametrize("cls,executor", [(NpuFusedAdamW, "auto"), (NpuFusedAdamW, "torch"), (NpuFusedSGD, "torch"),
                                          (FusedAdam, "torch")])
def test_no_reference_to_fresh_grads_is_kept(cls, executor):
    """After a gather step the optimizer holds no fresh grad: set_to_none frees the memory (also the torch
    executor's, whose update takes the grads the step's checks read)."""
    import weakref

    ps = _params(torch.float32, 7)
    opt = cls(ps, lr=1e-2)
    opt.executor = executor
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    for p in ps:
        p.grad = torch.ones_like(p)
    refs = [weakref.ref(p.grad) for p in ps]
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("executor", ["torch", "torch_ops"])
def test_torch_executors_with_fresh_grads(executor, monkeypatch):
    """Executors other than the kernel still give the kernel's results with fresh grads (copied in)."""
    executors = iter(["auto", executor])

    def make(ps):
        opt = NpuFusedAdam(ps, lr=1e-2)
        opt.executor = next(executors)
        return opt

    for _, _, pa, ob, pb in _paired_steps(make, 8, 4, _fresh, _fresh):
        assert ob.last_executor == "torch"
        last = pa, pb
    for k, (x, y) in enumerate(zip(*last)):
        assert_close_rel(x, y, 4.0, f"param {k}")


# ------------------------------------------------------------------ amp
@pytest.fixture
def amp_models():
    from _amp_harness import bn_mlp

    torch.manual_seed(0)
    return bn_mlp(6, 8, 3)


def _amp_run(model, opt_level, combine, set_to_none, steps=6, inf_at=3, loss_scale="dynamic"):
    from apex import amp

    opt = NpuFusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, combine_grad=combine or None, verbosity=0,
                                loss_scale=loss_scale)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(3))
    for step in range(steps):
        if set_to_none:
            model.zero_grad()
        else:
            opt.zero_grad(set_to_none=False)
        loss = model(x * (1 + 0.1 * step)).float().pow(2).mean()
        if step == inf_at:
            loss = loss * float("inf")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    out = [p.detach().clone() for p in model.parameters()]
    amp.deinitialize()
    return out, opt


@pytest.mark.parametrize("combine", [False, True], ids=["plain", "combine_grad"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_amp_model_zero_grad_each_step(amp_env, amp_models, opt_level, combine):
    """amp with model.zero_grad() (grads set to None) every step == amp with grads zeroed in place."""
    ma, mb = copy.deepcopy(amp_models), copy.deepcopy(amp_models)
    a, _ = _amp_run(ma, opt_level, combine, set_to_none=True)
    b, _ = _amp_run(mb, opt_level, combine, set_to_none=False)
    for k, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"param {k}"


def test_amp_combined_unscales_fresh_grads_in_place(amp_env, amp_models):
    """O1 + combine_grad + model.zero_grad(): no adoption copy at the exit, no re-combine at the step."""
    from apex import amp

    model = amp_models
    opt = NpuFusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O1", combine_grad=True, verbosity=0)
    x = torch.randn(16, 6)
    counts = []
    for _ in range(4):
        model.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        grads = [p.grad for p in model.parameters()]
        opt.step()
        assert all(a is b for a, b in zip(grads, [p.grad for p in model.parameters()])), "grads were rebound"
        counts.append(opt.recombine_count)
    assert counts[1:] == [counts[1]] * 3, f"re-combined while reading fresh grads: {counts}"
    stash = opt._amp_stash
    assert stash.combined.gathered


def test_amp_unscale_many_matches_torch_foreach():
    from apex.amp._unscale import unscale_

    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        ts = [torch.randn(s, generator=gen).to(dtype) * 1024 for s in [(7, 5), (0,), (70001,), (3,)]]
        ref = [t.clone() for t in ts]
        found_inf = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_([r.float() for r in ref], found_inf, torch.ones(1))
        assert unscale_(ts, 1 / 1024, True) is False
        for t, r in zip(ts, ref):
            assert torch.equal(t, (r.float() / 1024).to(dtype))
        ts[2][123] = float("nan")
        assert unscale_(ts, 0.5, True) is True


@pytest.mark.parametrize("seed", range(4))
def test_the_python_screen_of_grad_addresses_agrees_with_the_tensor_test(seed, monkeypatch):
    """`FlatSet._clear_of` only lets through address tables the exact tensor test passes: the slots to copy are
    the same with and without it, over tables with grads far from the written buffers, inside them, ending exactly
    where one starts, reaching one byte into it, starting at its end, and misaligned."""
    import random

    from apex.optimizers import _flat

    ps = _params(torch.float32, seed)
    opt = NpuFusedSGD(ps, lr=0.1, momentum=0.9)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    s = opt._groups[0].sets[0]
    writes = [s.flat_p, *s.flat_s.values()]
    spans = [(w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()) for w in writes]
    sizes = [p.numel() * 4 for p in s.params]
    rng = random.Random(seed)
    far = max(hi for _, hi in spans) + (1 << 30)
    outcomes = set()
    for _ in range(300):
        ptrs = [far + 4096 * rng.randrange(1 << 20) for _ in sizes]
        for _ in range(rng.randrange(3)):
            k = rng.randrange(len(sizes))
            lo, hi = spans[rng.randrange(len(spans))]
            ptrs[k] = rng.choice([lo - sizes[k], lo - sizes[k] + 4, lo - sizes[k] - 4, hi, hi - 4, (lo + hi) // 2 & ~3,
                                  ptrs[k] + 2])
        table = _core.int_table(ptrs)
        fast = s._not_readable(table, None, [], False, 4, ptrs)
        monkeypatch.setattr(_flat, "PY_SCAN_MAX", 0)
        exact = s._not_readable(table, None, [], False, 4, ptrs)
        monkeypatch.undo()
        assert fast == exact, ptrs
        outcomes.add(bool(exact))
    assert outcomes == {True, False}


@pytest.mark.parametrize("nparams", [1, 3])
def test_the_python_screen_is_exact_for_grads_just_below_a_buffer(nparams, monkeypatch):
    """A grad that ends at or before a written buffer's start (the allocator often puts a small group's fresh
    grads right below its buffers) passes the Python screen without the tensor test; one that reaches a byte
    into the buffer does not; both agree with the tensor test, for the slots with a grad (``live``) too."""
    from apex.optimizers import _flat

    ps = [torch.nn.Parameter(torch.randn(5 + k)) for k in range(nparams)]
    opt = NpuFusedSGD(ps, lr=0.1, momentum=0.9)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    s = opt._groups[0].sets[0]
    spans = [(w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()) for w in (s.flat_p, *s.flat_s.values())]
    lo = min(a for a, _ in spans)
    far = max(b for _, b in spans) + (1 << 30)
    sizes = [p.numel() * 4 for p in ps]
    for gap, clear in ((0, True), (64, True), (-4, False)):
        ptrs = [far + 4096 * k for k in range(nparams)]
        ptrs[-1] = lo - sizes[-1] - gap  # the last slot's grad ends `gap` bytes below the lowest buffer
        for live in (None, list(range(nparams))[-1:]):
            use = ptrs if live is None else [ptrs[k] for k in live]
            assert s._clear_of(use, live, spans, 4) is clear, (gap, live)
            table = _core.int_table(use)
            fast = s._not_readable(table, live, [], False, 4, use)
            monkeypatch.setattr(_flat, "PY_SCAN_MAX", 0)
            exact = s._not_readable(table, live, [], False, 4, use)
            monkeypatch.undo()
            assert fast == exact and bool(exact) is not clear, (gap, live, fast, exact)


class _GradSubclass(torch.Tensor):
    """A tensor subclass that changes nothing (its Python type is what differs)."""


def _count_validations(monkeypatch):
    """How many times `plan_gather` ran the full per-property validation of its grads."""
    from apex.optimizers import _flat

    calls = []
    real = _flat.FlatSet._check_grad_meta

    def counting(self, *a, **kw):
        calls.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(_flat.FlatSet, "_check_grad_meta", counting)
    return calls


def test_the_meta_guard_rejects_every_difference_the_validation_looks_for():
    from apex import _meta_guard

    assert _meta_guard._works(), "this torch's TensorGuards does not behave as the gather path relies on"
    g = _meta_guard.guard([torch.zeros(2, 3), torch.zeros(4, dtype=torch.bfloat16)])
    assert g.matches([torch.ones(2, 3), torch.ones(4, dtype=torch.bfloat16)]) and g.hits == 1
    for other in ([torch.ones(2, 3)], [torch.ones(2, 3), torch.ones(4)], [torch.ones(2, 3), None],
                  [torch.ones(3, 2).t(), torch.ones(4, dtype=torch.bfloat16)], [1, 2], []):
        assert not g.matches(other), other
    assert g.hits == 1


@pytest.mark.parametrize("change", ["dtype", "shape", "strides", "neg", "requires_grad", "subclass", "none"])
def test_grads_that_change_after_the_guard_matched_are_validated_again(change, monkeypatch):
    """Steps after the first read fresh grads whose metadata the last validated ones had without validating
    them property by property (`apex._meta_guard`): a grad that differs from them in any property is validated
    again, and is refused (dtype, shape) or read as the full path reads it (copied, or by value), with results
    bitwise those of grads given plainly; later steps with plain grads match again."""
    validations = _count_validations(monkeypatch)
    pa, pb = _params(torch.float32, 11), _params(torch.float32, 11)
    oa, ob = NpuFusedAdam(_groups(pa, NpuFusedAdam), lr=1e-2), NpuFusedAdam(_groups(pb, NpuFusedAdam), lr=1e-2)
    gen = torch.Generator().manual_seed(11)
    k = 0  # the (7, 5) param
    for step in range(6):
        grads = [torch.randn(p.shape, generator=gen) for p in pa]
        for p, g in zip(pa, grads):
            _fresh(p, g)
        for p, g in zip(pb, grads):
            _fresh(p, g)
        before = len(validations)
        if step == 3:
            if change in ("dtype", "shape"):
                snap = snapshot(ob, pb)
                pb[k].grad.data = (torch.ones(pb[k].shape, dtype=torch.float64) if change == "dtype"
                                   else torch.ones(5, 7))
                with pytest.raises(RuntimeError, match=change):
                    ob.step()
                assert_unchanged(ob, pb, snap)
                pb[k].grad = grads[k].clone()
            elif change == "strides":
                pb[k].grad = grads[k].t().contiguous().t()
            elif change == "neg":
                pb[k].grad = (-grads[k])._neg_view()
            elif change == "requires_grad":
                pb[k].grad = grads[k].clone().requires_grad_()
            elif change == "subclass":
                pb[k].grad = grads[k].clone().as_subclass(_GradSubclass)
            else:
                pb[len(pb) - 1].grad = None
                pa[len(pa) - 1].grad = None
        oa.step()
        ob.step()
        _assert_bitwise(oa, pa, ob, pb, f"{change} step {step}")
        if step in (1, 2, 5):  # grads like the last validated ones: no validation, for each of the three sets
            assert len(validations) == before, (change, step)
        if step == 3:
            assert len(validations) > before, change
        for p in pa + pb:
            p.grad = None


def test_without_a_usable_meta_guard_every_step_validates(monkeypatch):
    """On a torch whose guard fails the self-test, each fresh-grad step runs the full validation."""
    from apex import _meta_guard

    monkeypatch.setattr(_meta_guard, "_USABLE", False)
    validations = _count_validations(monkeypatch)
    ps = _params(torch.float32, 3)
    opt = NpuFusedSGD(ps, lr=0.1)
    for _ in range(3):
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
    assert len(validations) == 3 * len(_sets(opt))


def test_guards_for_grads_that_change_at_every_step_are_rebuilt_ever_more_rarely(monkeypatch):
    """Where the slots with a grad differ at every step, no guard matches; one is rebuilt only after twice as many
    misses as the last (building costs about a validation): after steps 0, 1, 3, 7, 15 and 31 of 60. When the
    grads settle, a guard of them is built within `PATIENCE_MAX` steps and matches from then on."""
    from apex import _meta_guard

    builds = []
    real = _meta_guard.guard
    monkeypatch.setattr(_meta_guard, "guard", lambda gs: builds.append(len(gs)) or real(gs))
    ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(8)]
    ts = [torch.nn.Parameter(torch.zeros(3)) for _ in range(8)]
    opt, ref = NpuFusedSGD(ps, lr=0.1), torch.optim.SGD(ts, lr=0.1)

    def step(live):
        for k, (p, t) in enumerate(zip(ps, ts)):
            p.grad = torch.full((3,), k + 1.0) if live(k) else None
            t.grad = None if p.grad is None else p.grad.clone()
        opt.step()
        ref.step()

    for i in range(60):
        step(lambda k, i=i: (i >> k) & 1 or k == 7)  # another set of slots at every step
    assert builds == [1, 2, 3, 4, 5, 6], builds  # the live slots at steps 0, 1, 3, 7, 15, 31
    validations = _count_validations(monkeypatch)
    for _ in range(_meta_guard.PATIENCE_MAX + 5):
        step(lambda k: True)
    assert 1 <= len(validations) <= _meta_guard.PATIENCE_MAX + 1
    n = len(validations)
    for _ in range(3):
        step(lambda k: True)
    assert len(validations) == n
    for p, t in zip(ps, ts):
        torch.testing.assert_close(p.detach(), t.detach(), rtol=1e-6, atol=0)


def test_a_meta_guard_only_matches_under_the_dispatch_sets_it_was_built_under():
    """With the negation key excluded for the thread, a tensor with the negation bit and one without show the same
    dispatch keys to the guard's comparison: it then matches nothing (the full validation runs)."""
    from apex import _meta_guard

    g = _meta_guard.guard([torch.zeros(3)])
    neg = torch._C.DispatchKeySet(torch._C.DispatchKey.Negative)
    with torch._C._ExcludeDispatchKeyGuard(neg):
        assert not g.matches([torch.ones(3)._neg_view()])
        assert not g.matches([torch.ones(3)])
    with torch.inference_mode():
        assert not g.matches([torch.ones(3)])
    assert g.matches([torch.ones(3)]) and not g.matches([torch.ones(3)._neg_view()])


_GRAD_KINDS = ["fresh", "none", "kept", "transposed", "neg", "requires_grad", "float64_data"]


@settings(max_examples=25, deadline=None, database=None, phases=(Phase.explicit, Phase.generate))
@given(plan=st.lists(st.one_of(st.just("again"), st.lists(st.sampled_from(_GRAD_KINDS), min_size=4, max_size=4)),
                     min_size=2, max_size=9),
       seed=st.integers(0, 2**16))
def test_random_grad_histories_match_an_optimizer_that_validates_every_step(plan, seed):
    """Random per-param grad histories (fresh, None, kept, transposed, negation bit, requires_grad, float64 data
    behind the grad; "again": the kinds of the step before, so that guards match): an optimizer that skips the
    validation of grads like the last validated ones (its guard) and one that validates at every step (no guard)
    step to the same bits, and refuse the same steps with nothing changed."""
    from apex import _meta_guard

    usable = _meta_guard._works()
    shapes = [(3, 5), (7,), (2, 2), (4, 1, 3)]
    gen = torch.Generator().manual_seed(seed)
    pa = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    oa, ob = NpuFusedAdam(pa, lr=1e-2, weight_decay=0.01), NpuFusedAdam(pb, lr=1e-2, weight_decay=0.01)
    kinds = ["fresh"] * len(shapes)
    for i, step_kinds in enumerate(plan):
        kinds = kinds if step_kinds == "again" else step_kinds
        for k, kind in enumerate(kinds):
            g = torch.randn(shapes[k], generator=gen)
            for p in (pa[k], pb[k]):
                if kind == "none":
                    p.grad = None
                elif kind == "kept" and p.grad is not None and p.grad.dtype == p.dtype:
                    with torch.no_grad():
                        p.grad.copy_(g)
                elif kind == "transposed" and g.dim() >= 2:
                    p.grad = g.transpose(0, 1).contiguous().transpose(0, 1)
                elif kind == "neg":
                    p.grad = (-g)._neg_view()
                elif kind == "requires_grad":
                    p.grad = g.clone().requires_grad_()
                elif kind == "float64_data":
                    p.grad = g.clone()
                    p.grad.data = g.double()
                else:
                    p.grad = g.clone()
        errors = []
        for opt, ps, guard in ((oa, pa, usable), (ob, pb, False)):
            before = snapshot(opt, ps)
            _meta_guard._USABLE = guard
            try:
                opt.step()
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e))
                assert_unchanged(opt, ps, before)
            finally:
                _meta_guard._USABLE = None
        assert errors[0] == errors[1], (i, kinds)
        _assert_bitwise(oa, pa, ob, pb, f"step {i} {kinds}")
