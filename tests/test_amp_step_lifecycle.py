"""What the grads hold between amp's events when a script strays from the one-backward-one-step loop: a step or a
clip with no backward since the last step or ``zero_grad``, ``zero_grad`` inside a ``delay_unscale`` chain, an
optimizer state_dict round trip between steps, steps after an overflow, and an overflow found by a
``delay_overflow_check`` block of another loss. Each sequence runs with and without ``combine_grad``: the two must
agree (rtol 1e-6), and where plain torch has the same semantics, match it (bf16 model, atol 2e-2)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from apex import amp
from apex.optimizers import FusedSGD, NpuFusedSGD

pytestmark = pytest.mark.usefixtures("amp_env")

COMBINE = [None, True]


def _model(bn=False):
    """Two linears; ``bn``: a BatchNorm between them, whose params O2 keeps in fp32 (their own masters)."""
    torch.manual_seed(0)
    if bn:
        return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _batch(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)


_OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "npu_sgd": lambda ps: NpuFusedSGD(ps, lr=0.1, momentum=0.9),
    "fused_sgd": lambda ps: FusedSGD(ps, lr=0.1),
}


def _run(ops, combine, opt_level="O1", loss_scale=128.0, opt="sgd", num_losses=1, bn=False, **extra):
    """Runs ``ops`` under amp; returns the params the optimizer steps on, the loss scales and the clip norms.

    ops: ("fb", {overflow, delay, check, loss_id, step_inside}) a scaled forward/backward (and a step inside its
    block); ("step",); ("zero",) the optimizer's
    zero_grad(); ("model_zero",) model.zero_grad(); ("clip",) clip_grad_norm_ of the master params (norm recorded);
    ("roundtrip",) opt.load_state_dict(opt.state_dict()); ("noop",) nothing (keeps later batches aligned)."""
    model = _model(bn)
    o = _OPTIMIZERS[opt](model.parameters())
    model, o = amp.initialize(model, o, opt_level=opt_level, combine_grad=combine, loss_scale=loss_scale,
                              num_losses=num_losses, verbosity=0, cast_model_outputs=torch.float32,
                              **(extra if combine else {}))
    norms = []
    for i, (kind, *args) in enumerate(ops):
        a = args[0] if args else {}
        if kind == "fb":
            x, t = _batch(i)
            loss = (model(x) - t).pow(2).mean()
            if a.get("overflow"):
                loss = loss * float("inf")
            with amp.scale_loss(loss, o, loss_id=a.get("loss_id", 0), delay_unscale=a.get("delay", False),
                                delay_overflow_check=a.get("check", False)) as scaled:
                scaled.backward()
                if a.get("step_inside"):  # the step indented into the block
                    o.step()
        elif kind == "step":
            o.step()
        elif kind == "zero":
            o.zero_grad()
        elif kind == "model_zero":
            model.zero_grad()
        elif kind == "clip":
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(amp.master_params(o)), 1e9)))
        elif kind == "roundtrip":
            o.load_state_dict(copy.deepcopy(o.state_dict()))
        elif kind != "noop":
            raise AssertionError(kind)
    params = [p.detach().float().clone() for p in amp.master_params(o)]
    scales = [s.loss_scale() for s in amp._amp_state.loss_scalers]
    amp.deinitialize()
    return params, scales, norms


def _torch_run(ops):
    """Plain torch for the ops that have torch semantics: fp32 params, a bf16 autocast forward, SGD momentum."""
    model = _model()
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i, (kind, *_args) in enumerate(ops):
        if kind == "fb":
            x, t = _batch(i)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            (out.float() - t).pow(2).mean().backward()
        elif kind == "step":
            o.step()
        elif kind in ("zero", "model_zero"):
            o.zero_grad()
        elif kind != "noop":
            raise AssertionError(kind)
    return [p.detach().clone() for p in model.parameters()]


def _both(ops, **kw):
    plain, combined = _run(ops, None, **kw), _run(ops, True, **kw)
    for k, (p, q) in enumerate(zip(plain[0], combined[0])):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"param {k}, combined vs plain: {m}")
    assert combined[1:] == plain[1:], (combined[1:], plain[1:])
    return plain


def _initial():
    return [p.detach().clone() for p in _model().parameters()]


def _assert_params(got, want, atol=2e-2):
    for k, (p, q) in enumerate(zip(got, want)):
        torch.testing.assert_close(p, q, rtol=0, atol=atol, msg=lambda m, k=k: f"param {k}: {m}")


# ---------------------------------------------------------------- O2: master grads after a step or a zero_grad
@pytest.mark.parametrize("clear", ["step", "zero", "model_zero"])
def test_o2_master_grads_are_gone_after_a_step_or_a_zero_grad(clear):
    """A step, the optimizer's zero_grad() or model.zero_grad() leaves the fp32 masters without grads until the
    next exit: a second step() does not move them, a clip sees no grad."""
    once, _, _ = _both([("fb",), (clear,)], opt_level="O2")
    twice, _, norms = _both([("fb",), (clear,), ("clip",), ("step",)], opt_level="O2")
    _assert_params(twice, once, atol=0)
    assert norms == [0.0]


_ROUNDTRIPS = {
    "between iterations": [("fb",), ("step",), ("roundtrip",), ("fb",), ("step",)],
    "between micro-batches": [("fb",), ("roundtrip",), ("fb",), ("step",)],
    "then a clip": [("fb",), ("roundtrip",), ("fb",), ("clip",), ("step",)],
    "then two steps": [("fb",), ("roundtrip",), ("step",), ("step",)],
    "then model.zero_grad": [("fb",), ("roundtrip",), ("model_zero",), ("clip",), ("fb",), ("step",)],
    "then a delayed block and zero_grad": [("fb",), ("roundtrip",), ("fb", {"delay": True}), ("zero",), ("fb",),
                                            ("clip",), ("step",)],
}


@pytest.mark.parametrize("bn", [False, True], ids=["linear", "batchnorm"])
@pytest.mark.parametrize("opt", ["sgd", "npu_sgd"])
@pytest.mark.parametrize("case", list(_ROUNDTRIPS))
def test_o2_state_dict_roundtrip_changes_nothing(case, opt, bn):
    """opt.load_state_dict(opt.state_dict()) (the buffers are rebuilt) anywhere in the loop: the same params and
    clip norms as the run without it. Model grads an exit already consumed are not counted again, fp32 params'
    grads keep their scale, a step or zero_grad after it still leaves the masters without grads."""
    ops = _ROUNDTRIPS[case]
    base = _run([op if op[0] != "roundtrip" else ("noop",) for op in ops], None, opt_level="O2", opt=opt, bn=bn)
    got = _both(ops, opt_level="O2", opt=opt, bn=bn)
    _assert_params(got[0], base[0], atol=0)
    assert got[1:] == base[1:]


@pytest.mark.parametrize("bn", [False, True], ids=["linear", "batchnorm"])
def test_o2_state_dict_roundtrip_after_an_overflow_backs_off_once(bn):
    """The overflowed grads are dropped before the next backward across the rebuild too: one back-off, and a clip
    before the skipped step sees the new grads."""
    _, scales, norms = _both([("fb", {"overflow": True}), ("roundtrip",), ("fb",), ("clip",)], opt_level="O2",
                             loss_scale="dynamic", bn=bn)
    assert scales == [2.0**15]
    assert all(n == n and n < float("inf") for n in norms)


# ---------------------------------------------------------------- skipped steps
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_skipped_step_drops_its_grads(opt_level):
    """After an overflow the next step is skipped and drops the grads it would have applied: a second step() with no
    backward in between moves nothing, and nothing non-finite reaches the params."""
    for ops in ([("fb", {"overflow": True}), ("fb",), ("step",), ("step",)],
                [("fb", {"overflow": True}), ("step",), ("step",)]):
        got, scales, _ = _both(ops, opt_level=opt_level, loss_scale="dynamic")
        _assert_params(got, _initial(), atol=1e-2 if opt_level == "O2" else 0)
        assert scales == [2.0**15]


def test_after_a_skipped_step_training_goes_on_from_the_next_grads():
    """overflow, zero_grad, backward, step (skipped: its grads dropped), backward, step: the last step applies the
    last backward's grads alone, as torch does for a step whose grads were zeroed."""
    got, _, _ = _both([("fb", {"overflow": True}), ("zero",), ("fb",), ("step",), ("fb",), ("step",)],
                      loss_scale="dynamic")
    _assert_params(got, _torch_run([("noop",), ("noop",), ("noop",), ("noop",), ("fb",), ("step",)]))


def test_fold_unscale_a_skipped_step_leaves_no_scaled_grads_behind():
    """fold_unscale: the grads stay scaled for the optimizer to divide; the skipped step drops them, so a second
    step() does not apply them undivided."""
    got, _, _ = _both([("fb", {"overflow": True}), ("zero",), ("fb",), ("step",), ("step",)], opt="fused_sgd",
                      loss_scale="dynamic", fold_unscale=True)
    _assert_params(got, _initial(), atol=0)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_the_backward_after_an_overflow_starts_from_no_grads(opt_level):
    """The overflowed grads are not accumulated onto: a later overflow in a delay_unscale block is seen at the
    closing exit (a second back-off), and a clip before the skipped step sees the later micro-batches alone."""
    _, scales, _ = _both([("fb", {"overflow": True}), ("fb", {"delay": True, "overflow": True}), ("fb",)],
                         opt_level=opt_level, loss_scale="dynamic")
    assert scales == [2.0**14]
    _, _, norms = _both([("fb", {"overflow": True}), ("fb",), ("fb",), ("clip",)], opt_level=opt_level,
                        loss_scale="dynamic")
    _, _, clean = _both([("zero",), ("fb",), ("fb",), ("clip",)], opt_level=opt_level)
    assert norms == pytest.approx(clean, rel=1e-6)


def test_an_overflow_found_by_a_delay_overflow_check_block_of_another_loss_skips_the_step():
    """Loss 1's delay_overflow_check block overflows; loss 0's exit (which checks) acts on it: loss 0's scale
    backs off and the step is skipped, instead of the inf grads reaching the update."""
    got, scales, _ = _both([("fb", {"loss_id": 1, "overflow": True, "check": True}), ("fb", {"loss_id": 0}),
                            ("step",)], loss_scale="dynamic", num_losses=2)
    assert scales == [2.0**15, 2.0**16]
    _assert_params(got, _initial(), atol=0)


# ---------------------------------------------------------------- zero_grad inside a delay_unscale chain
@pytest.mark.parametrize("zero", ["zero", "model_zero"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_zero_grad_inside_a_delay_unscale_chain_drops_what_came_before(zero, opt_level):
    """Grads set aside for the chain's closing exit are dropped by a zero_grad() in between, as torch drops
    every grad: the step applies the closing backward's grads alone."""
    got, _, _ = _both([("fb",), ("fb", {"delay": True}), (zero,), ("fb",), ("step",)], opt_level=opt_level)
    _assert_params(got, _torch_run([("fb",), ("fb",), ("zero",), ("fb",), ("step",)]))


@pytest.mark.parametrize("opt", ["sgd", "npu_sgd"])
def test_o2_a_master_grad_set_by_the_user_after_a_step_is_accumulated_onto(opt):
    """A grad given to a master between steps (here ones) is added to by the next exit, as upstream's O2 adds
    to existing master grads; the same with combined master grads."""
    results = []
    for combine in COMBINE:
        model = _model()
        o = _OPTIMIZERS[opt](model.parameters())
        model, o = amp.initialize(model, o, opt_level="O2", combine_grad=combine, loss_scale=128.0, verbosity=0,
                                  cast_model_outputs=torch.float32)
        first = next(iter(amp.master_params(o)))
        for i in range(3):
            x, t = _batch(i)
            with amp.scale_loss((model(x) - t).pow(2).mean(), o) as scaled:
                scaled.backward()
            if i == 1:
                grad = first.grad.clone()
            o.step()
            if i == 0:
                first.grad = torch.ones_like(first)
        results.append(([p.detach().clone() for p in amp.master_params(o)], grad))
        amp.deinitialize()
    (plain, g_plain), (combined, g_combined) = results
    torch.testing.assert_close(g_combined, g_plain, rtol=1e-6, atol=1e-7)
    assert float(g_plain.min()) > 0.5  # the ones are in it
    for p, q in zip(combined, plain):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("unfreeze_at", [None, 2], ids=["frozen", "unfrozen-later"])
@pytest.mark.parametrize("opt", ["sgd", "npu_sgd"])
def test_o2_frozen_params_with_combined_grads(opt, unfreeze_at):
    """A frozen model param (requires_grad=False) under O2: combined grads build without hooking it, and every
    master ends as without combine_grad, also when the param is unfrozen mid-run (its master then trains)."""
    results = []
    for combine in COMBINE:
        model = _model()
        model[0].bias.requires_grad_(False)
        o = _OPTIMIZERS[opt](model.parameters())
        model, o = amp.initialize(model, o, opt_level="O2", combine_grad=combine, loss_scale=128.0, verbosity=0,
                                  cast_model_outputs=torch.float32)
        bias_master = next(p for p in amp.master_params(o) if p.shape == model[0].bias.shape)
        bias_before = bias_master.detach().clone()
        for i in range(4):
            if i == unfreeze_at:
                model[0].bias.requires_grad_(True)
            x, t = _batch(i)
            o.zero_grad()
            with amp.scale_loss((model(x) - t).pow(2).mean(), o) as scaled:
                scaled.backward()
            o.step()
        results.append([p.detach().clone() for p in amp.master_params(o)])
        assert torch.equal(bias_master, bias_before) == (unfreeze_at is None)
        amp.deinitialize()
    for p, q in zip(*results):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- a step with a delay_unscale chain open
def _warned_run(ops, combine, **kw):
    with pytest.warns(RuntimeWarning, match=r"delay_unscale=True.*loss_id 0.*still carried the loss scale"):
        return _run(ops, combine, **kw)


@pytest.mark.parametrize("opt", ["sgd", "npu_sgd", "fused_sgd"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_step_inside_a_delay_unscale_chain_unscales_it_first(opt_level, opt):
    """step() right after a delay_unscale block (no closing exit): the chain's grads still carry the loss scale.
    The step unscales and checks them first, with a RuntimeWarning, and applies what the closing exit would
    have left: the accumulated grads, as torch's step would."""
    ops = [("fb",), ("fb", {"delay": True}), ("step",), ("fb", {"delay": True}), ("fb", {"delay": True}), ("step",)]
    got = [_warned_run(ops, combine, opt_level=opt_level, opt=opt) for combine in COMBINE]
    for p, q in zip(got[0][0], got[1][0]):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    # the same chains closed by an exit: equal bits (the delayed backwards accumulate alike in either)
    closed = _run([("fb",), ("fb",), ("step",), ("fb", {"delay": True}), ("fb",), ("step",)], None,
                  opt_level=opt_level, opt=opt)
    _assert_params(got[0][0], closed[0], atol=0)
    if opt == "sgd" and opt_level == "O1":  # (O2's bf16 weights drift from torch's fp32 ones over two steps)
        _assert_params(got[0][0], _torch_run([("fb",), ("fb",), ("step",), ("fb",), ("fb",), ("step",)]))


@pytest.mark.parametrize("combine", COMBINE)
def test_a_step_inside_an_overflowed_delay_unscale_chain_is_skipped(combine):
    """The unscale at the step finds the chain's inf: the scale backs off once and the step is skipped (its grads
    dropped), as at a closing exit; training goes on from the next backward."""
    ops = [("fb", {"delay": True, "overflow": True}), ("step",), ("step",)]
    got, scales, _ = _warned_run(ops, combine, loss_scale="dynamic")
    assert scales == [2.0**15]
    _assert_params(got, _initial(), atol=0)
    got, _, _ = _warned_run([*ops, ("fb",), ("step",)], combine, loss_scale="dynamic")
    _assert_params(got, _torch_run([("noop",), ("noop",), ("noop",), ("fb",), ("step",)]))


@pytest.mark.parametrize("combine", COMBINE)
def test_a_step_closes_the_chain_of_every_optimizer_in_it_with_one_scale_update(combine):
    """A delay_unscale block over two optimizers that overflowed: the first step() closes the chain for both,
    so the scale backs off once (not once per optimizer) and both steps are skipped."""
    torch.manual_seed(0)
    m1, m2 = nn.Linear(4, 2), nn.Linear(4, 2)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    before = [p.detach().clone() for p in [*m1.parameters(), *m2.parameters()]]
    [m1, m2], [o1, o2] = amp.initialize([m1, m2], [o1, o2], opt_level="O1", combine_grad=combine, verbosity=0,
                                        loss_scale="dynamic")
    x = torch.randn(3, 4)
    loss = (m1(x).float().sum() + m2(x).float().sum()) * float("inf")
    with amp.scale_loss(loss, [o1, o2], delay_unscale=True) as scaled:
        scaled.backward()
    with pytest.warns(RuntimeWarning, match="delay_unscale"):
        o1.step()
    o2.step()  # already closed with o1's: no second warning, no second back-off
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**15
    for p, q in zip([*m1.parameters(), *m2.parameters()], before):
        assert torch.equal(p.detach(), q)


# ---------------------------------------------------------------- a step inside the scale_loss block
_INSIDE = r"step\(\) was called inside its `with amp.scale_loss\(...\)` block \(loss_id 0\).*loss scale"


def _inside_run(ops, combine, **kw):
    with pytest.warns(RuntimeWarning, match=_INSIDE):
        return _run(ops, combine, **kw)


@pytest.mark.parametrize("combine", COMBINE)
@pytest.mark.parametrize("opt", ["sgd", "npu_sgd", "fused_sgd"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_step_inside_the_scale_loss_block_does_the_exits_work_first(opt_level, opt, combine):
    """``optimizer.step()`` indented into its scale_loss block: the grads still carry the loss scale there. The
    step unscales and checks them first, with a RuntimeWarning, and the exit has nothing left to do: the same bits
    as the step after the block (upstream stepped on grads 2**7 times too large here)."""
    inside = [("fb", {"step_inside": True}), ("noop",), ("zero",), ("fb", {"step_inside": True}), ("noop",)]
    after = [("fb",), ("step",), ("zero",), ("fb",), ("step",)]
    got = _inside_run(inside, combine, opt_level=opt_level, opt=opt)
    want = _run(after, combine, opt_level=opt_level, opt=opt)
    _assert_params(got[0], want[0], atol=0)
    assert got[1] == want[1]


@pytest.mark.parametrize("combine", COMBINE)
def test_an_overflowed_step_inside_the_block_is_skipped_and_backs_off_once(combine):
    ops = [("fb", {"overflow": True, "step_inside": True})]
    got, scales, _ = _inside_run(ops, combine, loss_scale="dynamic")
    assert scales == [2.0**15]  # not a second time at the exit
    _assert_params(got, _initial(), atol=0)
    got, scales, _ = _inside_run([*ops, ("fb",), ("step",)], combine, loss_scale="dynamic")
    assert scales == [2.0**15]
    _assert_params(got, _torch_run([("noop",), ("fb",), ("step",)]))


@pytest.mark.parametrize("combine", COMBINE)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_step_inside_a_delay_unscale_block_closes_the_chain(opt_level, combine):
    inside = [("fb", {"delay": True}), ("fb", {"delay": True, "step_inside": True})]
    got = _inside_run(inside, combine, opt_level=opt_level)
    want = _run([("fb", {"delay": True}), ("fb",), ("step",)], combine, opt_level=opt_level)
    _assert_params(got[0], want[0], atol=0)


@pytest.mark.parametrize("combine", COMBINE)
def test_a_step_inside_a_block_of_two_optimizers_unscales_both_with_one_scale_update(combine):
    """scale_loss over two optimizers, the first one stepping inside the block: both optimizers' grads are
    unscaled then (the second steps after the block, as usual), with one warning and one scale update."""
    def run(inside):
        torch.manual_seed(0)
        m1, m2 = nn.Linear(4, 2), nn.Linear(4, 2)
        o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
        [m1, m2], [o1, o2] = amp.initialize([m1, m2], [o1, o2], opt_level="O1", combine_grad=combine,
                                            verbosity=0, loss_scale="dynamic")
        x = torch.randn(3, 4)
        for it in range(2):
            overflow = float("inf") if it == 0 else 1.0
            with amp.scale_loss((m1(x).float().sum() + m2(x).float().sum()) * overflow, [o1, o2]) as scaled:
                scaled.backward()
                if inside:
                    with pytest.warns(RuntimeWarning, match=_INSIDE):
                        o1.step()
            if not inside:
                o1.step()
            o2.step()
            o1.zero_grad()
            o2.zero_grad()
        out = [p.detach().clone() for p in [*m1.parameters(), *m2.parameters()]], amp._amp_state.loss_scalers[0]
        scale = out[1].loss_scale()
        amp.deinitialize()
        return out[0], scale

    got, got_scale = run(True)
    want, want_scale = run(False)
    assert got_scale == want_scale == 2.0**15
    _assert_params(got, want, atol=0)


@pytest.mark.parametrize("combine", COMBINE)
def test_an_error_in_the_block_after_a_step_inside_it_skips_nothing(combine):
    """The step inside the block used its grads: an exception raised later in the block leaves no step to skip,
    and the next iteration trains as usual."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    model, o = amp.initialize(model, o, opt_level="O1", combine_grad=combine, verbosity=0, loss_scale=128.0)
    x = torch.randn(3, 4)
    with pytest.raises(KeyError), pytest.warns(RuntimeWarning, match=_INSIDE):
        with amp.scale_loss(model(x).float().sum(), o) as scaled:
            scaled.backward()
            o.step()
            raise KeyError("after the step")
    o.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(model(x).float().sum(), o) as scaled:
        scaled.backward()
    o.step()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("check", [None, True], ids=["", "check_combined_tensors"])
@pytest.mark.parametrize("opt_level,bn", [("O1", False), ("O2", False), ("O2", True)])
def test_a_delay_unscale_chain_closed_by_another_loss_is_unscaled_by_the_scale_each_grad_carries(opt_level, bn,
                                                                                                   check):
    """Loss 1's delay_unscale block, then loss 0's real exit, the two scalers at different scales (loss 1 backed
    off after an overflow): the delayed grads are brought to loss 0's scale before its backward, so the step
    applies both backwards' grads, as torch does. The skipped step set the grads to None, so the delayed
    backward's are fresh tensors outside combined buffers (rescaled where they are)."""
    ops = [("fb", {"loss_id": 1, "overflow": True}), ("zero",), ("step",), ("fb", {"loss_id": 1, "delay": True}),
           ("fb", {"loss_id": 0}), ("step",)]
    got, scales, _ = _both(ops, opt_level=opt_level, bn=bn, loss_scale="dynamic", num_losses=2,
                           check_combined_tensors=check)
    assert scales == [2.0**16, 2.0**15]
    if not bn:
        _assert_params(got, _torch_run([("noop",), ("zero",), ("noop",), ("fb",), ("fb",), ("step",)]))
    same_scale = _run([op if op[0] != "fb" else ("fb", {**op[1], "loss_id": 1}) for op in ops], None,
                      opt_level=opt_level, bn=bn, loss_scale="dynamic", num_losses=2)
    _assert_params(got, same_scale[0], atol=1e-6)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_block_that_raises_inside_a_delay_unscale_chain_leaves_no_scaled_grads(opt_level):
    """Without combine_grad: a block raising inside a chain drops the chain's scaled grads with its own (they
    were added together) and keeps the grads from before the chain, unscaled, for the next exit to add to: the
    step applies the first and the last backward's grads, not a grad divided by the scale twice."""
    model = _model()
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, o = amp.initialize(model, o, opt_level=opt_level, loss_scale=128.0, verbosity=0,
                              cast_model_outputs=torch.float32)
    for i, kind in enumerate(["fb", "delay", "raise", "fb"]):
        x, t = _batch(i)
        loss = (model(x) - t).pow(2).mean()
        with pytest.raises(ValueError) if kind == "raise" else contextlib.nullcontext():
            with amp.scale_loss(loss, o, delay_unscale=kind != "fb") as scaled:
                scaled.backward()
                if kind == "raise":
                    raise ValueError("user code failed after the backward")
    o.step()
    got = [p.detach().float().clone() for p in amp.master_params(o)]
    _assert_params(got, _torch_run([("fb",), ("noop",), ("noop",), ("fb",), ("step",)]))


@pytest.mark.parametrize("combine", COMBINE)
@pytest.mark.parametrize("zero", ["zero", "model_zero"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_zero_grad_ends_a_delay_unscale_chain(opt_level, zero, combine):
    """After a zero_grad (the optimizer's, or model.zero_grad() of the model holding all its params) inside a
    chain nothing scaled is left: a step() then has no chain to close (no warning) and moves nothing."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, _, _ = _run([("fb", {"delay": True}), (zero,), ("step",)], combine, opt_level=opt_level)
    _assert_params(got, _initial(), atol=1e-2 if opt_level == "O2" else 0)


@pytest.mark.parametrize("combine", COMBINE)
def test_a_block_whose_entry_fails_leaves_no_open_block_and_the_grads_in_place(combine, monkeypatch):
    """scale_loss fails while making the scaled loss (here a loss whose ``float()`` raises): as after any block that
    raised, the grads of earlier blocks are back where they were (combined grads: dropped, and the next step
    skipped), and no block is left open on the optimizer for the next step to close."""
    import warnings

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    model, o = amp.initialize(model, o, opt_level="O1", combine_grad=combine, verbosity=0, loss_scale=128.0)
    x = torch.randn(3, 4)
    with amp.scale_loss(model(x).float().sum(), o) as scaled:
        scaled.backward()
    before = [p.grad.clone() for p in model.parameters()]
    loss = model(x).float().sum()

    def refuse(self, *args, **kwargs):
        raise RuntimeError("no float here")

    monkeypatch.setattr(torch.Tensor, "float", refuse)
    with pytest.raises(RuntimeError, match="no float here"):
        with amp.scale_loss(loss, o):
            pass
    monkeypatch.undo()
    assert o._amp_stash.open_block is None
    weights = [p.detach().clone() for p in model.parameters()]
    if not combine:
        assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o.step()
    changed = [not torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights)]
    assert all(changed) if not combine else not any(changed)
