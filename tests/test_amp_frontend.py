"""amp.initialize: opt-level table, overrides, every documented error, shapes in/out, teardown."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from _amp_harness import bn_mlp

from apex import amp
from apex.amp._amp_state import _amp_state

LOW = torch.bfloat16  # the CPU default


@pytest.fixture(autouse=True)
def _amp_env(monkeypatch, amp_env):
    """On top of amp_env (which restores the user cast registry): no dtype from the environment."""
    monkeypatch.delenv("APEX_AMP_DTYPE", raising=False)


def net():
    return bn_mlp(4, 8, 2)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def initialized(level, **kw):
    """A fresh net and its SGD through amp.initialize at `level`."""
    m = net()
    o = sgd(m)
    amp.initialize(m, o, opt_level=level, verbosity=0, **kw)
    return m, o


def assert_outputs_cast(level, dtype):
    """cast_model_outputs=dtype at `level`: the model returns that dtype."""
    m = net()
    amp.initialize(m, opt_level=level, cast_model_outputs=dtype, verbosity=0)
    assert m(torch.randn(4, 4)).dtype == dtype


# ---------------------------------------------------------------- the table

TABLE = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False, keep_batchnorm_fp32=None,
               master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None, master_weights=None,
               loss_scale="dynamic"),
    "O2": dict(cast_model_type=LOW, patch_torch_functions=False, keep_batchnorm_fp32=True, master_weights=True,
               loss_scale="dynamic"),
    "O3": dict(cast_model_type=LOW, patch_torch_functions=False, keep_batchnorm_fp32=False, master_weights=False,
               loss_scale=1.0),
}


@pytest.mark.parametrize("level", sorted(TABLE))
def test_opt_level_table(level):
    m = net()
    amp.initialize(m, sgd(m), opt_level=level, verbosity=0)
    props = _amp_state.opt_properties
    assert props.enabled and props.opt_level == level
    for key, value in TABLE[level].items():
        assert getattr(props, key) == value, key
    for key in ("combine_grad", "combine_ddp", "check_combined_tensors", "user_cast_preferred"):
        assert getattr(props, key) is None
    scaler = _amp_state.loss_scalers[0]
    assert scaler.dynamic == (TABLE[level]["loss_scale"] == "dynamic")
    assert scaler.loss_scale() == (2.0**16 if scaler.dynamic else 1.0)


def test_overrides_apply_on_top():
    m = net()
    amp.initialize(m, sgd(m), opt_level="O2", keep_batchnorm_fp32="False", loss_scale=128, master_weights=False,
                   verbosity=0)
    props = _amp_state.opt_properties
    assert props.keep_batchnorm_fp32 is False and props.loss_scale == 128.0 and props.master_weights is False
    assert m[1].weight.dtype == LOW  # batchnorm cast too
    assert not _amp_state.loss_scalers[0].dynamic


@pytest.mark.parametrize("value,expected", [(True, True), ("True", True), (False, False), ("False", False)])
def test_keep_batchnorm_fp32_accepts_bool_and_strings(value, expected):
    m = net()
    amp.initialize(m, opt_level="O2", keep_batchnorm_fp32=value, verbosity=0)
    assert _amp_state.opt_properties.keep_batchnorm_fp32 is expected
    assert m[1].weight.dtype == (torch.float32 if expected else LOW)
    assert m[0].weight.dtype == LOW


def test_low_precision_dtype_choice(monkeypatch):
    m = net()
    amp.initialize(m, opt_level="O3", amp_dtype=torch.float16, verbosity=0)
    assert m[0].weight.dtype == torch.float16
    amp.deinitialize()
    monkeypatch.setenv("APEX_AMP_DTYPE", "fp16")
    m = net()
    amp.initialize(m, opt_level="O2", verbosity=0)
    assert m[0].weight.dtype == torch.float16 and m[1].weight.dtype == torch.float32
    with pytest.raises(ValueError, match="amp_dtype"):
        amp.initialize(net(), opt_level="O2", amp_dtype="int8", verbosity=0)


def test_logging_of_options(caplog):
    m = net()
    with caplog.at_level("INFO", logger="apex.amp"):
        amp.initialize(m, opt_level="O1")
    text = caplog.text
    assert "Selected optimization level O1" in text and "patch_torch_functions  : True" in text
    caplog.clear()
    amp.deinitialize()
    with caplog.at_level("INFO", logger="apex.amp"):
        amp.initialize(net(), opt_level="O1", verbosity=0)
    assert "Selected optimization level" not in caplog.text


# ---------------------------------------------------------------- shapes in, shapes out


def test_same_shape_out():
    m1, m2 = net(), net()
    o1 = sgd(m1)
    out = amp.initialize(m1, opt_level="O1", verbosity=0)
    assert out is m1
    amp.deinitialize()
    ms, opt = amp.initialize([m1, m2], o1, opt_level="O1", verbosity=0)
    assert ms == [m1, m2] and opt is o1
    amp.deinitialize()
    o2, o3 = sgd(m1), sgd(m2)
    ms, opts = amp.initialize((m1,), [o2, o3], opt_level="O1", verbosity=0)
    assert ms == (m1,) and opts == [o2, o3]


def test_disabled_returns_inputs_and_scale_loss_passes_through():
    m = net()
    o = sgd(m)
    w = m[0].weight.detach().clone()
    m2, o2 = amp.initialize(m, o, opt_level="O2", enabled=False)
    assert m2 is m and o2 is o and m[0].weight.dtype == torch.float32 and not hasattr(o, "_amp_stash")
    assert torch.equal(m[0].weight, w)
    loss = m(torch.randn(4, 4)).sum()
    with amp.scale_loss(loss, o) as scaled:
        assert scaled is loss


# ---------------------------------------------------------------- errors


def assert_untouched(model, opt=None):
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert "forward" not in model.__dict__
    if opt is not None:
        assert not hasattr(opt, "_amp_stash") and "step" not in opt.__dict__
    assert _amp_state.session is None


@pytest.mark.parametrize("level", ["O4", "00", "o1", 1, None])
def test_bad_opt_level(level):
    m = net()
    with pytest.raises(RuntimeError, match="Unexpected optimization level"):
        amp.initialize(m, sgd(m), opt_level=level)
    assert_untouched(m)


@pytest.mark.parametrize("enabled", ["no", "False", b"", torch.ones(2)], ids=["no", "False", "bytes", "tensor"])
def test_enabled_without_a_plain_truth_value_is_refused(enabled):
    m = net()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        amp.initialize(m, sgd(m), opt_level="O2", enabled=enabled, verbosity=0)
    assert_untouched(m)


@pytest.mark.parametrize("enabled", [0, None, torch.tensor(False)], ids=["zero", "none", "tensor"])
def test_false_like_enabled_returns_the_inputs_untouched(enabled):
    m = net()
    o = sgd(m)
    assert amp.initialize(m, o, opt_level="O2", enabled=enabled, verbosity=0) == (m, o)
    assert_untouched(m, o)


def test_parallel_wrapped_model_rejected(tmp_path):
    m = net()
    with pytest.raises(RuntimeError, match="Parallel wrappers should only be applied to the model"):
        amp.initialize(torch.nn.DataParallel(m), opt_level="O1")
    assert_untouched(m)
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        # init_sync=False: no broadcast is queued on the gloo worker, whose teardown of a finished work can otherwise
        # race with the process group's destructor (torch joins the worker while holding the GIL)
        ddp = torch.nn.parallel.DistributedDataParallel(m, init_sync=False)
        with pytest.raises(RuntimeError, match="DistributedDataParallel"):
            amp.initialize(ddp, opt_level="O2")
    finally:
        dist.destroy_process_group()
    assert_untouched(m)


def test_optimizer_passed_twice():
    m, o = initialized("O1")
    session = _amp_state.session
    _amp_state.loss_scalers[0].load(256.0, 7)
    # the same call again on what it returned (transformers' Trainer.train() run twice): nothing changes
    m_again, o_again = amp.initialize(m, o, opt_level="O1", verbosity=0)
    assert m_again is m and o_again is o and _amp_state.session is session
    assert _amp_state.loss_scalers[0].state() == {"loss_scale": 256.0, "unskipped": 7}
    # other options, another model list or a list where one object was given: upstream's refusal
    for kw in (dict(opt_level="O2"), dict(opt_level="O1", loss_scale=128.0), dict(opt_level="O1", num_losses=2)):
        with pytest.raises(RuntimeError, match=r"should only be passed through amp\.initialize once"):
            amp.initialize(m, o, verbosity=0, **kw)
    with pytest.raises(RuntimeError, match=r"should only be passed through amp\.initialize once"):
        amp.initialize([m, net()], o, opt_level="O1", verbosity=0)
    assert _amp_state.session is session
    amp.deinitialize()  # even after teardown: O2 masters could not be rebuilt from masters
    with pytest.raises(RuntimeError, match=r"only be passed through amp\.initialize once"):
        amp.initialize(m, o, opt_level="O1", verbosity=0)
    m2 = net()
    o2 = sgd(m2)
    with pytest.raises(RuntimeError, match="appears twice"):
        amp.initialize(m2, [o2, o2], opt_level="O1")
    assert_untouched(m2, o2)


@pytest.mark.parametrize("models,optimizers,match", [
    ("model", None, "models must be either a single Module"),
    ([object()], None, "entry 0 is object"),
    (None, "opt", "optimizers must be either a single Optimizer"),
    (None, ["net"], "entry 0 is Sequential"),
])
def test_wrong_types(models, optimizers, match):
    m = net()
    models = m if models is None else models
    if optimizers == ["net"]:
        optimizers = [net()]
    with pytest.raises(TypeError, match=match):
        amp.initialize(models, optimizers, opt_level="O1")
    assert_untouched(m)


@pytest.mark.parametrize("level,kw,exc,match", [
    ("O1", dict(cast_model_type=torch.float16), RuntimeError, "O1 inserts casts around Torch functions"),
    ("O1", dict(keep_batchnorm_fp32=True), RuntimeError, "keep_batchnorm_fp32 should be None"),
    ("O1", dict(master_weights=True), RuntimeError, "doesn't make sense to use master_weights with O1"),
    ("O2", dict(patch_torch_functions=True), RuntimeError, "patch_torch_functions=True should only be set"),
    ("O2", dict(keep_batchnorm_fp32="yes"), ValueError, "keep_batchnorm_fp32 must be a boolean"),
    ("O2", dict(cast_model_type=torch.int8), TypeError, "cast_model_type must be"),
    ("O2", dict(master_weights="True"), TypeError, "master_weights must be True, False or None"),
    ("O0", dict(combine_grad=True), RuntimeError, "combine_grad=True is only supported with opt_level 'O1' or 'O2'"),
    ("O3", dict(combine_grad=True), RuntimeError, "combine_grad=True is only supported"),
    ("O3", dict(check_combined_tensors=True), RuntimeError, "check_combined_tensors=True is only supported"),
    ("O1", dict(check_combined_tensors=True), RuntimeError, "check_combined_tensors=True requires combine_grad"),
    ("O1", dict(combine_ddp=True), RuntimeError, "combine_ddp=True requires combine_grad=True"),
    ("O2", dict(user_cast_preferred=True), RuntimeError, "user_cast_preferred=True is only supported with opt_level"),
    ("O2", dict(combine_grad=True, master_weights=False), RuntimeError, "combine_grad=True requires master_weights"),
    ("O1", dict(fold_unscale=True), RuntimeError, "fold_unscale=True requires combine_grad=True"),
    ("O1", dict(loss_scale="abc"), ValueError, "loss_scale must be 'dynamic' or a positive number"),
    ("O1", dict(loss_scale=-2), ValueError, "loss_scale must be"),
    ("O1", dict(loss_scale=True), TypeError, "loss_scale must be"),
    ("O1", dict(num_losses=0), ValueError, "num_losses must be >= 1"),
    ("O1", dict(num_losses=1.5), TypeError, "num_losses must be an int"),
    ("O1", dict(scale_window=0), ValueError, "scale_window must be >= 1"),
    ("O1", dict(min_loss_scale=2.0**30), ValueError, "min_loss_scale .* is larger than max_loss_scale"),
    ("O1", dict(dynamic_init_scale=0), ValueError, "dynamic_init_scale must be a finite positive number"),
    ("O1", dict(scale_backoff_factor=2.0), ValueError, "scale_backoff_factor must be in"),
    ("O1", dict(scale_growth_factor=0.5), ValueError, "scale_growth_factor must be >= 1"),
    ("O1", dict(ddp_replica_count=0), ValueError, "ddp_replica_count must be >= 1"),
    ("O1", dict(cast_model_outputs="half"), TypeError, "cast_model_outputs must be"),
    ("O1", dict(verbosity="loud"), TypeError, "verbosity must be an int"),
])
def test_option_errors_leave_everything_untouched(level, kw, exc, match):
    m = net()
    o = sgd(m)
    with pytest.raises(exc, match=match):
        amp.initialize(m, o, opt_level=level, **kw)
    assert_untouched(m, o)


def test_allowed_o1_overrides():
    m = net()
    amp.initialize(m, opt_level="O1", cast_model_type=torch.float32, verbosity=0)
    inner = []
    m[0].register_forward_hook(lambda mod, args, out: inner.append(out.dtype))
    assert m(torch.randn(4, 4)).dtype == torch.float32  # outputs cast to the model type
    assert inner == [LOW] and m[0].weight.dtype == torch.float32  # autocast still on inside


def test_low_precision_model_rejected():
    m = net().half()
    with pytest.raises(RuntimeError, match=r"you do not need to call \.half"):
        amp.initialize(m, opt_level="O2")
    assert m[0].weight.dtype == torch.float16 and "forward" not in m.__dict__


def test_master_weights_reject_float64_params():
    m = net()
    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    o = torch.optim.SGD([*m.parameters(), extra], lr=0.1)
    with pytest.raises(TypeError, match="float64"):
        amp.initialize(m, o, opt_level="O2")
    assert_untouched(m, o)


def test_closure_rejected():
    _, o = initialized("O1")
    with pytest.raises(RuntimeError, match="does not support closure"):
        o.step(lambda: 0.0)


def test_scale_loss_errors():
    m = net()
    o = sgd(m)
    loss = m(torch.randn(4, 4)).sum()
    with pytest.raises(RuntimeError, match="must be called before"):
        with amp.scale_loss(loss, o):
            pass
    amp.initialize(m, o, opt_level="O1", verbosity=0)
    with pytest.raises(ValueError, match=r"loss_id must be in \[0, 1\) .*got 1"):
        with amp.scale_loss(loss, o, loss_id=1):
            pass
    with pytest.raises(TypeError, match="loss_id must be an int, got '0'"):
        with amp.scale_loss(loss, o, loss_id="0"):
            pass
    other = sgd(net())
    with pytest.raises(RuntimeError, match=r"was not returned by the active amp\.initialize"):
        with amp.scale_loss(loss, other):
            pass
    with pytest.raises(TypeError, match="optimizers must be an optimizer or a list"):
        with amp.scale_loss(loss, "opt"):
            pass
    with pytest.raises(TypeError, match="loss must be a tensor"):
        with amp.scale_loss(1.0, o):
            pass


def test_combine_ddp_hook_point():
    """combine_ddp's backend (apex.parallel by default) gets the session once and amp's exits, in order."""
    from apex.amp import _ddp

    seen = []

    class Hook:
        def before_backward(self, combined_list, delay_unscale):
            seen.append(("before_backward", delay_unscale))

        def before_unscale(self, combined):
            seen.append(("before_unscale", [b.clone() for b in combined.flat_buffers()]))

        # no agree_overflow / teardown: amp calls only what a hook provides

    def backend(session):
        seen.append(("created", session.ddp_replica_count))
        return Hook()

    m = net()
    _ddp.register_backend(backend)
    try:
        o = sgd(m)
        amp.initialize(m, o, opt_level="O1", combine_grad=True, combine_ddp=True, ddp_replica_count=2, verbosity=0)
        loss = m(torch.randn(4, 4)).float().sum()
        with amp.scale_loss(loss, o) as scaled:
            scaled.backward()
        assert [s[0] for s in seen] == ["created", "before_backward", "before_unscale"]
        assert seen[0][1] == 2 and seen[1][1] is False
        unscaled = torch.cat(list(o._amp_stash.combined.flat_buffers()))
        torch.testing.assert_close(torch.cat(seen[2][1]), unscaled * 2.0**16)  # handed over still scaled
        amp.deinitialize()
    finally:
        _ddp.register_backend(None)


# ---------------------------------------------------------------- what each level does to the model


def test_o1_autocast_inside_forward_only():
    m = net()
    amp.initialize(m, opt_level="O1", verbosity=0)
    out = m(torch.randn(4, 4))
    assert out.dtype == LOW  # the last Linear ran under autocast
    assert m[0].weight.dtype == torch.float32  # weights stay fp32
    loss = (out.float() - 1).pow(2).mean()
    assert (torch.randn(3, 3) @ torch.randn(3, 3)).dtype == torch.float32  # outside forward: own dtype
    assert loss.dtype == torch.float32
    with amp.disable_casts():
        assert m(torch.randn(4, 4)).dtype == torch.float32


def test_o1_cast_model_outputs():
    assert_outputs_cast("O1", torch.float32)


def test_o2_model_cast_inputs_outputs_and_masters():
    m = net()
    o = sgd(m)
    ids = [id(p) for p in m.parameters()]
    amp.initialize(m, o, opt_level="O2", verbosity=0)
    assert [id(p) for p in m.parameters()] == ids  # same Parameter objects, new dtype
    assert [p.dtype for p in m.parameters()] == [LOW, LOW, torch.float32, torch.float32, LOW, LOW]
    out = m(torch.randn(4, 4))  # fp32 input cast to the model dtype
    assert out.dtype == torch.float32  # outputs cast back by default
    masters = list(amp.master_params(o))
    assert all(p.dtype == torch.float32 for p in masters)
    model_params = list(m.parameters())
    for master, p in zip(masters, model_params):
        if p.dtype == LOW:
            assert master is not p and torch.equal(master.to(LOW), p)
        else:
            assert master is p  # fp32 batchnorm params are their own masters
    amp.deinitialize()
    assert_outputs_cast("O2", torch.bfloat16)


def test_o3_pure_low_precision():
    m, o = initialized("O3")
    assert all(p.dtype == LOW for p in m.parameters())
    assert all(b.dtype == LOW for b in m.buffers() if b.is_floating_point())
    assert list(amp.master_params(o)) == list(m.parameters())
    loss = m(torch.randn(4, 4)).sum()
    with amp.scale_loss(loss, o) as scaled:
        assert scaled.dtype == torch.float32 and torch.equal(scaled, loss.float())  # scale 1


def test_teardown_restores_instances():
    m = net()
    o = sgd(m)
    cls_step = type(o).step
    amp.initialize(m, o, opt_level="O1", combine_grad=True, verbosity=0)
    assert "forward" in m.__dict__ and "zero_grad" in m.__dict__ and "step" in o.__dict__
    amp.deinitialize()
    for name in ("forward", "zero_grad"):
        assert name not in m.__dict__
    for name in ("step", "zero_grad", "add_param_group", "load_state_dict"):
        assert name not in o.__dict__
    assert type(o).step is cls_step
    assert m(torch.randn(4, 4)).dtype == torch.float32
    assert _amp_state.opt_properties is None and _amp_state.loss_scalers == []


def test_lr_scheduler_after_initialize():
    m, o = initialized("O2")
    sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)  # wraps optimizer.step.__func__
    loss = m(torch.randn(4, 4)).sum()
    with amp.scale_loss(loss, o) as scaled:
        scaled.backward()
    o.step()
    sched.step()
    assert o.param_groups[0]["lr"] == pytest.approx(0.05)


def test_add_param_group_after_initialize_o2():
    m, extra = net(), torch.nn.Linear(4, 2)
    o = sgd(m)
    amp.initialize([m, extra], o, opt_level="O2", verbosity=0)
    o.add_param_group({"params": extra.parameters(), "lr": 0.5})
    masters = o.param_groups[1]["params"]
    assert all(p.dtype == torch.float32 for p in masters) and masters[0] is not extra.weight
    before = extra.weight.detach().clone()
    loss = m(torch.randn(4, 4)).sum() + extra(torch.randn(4, 4)).sum()
    with amp.scale_loss(loss, o) as scaled:
        scaled.backward()
    o.step()
    expected = (masters[0].detach()).to(LOW)
    assert torch.equal(extra.weight, expected) and not torch.equal(extra.weight, before)


# ---------------------------------------------------------------- user-registered casts


def _fake_module():
    mod = types.ModuleType("fake_ops")

    def ident(*xs):
        return xs if len(xs) > 1 else xs[0]

    mod.ident = ident
    mod.other = ident
    mod.promote_me = ident
    return mod


def test_register_functions_wrapped_and_restored():
    mod = _fake_module()
    originals = (mod.ident, mod.other, mod.promote_me)
    amp.register_half_function(mod, "ident")
    amp.register_float_function(mod, "other")
    amp.register_promote_function(mod, "promote_me")
    x32, x16 = torch.randn(2), torch.randn(2, dtype=LOW)
    amp.initialize(net(), opt_level="O1", verbosity=0)
    assert mod.ident is not originals[0]
    assert mod.ident(x32).dtype == LOW
    assert mod.other(x16).dtype == torch.float32
    a, b = mod.promote_me(x32, x16)
    assert a.dtype == b.dtype == torch.float32
    out = mod.ident([x32, {"k": x32}, 3, "s"])  # containers are walked, other values kept
    assert out[0].dtype == LOW and out[1]["k"].dtype == LOW and out[2:] == [3, "s"]
    assert mod.ident(torch.arange(3)).dtype == torch.int64  # integer tensors untouched
    with amp.disable_casts():
        assert mod.ident(x32).dtype == torch.float32
    amp.deinitialize()
    assert (mod.ident, mod.other, mod.promote_me) == originals


def test_register_errors_and_late_registration():
    mod = _fake_module()
    with pytest.raises(ValueError, match="No function named missing"):
        amp.register_half_function(mod, "missing")
    mod.value = 3
    with pytest.raises(ValueError, match="not callable"):
        amp.register_float_function(mod, "value")
    orig = mod.ident
    amp.initialize(net(), opt_level="O2", verbosity=0)  # not O1: nothing is wrapped
    amp.register_half_function(mod, "ident")
    assert mod.ident is orig
    amp.deinitialize()
    amp.initialize(net(), opt_level="O1", verbosity=0)
    late = _fake_module()
    amp.register_half_function(late, "other")  # during an O1 session: wrapped at once
    assert late.other(torch.randn(2)).dtype == LOW
    amp.deinitialize()
    assert late.other(torch.randn(2)).dtype == torch.float32


def test_decorators():
    @amp.half_function
    def h(x):
        return x

    @amp.float_function
    def f(x):
        return x

    @amp.promote_function
    def p(x, y):
        return x + y

    x32, x16 = torch.randn(2), torch.randn(2, dtype=LOW)
    assert h(x32).dtype == torch.float32  # no session: plain call
    amp.initialize(net(), opt_level="O1", verbosity=0)
    assert h(x32).dtype == LOW and f(x16).dtype == torch.float32 and p(x16, x32).dtype == torch.float32
    with amp.disable_casts():
        assert h(x32).dtype == torch.float32


@pytest.mark.parametrize("preferred", [False, True])
def test_user_cast_preferred_over_autocast(preferred, device):
    """matmul is on autocast's low-precision list: registered as float, the user wins only if preferred.
    On the --device of the run: amp autocasts for the device it detects, so the tensors live there."""
    from apex import _device

    class MM(torch.nn.Module):
        def forward(self, a, b):
            return torch.matmul(a, b)

    orig = torch.matmul
    amp.register_float_function(torch, "matmul")
    try:
        m = MM()
        amp.initialize(m, opt_level="O1", user_cast_preferred=preferred or None, verbosity=0)
        out = m(torch.randn(2, 2, device=device), torch.randn(2, 2, device=device))
        assert out.dtype == (torch.float32 if preferred else _device.default_amp_dtype(device))
        amp.deinitialize()
        assert torch.matmul is orig
    finally:
        from apex.amp import _casts

        _casts._USER_CAST_REGISTRY.pop((id(torch), "matmul"), None)
        torch.matmul = orig


def test_second_initialize_replaces_function_casts(caplog):
    mod = _fake_module()
    orig = mod.ident
    amp.register_half_function(mod, "ident")
    amp.initialize(net(), opt_level="O1", verbosity=0)
    with caplog.at_level("WARNING", logger="apex.amp"):
        amp.initialize(net(), opt_level="O1", verbosity=0)
    assert "called again" in caplog.text
    assert getattr(mod.ident, "_apex_amp_patch_of", None) is orig  # wrapped once, not twice
    amp.deinitialize()
    assert mod.ident is orig


@pytest.mark.parametrize("combine", [None, True])
def test_initialize_again_on_new_models_lets_the_earlier_ones_go(combine):
    """A loop that initializes a new model and optimizer each time (hyperparameter trials, notebooks) keeps
    only what it still references: an earlier session whose models and optimizers are gone is collected, not
    held until deinitialize. One still referenced stays prepared and is torn down by deinitialize."""
    import gc
    import weakref

    kept, kept_opt = initialized("O1", combine_grad=combine)
    gone = []
    for _ in range(5):
        m, o = initialized("O1", combine_grad=combine)
        with amp.scale_loss(m(torch.randn(4, 4)).float().sum(), o) as scaled:
            scaled.backward()
        o.step()
        gone.append((weakref.ref(m), weakref.ref(o)))
        del m, o, scaled
    gc.collect()
    assert [ref() for pair in gone[:-1] for ref in pair] == [None] * 8  # the last one is the active session
    assert len(_amp_state.sessions) == 2
    assert "step" in kept_opt.__dict__ and "zero_grad" in kept.__dict__
    amp.deinitialize()
    assert "step" not in kept_opt.__dict__ and "zero_grad" not in kept.__dict__
    assert _amp_state.sessions == []


def test_error_inside_scale_loss_restores_stashed_grads():
    m, o = initialized("O1")
    m(torch.randn(4, 4)).float().sum().backward()
    before = [p.grad.clone() for p in m.parameters()]
    with pytest.raises(ValueError, match="boom"):
        with amp.scale_loss(m(torch.randn(4, 4)).float().sum(), o):
            raise ValueError("boom")
    for p, g in zip(m.parameters(), before):
        assert torch.equal(p.grad, g)


def test_teardown_under_lr_scheduler_wrapper():
    """A scheduler created after initialize wraps amp's step; after teardown that wrapper calls plain torch."""
    m, o = initialized("O1")
    torch.optim.lr_scheduler.StepLR(o, step_size=1)
    amp.deinitialize()
    loss = m(torch.randn(4, 4)).sum()
    loss.backward()
    w = m[0].weight.detach().clone()
    o.step()  # no skip logic, no amp state: a plain SGD step
    torch.testing.assert_close(m[0].weight, w - 0.1 * m[0].weight.grad)


def test_o2_optimizer_state_dict_carries_masters():
    m, o = initialized("O2")
    sd = o.state_dict()
    masters = sd["apex_amp_master_params"]
    assert [t is None for t in masters] == [p.dtype == torch.float32 for p in m.parameters()]
    assert all(t.dtype == torch.float32 for t in masters if t is not None)
    bad = dict(sd, apex_amp_master_params=masters[:2])
    with pytest.raises(ValueError, match="apex_amp_master_params"):
        o.load_state_dict(bad)


def test_o1_runs_losses_called_after_the_forward_in_float32():
    """O1 autocasts the forward only. A loss computed after it, on the low-precision output against fp32
    targets, runs in float32 as upstream's process-wide casts run it (torch's CUDA backward of mse_loss rejects
    the mixed pair); float64 stays float64; the original functions are back after deinitialize."""
    import torch.nn.functional as F

    original = F.mse_loss
    m, o = initialized("O1")
    x, target = torch.randn(4, 4), torch.randn(4, 2)
    out = m(x)
    assert out.dtype == LOW
    loss = torch.nn.MSELoss()(out, target)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ((out.detach().float() - target) ** 2).mean(), rtol=0, atol=0)
    with amp.scale_loss(loss, o) as scaled:
        scaled.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())
    for fn in (F.l1_loss, F.smooth_l1_loss, F.mse_loss):
        assert fn(torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)).dtype == torch.float64
        assert fn(torch.randn(3, dtype=LOW), torch.randn(3, dtype=LOW)).dtype == torch.float32
    amp.deinitialize()
    assert F.mse_loss is original
    assert F.mse_loss(torch.randn(3, dtype=LOW), torch.randn(3, dtype=LOW)).dtype == LOW


def test_o1_runs_the_softmax_family_in_float32_wherever_called():
    """Loss code takes log_softmax of the forward's low-precision logits (transformers' label smoothing): under O1
    the softmax family runs in float32, as upstream's O1 ran it and as torch's amp path (fp32 outputs) computes
    it; a model that calls it inside its forward gets float32 from it as under CUDA's autocast; float64 stays;
    restored at deinitialize."""
    import torch.nn.functional as F

    class Smooth(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(512, 16)
            self.head = torch.nn.Linear(16, 512)

        def forward(self, ids):
            h = self.emb(ids)
            self.inner = F.softmax(h, dim=-1).dtype
            return self.head(h)

    torch.manual_seed(0)
    model = Smooth()
    ids = torch.randint(0, 512, (4, 16))
    with torch.no_grad():
        ref = -F.log_softmax(model(ids), dim=-1).mean()  # fp32 model, fp32 loss code
    original = F.log_softmax
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with torch.no_grad():
        logits = model(ids)
        assert logits.dtype == LOW and model.inner == torch.float32
        lp = F.log_softmax(logits, dim=-1)
        assert lp.dtype == torch.float32
        torch.testing.assert_close(lp, F.log_softmax(logits.float(), dim=-1), rtol=0, atol=0)
        assert (-lp.mean() - ref).abs() < 5e-3  # the low-precision forward's error only
        for fn in (F.softmax, F.log_softmax, F.softmin, torch.nn.Softmax(dim=-1), torch.nn.LogSoftmax(dim=-1)):
            kw = {} if isinstance(fn, torch.nn.Module) else {"dim": -1}
            assert fn(torch.randn(3, dtype=LOW), **kw).dtype == torch.float32
            assert fn(torch.randn(3, dtype=torch.float64), **kw).dtype == torch.float64
    amp.deinitialize()
    assert F.log_softmax is original
    assert F.log_softmax(torch.randn(3, dtype=LOW), dim=-1).dtype == LOW


@pytest.mark.parametrize("before", [True, False], ids=["scheduler_first", "initialize_first"])
def test_lr_scheduler_built_before_or_after_initialize(before):
    """transformers' Trainer builds its LR scheduler, then calls amp.initialize: the step amp installs keeps the
    scheduler's record that step ran (no "optimizer.step() has been overridden" warning), and the schedule is the
    one a scheduler built after initialize follows."""
    import apex.optimizers as ao

    model = torch.nn.Linear(4, 2)
    opt = ao.NpuFusedSGD(model.parameters(), lr=0.1)
    if before:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale=1.0, verbosity=0)
    if not before:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            with amp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.05, 0.025, 0.0125]
    assert opt._opt_called


def test_o1_loss_casts_yield_to_a_user_registration():
    import torch.nn.functional as F

    amp.register_half_function(F, "l1_loss")
    initialized("O1")
    assert F.l1_loss(torch.randn(3), torch.randn(3)).dtype == LOW
    assert F.mse_loss(torch.randn(3, dtype=LOW), torch.randn(3)).dtype == torch.float32


# ---------------------------------------------------------------- mistakes: refused before anything changes
@pytest.mark.parametrize("kw, match", [
    ({"num_losses": 10**12}, "num_losses must be at most 65536"),
    ({"loss_scale": 1e-45}, r"loss_scale must be in \[2\*\*-126, 2\*\*126\]"),
    ({"loss_scale": 1e39}, r"loss_scale must be in \[2\*\*-126, 2\*\*126\]"),
    ({"min_loss_scale": 1e-40}, r"min_loss_scale must be in \[2\*\*-126"),
    ({"max_loss_scale": 2.0**127}, r"max_loss_scale must be in \[2\*\*-126"),
    ({"dynamic_init_scale": 1e-45}, r"dynamic_init_scale must be in \[2\*\*-126"),
])
def test_initialize_refuses_counts_and_scales_it_cannot_honour(kw, match):
    """A scale whose inverse is not a normal float32 unscales every grad to inf or 0 where no overflow check
    sees it; a loss count is a scaler object each, made at initialize."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        amp.initialize(model, opt, opt_level="O1", verbosity=0, **kw)
    assert _amp_state.session is None and not hasattr(opt, "_amp_stash")


def test_initialize_checks_loaded_optimizer_state_before_casting_the_model():
    import apex.optimizers as ao

    model = torch.nn.Linear(4, 2)
    opt = ao.NpuFusedAdam(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    good = opt.state[model.weight]["exp_avg"]
    opt.state[model.weight]["exp_avg"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"key 'exp_avg': expected shape \(2, 4\)"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert model.weight.dtype == torch.float32 and _amp_state.session is None
    opt.state[model.weight]["exp_avg"] = good
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)  # the same call, fixed, goes through
    assert model.weight.dtype != torch.float32


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_error_inside_scale_loss_puts_the_grads_back(opt_level):
    """The block raised after its backward: the accumulated grads are as before the block, none scaled."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    params = list(amp.master_params(opt))
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(KeyError):
        with amp.scale_loss(model(torch.randn(8, 4)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
            raise KeyError("after backward")
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in params)
    assert all(p.grad is None for p in model.parameters()) if opt_level == "O2" else True


def test_master_params_refuses_a_non_optimizer_at_the_call():
    for bad in (None, "x", torch.nn.Linear(2, 2)):
        with pytest.raises(TypeError, match=r"amp\.master_params: expected an optimizer"):
            amp.master_params(bad)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_error_inside_a_combined_scale_loss_never_steps_on_its_grads(opt_level):
    """combine_grad: the failed block's grads live in the flat buffer with the earlier ones; the next step is
    skipped, and the next block starts from zero grads, so its step is a plain one."""
    import apex.optimizers as ao

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    twin = torch.nn.Linear(4, 2)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(8, 4)
    runs = []
    for m in (model, twin):
        opt = ao.NpuFusedSGD(m.parameters(), lr=0.1)
        m, opt = amp.initialize(m, opt, opt_level=opt_level, combine_grad=True, verbosity=0)
        if m is model:
            with pytest.raises(KeyError):
                with amp.scale_loss(m(x).float().pow(2).mean(), opt) as scaled:
                    scaled.backward()
                    raise KeyError("after backward")
            before = m.weight.detach().clone()
            opt.step()  # skipped: nothing it could read is a clean grad
            assert torch.equal(m.weight, before)
        with amp.scale_loss(m(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        runs.append(m.weight.detach().clone())
        amp.deinitialize()
    assert torch.equal(runs[0], runs[1])


def test_state_dict_and_scale_loss_name_bad_arguments():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(TypeError, match=r"amp\.state_dict: destination must be a dict"):
        amp.state_dict("x")
    with pytest.raises(RuntimeError, match="Unexpected key"):  # an index no loss can have
        amp.load_state_dict({"loss_scaler" + "9" * 5000: {"loss_scale": 1.0, "unskipped": 0}})
    with pytest.raises(TypeError, match="scale_loss: delay_unscale must be a bool"):
        with amp.scale_loss(model(torch.randn(2, 4)).sum(), opt, delay_unscale=torch.ones(2)):
            pass


_UNSCALED_BACKWARD = r"\(loss_id 0\) went through the loss but not through scaled_loss"


def _linear_sgd(level, **kw):
    """A Linear(4, 2) and its SGD through amp.initialize at `level`."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)


@pytest.mark.parametrize("combine", [None, True], ids=["plain", "combined"])
def test_loss_backward_inside_scale_loss_warns(combine):
    """``loss.backward()`` written for ``scaled_loss.backward()``: its grads carry no scale, and the exit divides
    them by the scale all the same (upstream's rule; nothing tells them apart there). amp warns at the exit."""
    model, opt = _linear_sgd("O1", combine_grad=combine, loss_scale=128.0)
    x = torch.randn(3, 4)
    loss = model(x).float().pow(2).sum()
    expect = torch.autograd.grad(loss, model.weight, retain_graph=True)[0] / 128.0
    with pytest.warns(RuntimeWarning, match=_UNSCALED_BACKWARD):
        with amp.scale_loss(loss, opt):  # the scaled loss it yields is left unused
            loss.backward()
    torch.testing.assert_close(model.weight.grad, expect)


def test_backwards_through_the_scaled_loss_do_not_warn():
    model, opt = _linear_sgd("O1")
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            (scaled / 4).backward()  # a derived tensor (gradient accumulation's division)
        with amp.scale_loss(model(x).float().sum(), opt, delay_unscale=True) as scaled:
            scaled.backward()
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            torch.autograd.grad(scaled, list(model.parameters()))
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            pass  # no backward at all
        with torch.no_grad():
            plain = model(x).float().sum()
        with amp.scale_loss(plain, opt) as scaled:
            pass  # a loss without a graph
        loss = model(x).float().sum()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward(retain_graph=True)
        loss.backward()  # after the block: its hooks are gone
        opt.step()


def test_scale_loss_works_where_the_loss_takes_no_hooks(monkeypatch):
    model, opt = _linear_sgd("O1", loss_scale=128.0)

    def refuse(self, hook):
        raise RuntimeError("no hooks here")

    monkeypatch.setattr(torch.Tensor, "register_hook", refuse)
    with amp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    assert torch.equal(model.bias.grad, torch.full((2,), 3.0))  # three rows, unscaled
    opt.step()


_OUTSIDE = r"a backward outside `amp.scale_loss` reached the model's params.*SGD updates"


@pytest.mark.parametrize("combine", [None, True], ids=["plain", "combined"])
@pytest.mark.parametrize("opt_cls", ["SGD", "FusedSGD", "NpuFusedSGD"])
def test_o2_backward_outside_scale_loss_warns_at_the_step(opt_cls, combine):
    """Under master weights a backward with amp left out (``loss.backward()``) reaches no master: the step leaves
    those params alone (upstream's rule), and amp says so at the step."""
    import apex.optimizers as optimizers

    cls = getattr(torch.optim, opt_cls, None) or getattr(optimizers, opt_cls)
    model = torch.nn.Linear(4, 2)
    opt = cls(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", combine_grad=combine, verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 4)).float().sum().backward()
    with pytest.warns(RuntimeWarning, match=_OUTSIDE):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_o2_backwards_inside_scale_loss_or_cleared_do_not_warn(zero):
    model, opt = _linear_sgd("O2")
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            with amp.scale_loss(model(x).float().sum(), opt, delay_unscale=True) as scaled:
                scaled.backward()
            with amp.scale_loss(model(x).float().sum(), opt) as scaled:
                scaled.backward()
            opt.step()
            (opt if zero == "optimizer" else model).zero_grad()
        model(x).float().sum().backward()  # a stray backward, cleared before the next step
        (opt if zero == "optimizer" else model).zero_grad()
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        model(x).float().sum().backward()  # followed by an exit, which brings it to the masters as upstream does
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        amp.deinitialize()  # the probe goes with amp
        model(x.to(model.weight.dtype)).float().sum().backward()
        opt.step()


# ---------------------------------------------------------------- training-loop sequences against their meaning
_CASES = [("O1", None), ("O2", None), ("O1", True), ("O2", True)]


def _linear(opt_level, combine, opt_cls=torch.optim.SGD, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    opt = opt_cls(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level=opt_level, combine_grad=combine, verbosity=0, **kw)


@pytest.mark.parametrize("opt_level, combine", _CASES)
def test_a_delayed_block_between_normal_ones_accumulates_each_grad_once(opt_level, combine):
    """d(sum(w x))/dw = x per block: three blocks (the middle one delay_unscale) accumulate 3x, whatever order."""
    model, opt = _linear(opt_level, combine, loss_scale=128.0)
    x = torch.ones(1, 3)
    opt.zero_grad()
    for k in range(3):
        with amp.scale_loss(model(x).float().sum(), opt, delay_unscale=(k == 1)) as scaled:
            scaled.backward()
    grad = next(iter(amp.master_params(opt))).grad.float()
    assert torch.equal(grad, torch.full((1, 3), 3.0))


@pytest.mark.parametrize("combine", [None, True])
@pytest.mark.parametrize("opt_cls", ["SGD", "NpuFusedSGD"])
def test_o2_masters_follow_a_model_loaded_mid_run(opt_cls, combine):
    """model.load_state_dict after training began: the next step starts from the loaded weights (at w = 0 the
    grad of (w x)^2 is 0, so SGD leaves them at 0), not from the masters of before the load."""
    import apex.optimizers as ao

    cls = torch.optim.SGD if opt_cls == "SGD" else ao.NpuFusedSGD
    model, opt = _linear("O2", combine, opt_cls=cls)
    x = torch.randn(8, 3)
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    model.load_state_dict({"weight": torch.zeros(1, 3)})
    opt.zero_grad()
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not model.weight.any() and not next(iter(amp.master_params(opt))).any()


@pytest.mark.parametrize("combine", [None, True])
def test_o2_masters_keep_their_precision_when_nothing_changed_the_model(combine):
    """Steps too small for the bf16 model to see must still move the fp32 masters (a delayed first block
    included): the masters are re-read from the model only where the user changed it."""
    model, opt = _linear("O2", combine)
    x = torch.ones(1, 3)
    for _ in range(3):
        opt.zero_grad()
        for k in range(2):
            with amp.scale_loss(model(x).float().sum() * 1e-4, opt, delay_unscale=(k == 0)) as scaled:
                scaled.backward()
        opt.step()
    master = next(iter(amp.master_params(opt)))
    assert not torch.equal(master, model.weight.float())


@pytest.mark.parametrize("combine", [None, True])
def test_o2_model_zero_grad_without_a_step_drops_the_master_grads(combine):
    """An iteration abandoned after its backward (no step), then model.zero_grad(): the next iteration's master
    grads are its own, as O1's grads are."""
    model, opt = _linear("O2", combine)
    x = torch.ones(1, 3)
    opt.zero_grad()
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    model.zero_grad()
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    master = next(iter(amp.master_params(opt)))
    assert torch.equal(master.grad.float(), torch.ones(1, 3))
    before = master.detach().clone()
    opt.step()
    torch.testing.assert_close(master - before, torch.full((1, 3), -0.1))


@pytest.mark.parametrize("opt_level, combine", _CASES)
@pytest.mark.parametrize("delay", ["delay_overflow_check", "delay_unscale"])
def test_an_overflow_in_a_delayed_block_skips_the_step(opt_level, combine, delay):
    model, opt = _linear(opt_level, combine)
    x = torch.ones(1, 3)
    opt.zero_grad()
    with amp.scale_loss(model(x).float().sum(), opt, **{delay: True}) as scaled:
        scaled.backward()
        model.weight.grad[0, 0] = float("inf")
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    before = model.weight.detach().clone()
    scale = amp._amp_state.loss_scalers[0].loss_scale()
    assert scale == 2.0**15  # backed off once
    opt.step()
    assert torch.equal(model.weight, before)


def test_upstream_level_objects():
    """``from apex.amp.frontend import O3`` (and ``opt_levels``) as scripts written for upstream import them: each
    resets a Properties to its level's defaults, as initialize starts from them."""
    from apex.amp.frontend import O0, O1, O2, O3, Properties, opt_levels

    assert sorted(opt_levels) == ["O0", "O1", "O2", "O3"]
    for name, cls in (("O0", O0), ("O1", O1), ("O2", O2), ("O3", O3)):
        level = opt_levels[name]
        assert isinstance(level, cls) and level.brief.startswith(f"{name}:") and level.more
        props = Properties("O1" if name != "O1" else "O0", torch.bfloat16)
        assert level(props) is props
        assert props.options == Properties(name, torch.bfloat16).options
    with pytest.raises(TypeError, match="expected amp Properties"):
        O2()({"opt_level": "O1"})


def _overflowing_step(**kw):
    m = bn_mlp(8, 16, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m, o = amp.initialize(m, o, opt_level="O1", **kw)
    with amp.scale_loss(m(torch.randn(4, 8)).float().sum() * float("inf"), o) as scaled:
        scaled.backward()
    o.step()


_UNCONFIGURED_SCRIPT = """
import sys, torch
from apex import amp
verbosity = int(sys.argv[1])
m = torch.nn.Linear(8, 2)
o = torch.optim.SGD(m.parameters(), lr=0.1)
m, o = amp.initialize(m, o, opt_level="O1", verbosity=verbosity)
with amp.scale_loss(m(torch.randn(4, 8)).float().sum() * float("inf"), o) as scaled:
    scaled.backward()
o.step()
amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0},
                     "loss_scaler5": {"loss_scale": 2.0, "unskipped": 0}})
"""


@pytest.mark.parametrize("verbosity", [1, 0])
def test_messages_print_where_logging_is_not_configured(tmp_path, verbosity):
    """A script that never set up logging, in a process of its own: the banner and the skipped-step line on
    stdout (as upstream printed them), the warnings on stderr (Python's last-resort handler); verbosity=0
    silences the messages, not the warnings."""
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_UNCONFIGURED_SCRIPT)
    env = dict(os.environ)
    env.pop("APEX_AMP_DTYPE", None)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(script), str(verbosity)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    out, err = done.stdout, done.stderr
    overflow = "Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 32768.0"
    if verbosity:
        assert "Selected optimization level O1" in out
        assert overflow in out
    else:
        assert "Selected optimization level" not in out + err and "Gradient overflow" not in out + err
    assert "skipping loss_scaler5, since num_losses was set to 1" in err
    assert "state_dict contains 2 entries, while 1 loss_scalers are used" in err


def test_messages_go_to_logging_where_it_is_configured(caplog, capsys):
    with caplog.at_level("INFO", logger="apex.amp"):
        _overflowing_step()
    assert "Gradient overflow. Skipping step" in caplog.text
    assert "Gradient overflow" not in capsys.readouterr().out
