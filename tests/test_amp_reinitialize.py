"""amp.initialize on a model an earlier amp.initialize prepared (a notebook switching opt levels, a second
Trainer on the same model, O0 to rule amp out): the model leaves the earlier session first, so only the new
session's casts apply, and what the earlier one cast is fp32 again (params from their fp32 masters)."""

from __future__ import annotations

import pytest
import torch
from _amp_harness import bn_mlp

from apex import amp
from apex.amp._amp_state import _amp_state
from apex.amp._model import AmpForward, AmpZeroGrad
from apex.optimizers import FusedAdam, NpuFusedSGD

LOW = torch.bfloat16  # the CPU default


@pytest.fixture(autouse=True)
def _env(monkeypatch, amp_env):
    monkeypatch.delenv("APEX_AMP_DTYPE", raising=False)
    yield


def net(seed=0):
    torch.manual_seed(seed)
    return bn_mlp(4, 8, 2)


def train(model, opt, steps=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        loss = model(x).float().pow(2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()


def layer_dtypes(model, x):
    """(input dtype, output dtype) of every Linear during one forward."""
    seen = []
    hooks = [m.register_forward_hook(lambda mod, i, o: seen.append((i[0].dtype, o.dtype)))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def prepared(level, opt_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), **kw):
    m = net()
    o = opt_factory(m)
    m, o = amp.initialize(m, o, opt_level=level, verbosity=0, **kw)
    train(m, o)
    return m, o


@pytest.mark.parametrize("first, combine", [("O1", None), ("O1", True), ("O2", None), ("O2", True), ("O3", None)])
def test_o0_after_any_level_runs_the_plain_fp32_model(first, combine):
    """O0 is how users rule amp out: none of the earlier session's casts may survive it."""
    m, _ = prepared(first, combine_grad=combine)
    amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O0", verbosity=0)
    assert all(t.dtype == torch.float32 for t in (*m.parameters(), *m.buffers()) if t.is_floating_point())
    x = torch.randn(8, 4)
    assert layer_dtypes(m, x) == [(torch.float32, torch.float32)] * 2
    plain = net()
    plain.load_state_dict(m.state_dict())
    plain.train(m.training)
    assert torch.equal(m(x), plain(x))
    forward = m.__dict__["forward"]
    assert isinstance(forward, AmpForward) and forward.previous is None and forward.session is _amp_state.session
    zero_grad = m.__dict__["zero_grad"]
    assert isinstance(zero_grad, AmpZeroGrad) and zero_grad.previous is None


@pytest.mark.parametrize("second", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("combine", [None, True])
@pytest.mark.parametrize("make_opt", ["sgd", "fused_adam"])
def test_params_come_back_from_the_fp32_masters(second, combine, make_opt):
    """After O2, the model's weights are the masters rounded: leaving the session gives back the masters
    themselves, bitwise, and the next level casts from there (O2/O3: the same rounded values again)."""
    factory = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
               "fused_adam": lambda m: FusedAdam(m.parameters(), lr=1e-2)}[make_opt]
    m, old = prepared("O2", factory, combine_grad=combine)
    masters = [t.detach().clone() for t in amp.master_params(old)]
    before = [p.detach().clone() for p in m.parameters()]
    assert any(p.dtype == LOW for p in before)
    new = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, new, opt_level=second, verbosity=0)
    low = second in ("O2", "O3")
    for p, master, b in zip(m.parameters(), masters, before):
        if b.dtype == torch.float32:  # batchnorm (keep_batchnorm_fp32): O2 left it alone, O3 casts it
            assert torch.equal(p, b.to(LOW) if second == "O3" else b)
        elif low:
            assert p.dtype == LOW and torch.equal(p, master.to(LOW))
        else:
            assert p.dtype == torch.float32 and torch.equal(p, master)
    train(m, new)  # the new session trains it
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_weights_changed_after_the_last_step_keep_the_change():
    m, old = prepared("O2")
    masters = [t.detach().clone() for t in amp.master_params(old)]
    with torch.no_grad():
        m[0].weight[0, 0] = 3.0  # an edit in the model dtype, after the masters were last copied in
    amp.initialize(m, opt_level="O1", verbosity=0)
    assert m[0].weight[0, 0].item() == 3.0
    expect = masters[0].clone()
    expect[0, 0] = 3.0
    assert torch.equal(m[0].weight, expect)


def test_the_earlier_session_keeps_its_other_models():
    torch.manual_seed(0)
    a, b = net(0), net(1)
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    amp.initialize([a, b], [oa, ob], opt_level="O2", verbosity=0)
    earlier = _amp_state.session
    new = torch.optim.SGD(a.parameters(), lr=0.1)
    amp.initialize(a, new, opt_level="O0", verbosity=0)
    # a and the optimizer that updated it left the earlier session; b and its optimizer did not
    assert earlier.models == [b] and earlier.optimizers == [ob]
    assert "step" not in oa.__dict__ and oa._amp_stash.torn_down
    assert "step" in ob.__dict__ and b.__dict__["forward"].session is earlier
    assert next(b.parameters()).dtype == LOW
    w = b[0].weight.detach().clone()
    train(b, ob, steps=1)
    assert not torch.equal(b[0].weight, w)  # its masters still reach the model
    amp.deinitialize()
    assert "forward" not in a.__dict__ and "forward" not in b.__dict__


def test_an_optimizer_over_two_models_leaves_with_either():
    """An earlier optimizer that updates the model passed again cannot keep writing its masters into it."""
    a, b = net(0), net(1)
    both = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    amp.initialize([a, b], both, opt_level="O2", verbosity=0)
    amp.initialize(a, torch.optim.SGD(a.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    assert both._amp_stash.torn_down and "step" not in both.__dict__
    assert next(a.parameters()).dtype == torch.float32
    assert next(b.parameters()).dtype == LOW  # b stays prepared by the earlier session


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_model_cast_by_the_user_still_raises_and_nothing_changes(level):
    """Only what amp cast is given back: a model cast by hand on top is refused, as any non-fp32 model is."""
    m, o = prepared(level)
    forward, zero_grad = m.__dict__["forward"], m.__dict__["zero_grad"]
    if level == "O1":
        m.half()
    else:
        m[1].double()  # the batchnorm, which O2 left in fp32
    dtypes = [t.dtype for t in m.parameters()]
    with pytest.raises(RuntimeError, match=r"expected torch\.float32"):
        amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    assert m.__dict__["forward"] is forward and m.__dict__["zero_grad"] is zero_grad
    assert [t.dtype for t in m.parameters()] == dtypes
    assert "step" in o.__dict__ and not o._amp_stash.torn_down


def test_the_earlier_optimizer_is_still_refused():
    m, o = prepared("O1")
    with pytest.raises(RuntimeError, match=r"only be passed through amp\.initialize once"):
        amp.initialize(m, o, opt_level="O0", verbosity=0)
    assert m.__dict__["forward"].session is _amp_state.session  # the failed call released nothing


def test_models_only_initialize_releases_too():
    m, _ = prepared("O2")
    amp.initialize(m, opt_level="O1", verbosity=0)
    assert next(m.parameters()).dtype == torch.float32
    assert layer_dtypes(m, torch.randn(8, 4))[0] == (torch.float32, LOW)  # autocast: fp32 in, low out


def test_fp32_state_dict_hooks_of_the_earlier_session_go():
    """The earlier O2 session saved low-precision entries as fp32; at O3 with fp32_state_dict=False the model's
    own dtype is what state_dict returns."""
    m, _ = prepared("O2")
    amp.initialize(m, opt_level="O3", verbosity=0, fp32_state_dict=False)
    assert m.state_dict()["0.weight"].dtype == LOW


@pytest.mark.parametrize("later", ["O0", "O3"])
def test_an_earlier_o2_optimizer_still_trains_under_a_later_static_session(later):
    """scale_loss reads the active session's loss scale; under a later O0/O3 session (static scale 1) the exit
    still has to bring an earlier O2 optimizer's model grads to its masters, or its steps change nothing."""
    def run(with_later):
        amp.deinitialize()
        b = net(1)
        ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
        amp.initialize(b, ob, opt_level="O2", verbosity=0)
        if with_later:
            c = net(2)
            amp.initialize(c, torch.optim.SGD(c.parameters(), lr=0.1), opt_level=later, verbosity=0)
        train(b, ob, steps=2)
        return [p.detach().clone() for p in b.parameters()]

    alone, after = run(False), run(True)
    for x, y in zip(alone, after):
        assert torch.equal(x, y)  # bf16 grads scaled by a power of two and back: the same bits


def test_the_released_optimizer_says_why_scale_loss_refuses_it():
    m, o = prepared("O1")
    amp.initialize(m, opt_level="O1", verbosity=0)
    loss = m(torch.randn(8, 4)).float().sum()
    with pytest.raises(RuntimeError, match=r"when a model it updates was passed to a later amp\.initialize"):
        with amp.scale_loss(loss, o):
            pass


# ---------------------------------------------------------------- any sequence of sessions on one model
_EXPECTED_LINEAR = {  # (input dtype, output dtype) of the first Linear in the forward, per opt level
    "O0": (torch.float32, torch.float32),
    "O1": (torch.float32, LOW),
    "O2": (LOW, LOW),
    "O3": (LOW, LOW),
}
_OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "torch_adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "fused_adam": lambda ps: FusedAdam(ps, lr=1e-2),
    "npu_fused_sgd": lambda ps: NpuFusedSGD(ps, lr=0.05, momentum=0.9),
}


def _session_specs():
    from hypothesis import strategies as st

    def spec(level):
        combine = st.sampled_from([None, True]) if level in ("O1", "O2") else st.just(None)
        return st.tuples(st.just(level), st.sampled_from(sorted(_OPTIMIZERS)), combine,
                         st.sampled_from(["optimizer", "model", "kept"]))

    return st.lists(st.sampled_from(sorted(_EXPECTED_LINEAR)).flatmap(spec), min_size=2, max_size=4)


def test_any_sequence_of_sessions_on_one_model_trains_at_the_last_level():
    """Property: whatever levels, optimizers, combine_grad and zero_grad modes follow each other on one model,
    each session trains it (finite weights) and its forward casts as its own level says, none of the earlier
    ones'."""
    from hypothesis import Phase, given, settings

    @settings(max_examples=20, deadline=None, database=None, phases=(Phase.explicit, Phase.generate))
    @given(_session_specs())
    def run(specs):
        amp.deinitialize()
        m = net()
        for level, opt_name, combine, zero in specs:
            opt = _OPTIMIZERS[opt_name](m.parameters())
            m, opt = amp.initialize(m, opt, opt_level=level, combine_grad=combine, verbosity=0)
            gen = torch.Generator().manual_seed(len(specs))
            for _ in range(2):
                loss = m(torch.randn(8, 4, generator=gen)).float().pow(2).mean()
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()
                if zero == "optimizer":
                    opt.zero_grad()
                elif zero == "model":
                    m.zero_grad()
                else:
                    opt.zero_grad(set_to_none=False)
            assert all(torch.isfinite(p.float()).all() for p in m.parameters()), specs
            assert (m[0].weight.dtype == LOW) == (level in ("O2", "O3")), specs
            assert layer_dtypes(m, torch.randn(8, 4))[0] == _EXPECTED_LINEAR[level], specs

    run()
