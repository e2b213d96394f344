"""User code that rebinds a combined optimizer's state entries (``opt.state[p]["exp_avg"] = ...``,
``opt.state[p] = {}``, ``del``) between steps: the next step computes what torch's does with the same edit,
bit for bit; bad values are refused before anything moves; copies, pickles and state_dicts stay plain dicts."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import apex.optimizers as ao

EDITS = {
    "reset a moment": lambda st, ps: st[ps[0]].__setitem__("exp_avg", torch.zeros(3, 4)),
    "rebind the step": lambda st, ps: st[ps[1]].__setitem__("step", torch.tensor(100.0)),
    "update": lambda st, ps: st[ps[0]].update(exp_avg_sq=torch.full((3, 4), 0.5)),
    "replace a param's dict": lambda st, ps: st.__setitem__(ps[0], {}),
    "delete a param's dict": lambda st, ps: st.__delitem__(ps[1]),
    "pop": lambda st, ps: st.pop(ps[1]),
}


def _pair(cls, ref, **kw):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(2)]
    tp = [p.detach().clone().requires_grad_() for p in ps]
    return ps, tp, cls(ps, **kw), ref(tp, **kw)


def _step(ps, tp, opt, ref, gen):
    for a, b in zip(ps, tp):
        g = torch.randn(3, 4, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
    opt.step()
    ref.step()


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("cls, ref", [(ao.NpuFusedAdam, torch.optim.Adam), (ao.NpuFusedAdamW, torch.optim.AdamW)],
                         ids=["Adam", "AdamW"])
def test_a_rebound_state_is_what_the_next_step_reads(cls, ref, edit):
    """Against torch with the same edit (our kernel and torch's foreach math round differently in the last
    bits: rtol 1e-5), and against ours without the edit, which must differ well beyond that."""
    ps, tp, opt, twin = _pair(cls, ref, lr=1e-2, weight_decay=1e-2)
    untouched = [p.detach().clone().requires_grad_() for p in ps]
    plain = cls(untouched, lr=1e-2, weight_decay=1e-2)
    gen = torch.Generator().manual_seed(1)

    def step_all():
        """One step of ours and torch's, and of the unedited run on the same grads."""
        state = gen.get_state()
        _step(ps, tp, opt, twin, gen)
        gen.set_state(state)
        _step(untouched, [p.detach().clone().requires_grad_() for p in untouched], plain,
              ref([torch.zeros(1, requires_grad=True)]), gen)

    for _ in range(3):
        step_all()
    EDITS[edit](opt.state, ps)
    EDITS[edit](twin.state, tp)
    for _ in range(3):
        step_all()
        for a, b in zip(ps, tp):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for p, q in zip(ps, tp):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(torch.as_tensor(opt.state[p][k]), torch.as_tensor(twin.state[q][k]),
                                       rtol=1e-5, atol=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(ps, untouched)) > 1e-4  # the edit mattered


def test_steps_without_edits_never_re_combine():
    ps, tp, opt, twin = _pair(ao.NpuFusedSGD, torch.optim.SGD, lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        _step(ps, tp, opt, twin, gen)
        opt.state_dict()
        copy.copy(opt.state[ps[0]])
        _ = opt.state[ps[0]]["momentum_buffer"]  # reads are not edits
    assert opt.recombine_count == 1
    opt.state[ps[0]]["momentum_buffer"] = torch.ones(3, 4)
    twin.state[tp[0]]["momentum_buffer"] = torch.ones(3, 4)
    _step(ps, tp, opt, twin, gen)
    assert opt.recombine_count == 2
    for a, b in zip(ps, tp):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, error, match", [
    (None, TypeError, "must be a floating-point tensor, got NoneType"),
    ("x", TypeError, "must be a floating-point tensor, got str"),
    (torch.zeros(3, 4, dtype=torch.int32), TypeError, "got a torch.int32 tensor"),
    (torch.zeros(7), ValueError, "has 7 elements; expected 12"),
    (torch.zeros(3, 4, device="meta"), ValueError, "is a meta tensor"),
])
def test_a_bad_rebound_value_is_refused_before_anything_moves(bad, error, match):
    ps, tp, opt, twin = _pair(ao.NpuFusedAdam, torch.optim.Adam, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    _step(ps, tp, opt, twin, gen)
    before = [p.detach().clone() for p in ps]
    opt.state[ps[0]]["exp_avg"] = bad
    with pytest.raises(error, match=match):
        _step(ps, tp, opt, twin, gen)
    assert all(torch.equal(a, b) for a, b in zip(before, ps))


@pytest.mark.parametrize("bad, error, match", [
    ("x", TypeError, "expected a number"),
    (torch.tensor([1.0, 2.0]), TypeError, "expected a number or a 1-element real tensor"),
    (-1, ValueError, "expected a finite step count >= 0"),
    (float("nan"), ValueError, "expected a finite step count >= 0"),
    (2.0**200, ValueError, "expected a finite step count >= 0"),
], ids=["str", "two-element", "negative", "nan", "beyond-float32"])
def test_a_bad_rebound_step_is_refused(bad, error, match):
    """The same check (and exception types) as a checkpoint's step: TypeError for the form, ValueError for the
    value."""
    ps, tp, opt, twin = _pair(ao.NpuFusedAdam, torch.optim.Adam, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    _step(ps, tp, opt, twin, gen)
    opt.state[ps[1]]["step"] = bad
    with pytest.raises(error, match=f"state 'step' of param 1: {match}"):
        _step(ps, tp, opt, twin, gen)


def test_copies_pickles_and_state_dicts_are_plain_dicts():
    ps, tp, opt, twin = _pair(ao.NpuFusedAdam, torch.optim.Adam, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    _step(ps, tp, opt, twin, gen)
    assert type(copy.copy(opt.state[ps[0]])) is dict and type(copy.deepcopy(opt.state[ps[0]])) is dict
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)
    data = pickle.dumps(opt)
    assert b"Watched" not in data  # the stream holds plain dicts (rebuilt by _plain_states), never the classes
    clone = pickle.loads(data)
    # the clone watches its own dicts (a dict taken from it before its first step stays its state)
    assert all(v._watch is clone._watch is not opt._watch for v in clone.state.values())
    clone.state[clone.param_groups[0]["params"][0]]["exp_avg"] = torch.zeros(3, 4)  # never flags the original
    rc = opt.recombine_count
    _step(ps, tp, opt, twin, gen)
    assert opt.recombine_count == rc


@pytest.mark.parametrize("when", ["before the first step", "after a load", "after an unpickle"])
def test_a_dict_taken_before_the_step_stays_the_params_state(when):
    """torch fills the per-param dict it handed out (``st = opt.state[p]`` before the first step, or after a
    load), so an edit through that reference reaches its next step; ours binds into the same dict."""
    ps, tp, opt, twin = _pair(ao.NpuFusedAdam, torch.optim.Adam, lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    if when == "after a load":
        _step(ps, tp, opt, twin, gen)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        twin.load_state_dict(copy.deepcopy(twin.state_dict()))
    elif when == "after an unpickle":
        opt = pickle.loads(pickle.dumps(opt))
        ps = [p for g in opt.param_groups for p in g["params"]]
        for p, q in zip(ps, tp):
            p.data.copy_(q.data)
    held, twin_held = opt.state[ps[0]], twin.state[tp[0]]
    _step(ps, tp, opt, twin, gen)
    assert opt.state[ps[0]] is held and "exp_avg" in held
    held["exp_avg"] = torch.full((3, 4), 0.25)
    twin_held["exp_avg"] = torch.full((3, 4), 0.25)
    for _ in range(2):
        _step(ps, tp, opt, twin, gen)
    for a, b in zip(ps, tp):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[ps[0]]["exp_avg"], twin.state[tp[0]]["exp_avg"], rtol=1e-5, atol=1e-6)
