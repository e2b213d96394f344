"""amp refuses wrong calls with a clear error at the first call that can see them, and a refused call changes
nothing: models (params, dtypes, forward), optimizers (type, param groups, state), torch's functions and amp's
process-wide state are as they were."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from _amp_harness import bn_mlp

from apex import amp
from apex.amp import _casts
from apex.amp._amp_state import _amp_state
from apex.amp._casts import FunctionPatches
from apex.amp.handle import AmpHandle


@pytest.fixture(autouse=True)
def _amp_env(monkeypatch, amp_env):
    """On top of amp_env (which restores the user cast registry): no dtype from the environment."""
    monkeypatch.delenv("APEX_AMP_DTYPE", raising=False)


# Functions amp patches (amp.init: torch's lists; O1 sessions: the float losses), compared by identity.
_WATCHED = [(torch, "mm"), (torch, "matmul"), (F, "linear"), (F, "cross_entropy"), (F, "softmax"),
            (torch.Tensor, "__matmul__")]


def _functions():
    return {f"{getattr(ns, '__name__', ns)}.{name}": ns.__dict__.get(name) if isinstance(ns, type)
            else getattr(ns, name) for ns, name in _WATCHED}


def _what_runs(fn):
    """A function as a session's casts see it: a session's cast wrapper by what it wraps and how (a session
    that reinstalls its casts makes new wrapper objects of the same functions), anything else by identity."""
    if hasattr(fn, "_apex_amp_patch_of"):
        return ("session cast", fn._apex_amp_patch_of, fn._apex_amp_kind)
    return fn


def _amp_globals():
    return dict(session=_amp_state.session, handle=_amp_state.handle, init_handle=_amp_state.init_handle,
                sessions=list(_amp_state.sessions), props=_amp_state.opt_properties,
                scalers=list(_amp_state.loss_scalers), verbosity=_amp_state.verbosity,
                registry=dict(_casts._USER_CAST_REGISTRY))


class Snapshot:
    """Everything a refused call must leave as it was."""

    def __init__(self, models=(), optimizers=()):
        self.models, self.optimizers = list(models), list(optimizers)
        self.params = [[(n, p, p.detach().clone()) for n, p in m.named_parameters()] for m in self.models]
        self.buffers = [[(n, b.detach().clone()) for n, b in m.named_buffers()] for m in self.models]
        self.model_dicts = [{k: v for k, v in vars(m).items() if k in ("forward", "zero_grad")}
                            for m in self.models]
        self.opt_types = [type(o) for o in self.optimizers]
        self.opt_dicts = [set(vars(o)) for o in self.optimizers]
        self.groups = [[[p for p in g["params"]] for g in o.param_groups] for o in self.optimizers]
        self.hyper = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
                      for o in self.optimizers]
        self.states = [copy.deepcopy(o.state_dict()) for o in self.optimizers]
        self.functions = _functions()
        self.globals = _amp_globals()

    def assert_unchanged(self):
        for m, params, bufs, d in zip(self.models, self.params, self.buffers, self.model_dicts):
            now = list(m.named_parameters())
            assert [n for n, _ in now] == [n for n, _, _ in params]
            for (_, p, before), (_, q) in zip(params, now):
                assert q is p and q.dtype == before.dtype and torch.equal(q, before)
            for (n, before), (_, b) in zip(bufs, m.named_buffers()):
                assert b.dtype == before.dtype and torch.equal(b, before), n
            assert {k: v for k, v in vars(m).items() if k in ("forward", "zero_grad")} == d
        for o, t, keys, groups, hyper, state in zip(self.optimizers, self.opt_types, self.opt_dicts, self.groups,
                                                     self.hyper, self.states):
            assert type(o) is t and set(vars(o)) == keys and not hasattr(o, "_amp_stash")
            assert [[p for p in g["params"]] for g in o.param_groups] == groups
            assert [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] == hyper
            assert _same(o.state_dict(), state)
        now = _functions()
        for name, fn in self.functions.items():
            assert _what_runs(now[name]) == _what_runs(fn), name
        now = _amp_globals()
        for key, value in self.globals.items():
            if isinstance(value, list):
                assert len(now[key]) == len(value) and all(a is b for a, b in zip(now[key], value)), key
            else:
                assert now[key] == value if key in ("verbosity", "registry") else now[key] is value, key


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def net():
    return bn_mlp(4, 8, 2)


def sgd(model, **kw):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, **kw)


def _trained_sgd(model):
    """An optimizer with momentum state, so a refused call that reloaded or moved it would show."""
    o = sgd(model)
    model(torch.randn(3, 4)).sum().backward()
    o.step()
    o.zero_grad()
    return o


# ---------------------------------------------------------------- register_*_function


@pytest.mark.parametrize("register", [amp.register_half_function, amp.register_float_function,
                                      amp.register_promote_function])
def test_registering_an_unreplaceable_attribute_is_refused(register):
    snap = Snapshot()
    with pytest.raises(TypeError, match=r"int\.bit_length cannot be replaced"):
        register(int, "bit_length")
    with pytest.raises(ValueError, match="No function named nope"):
        register(torch, "nope")
    with pytest.raises(ValueError, match="not callable"):
        register(torch, "float32")
    with pytest.raises(TypeError, match="name must be a str"):
        register(torch, 3)
    frozen = types.MappingProxyType({"f": torch.mm})  # an object whose attributes cannot be set
    with pytest.raises((TypeError, ValueError)):
        register(frozen, "get")
    snap.assert_unchanged()
    # the refused entries were not recorded: an O1 session starts and runs
    m = net()
    o = sgd(m)
    m, o = amp.initialize(m, o, opt_level="O1", verbosity=0)
    with amp.scale_loss(m(torch.randn(3, 4)).float().sum(), o) as scaled:
        scaled.backward()
    o.step()


def test_the_replaceability_probe_leaves_the_owner_as_it_was():
    class Base:
        def f(self, x):
            return x

    class Sub(Base):
        pass

    ns = types.ModuleType("ns")
    ns.g = torch.mm
    amp.register_float_function(Sub, "f")  # inherited: the probe must not leave an own copy behind
    amp.register_half_function(ns, "g")
    assert "f" not in vars(Sub) and vars(Base)["f"] is Base.__dict__["f"]
    assert ns.g is torch.mm


def test_a_registration_that_fails_while_a_session_is_active_records_nothing(monkeypatch):
    m = net()
    o = sgd(m)
    amp.initialize(m, o, opt_level="O1", verbosity=0)
    ns = types.ModuleType("ns")
    ns.fn = torch.mm
    registry = dict(_casts._USER_CAST_REGISTRY)
    installed = len(_amp_state.session.function_patches)

    def refuse(self, module, name, kind):
        raise RuntimeError("install refused")

    monkeypatch.setattr(FunctionPatches, "install", refuse)
    with pytest.raises(RuntimeError, match="install refused"):
        amp.register_half_function(ns, "fn")
    monkeypatch.undo()
    assert _casts._USER_CAST_REGISTRY == registry and ns.fn is torch.mm
    assert len(_amp_state.session.function_patches) == installed


def test_a_failed_registration_under_session_and_handle_undoes_the_session_install(monkeypatch):
    handle = amp.init(patch_type=torch.bfloat16)
    m = net()
    amp.initialize(m, sgd(m), opt_level="O1", verbosity=0)
    assert handle.is_active()
    ns = types.ModuleType("ns")
    ns.fn = torch.mm
    calls = []
    original_install = FunctionPatches.install

    def second_refused(self, module, name, kind):
        calls.append(self)
        if len(calls) == 2:
            raise RuntimeError("install refused")
        return original_install(self, module, name, kind)

    monkeypatch.setattr(FunctionPatches, "install", second_refused)
    with pytest.raises(RuntimeError, match="install refused"):
        amp.register_half_function(ns, "fn")
    monkeypatch.undo()
    assert ns.fn is torch.mm and (id(ns), "fn") not in _casts._USER_CAST_REGISTRY
    assert all((id(ns), "fn") not in fp._installed for fp in calls)


# ---------------------------------------------------------------- amp.init: all or nothing


def _stale_registration():
    """A function registered while it could be patched, and deleted since."""
    ns = types.ModuleType("stale")
    ns.fn = torch.mm
    amp.register_half_function(ns, "fn")
    del ns.fn
    return ns


def test_amp_init_refuses_a_stale_registration_before_patching():
    _stale_registration()
    snap = Snapshot()
    with pytest.raises(ValueError, match="No function named fn"):
        amp.init(patch_type=torch.bfloat16)
    snap.assert_unchanged()
    a = torch.randn(4, 4)
    assert torch.mm(a, a).dtype == torch.float32


def test_amp_init_that_fails_while_installing_puts_everything_back(monkeypatch):
    a = torch.randn(4, 4)
    ns = types.ModuleType("ns")
    ns.fn = torch.mm
    amp.register_half_function(ns, "fn")
    snap = Snapshot()

    def refuse(self):
        raise RuntimeError("install refused")

    monkeypatch.setattr(FunctionPatches, "install_registry", refuse)
    with pytest.raises(RuntimeError, match="install refused"):
        amp.init(patch_type=torch.bfloat16)
    monkeypatch.undo()
    snap.assert_unchanged()
    assert ns.fn is torch.mm and torch.mm(a, a).dtype == torch.float32
    amp.deinitialize()
    assert torch.mm(a, a).dtype == torch.float32


def test_a_failed_amp_init_leaves_the_earlier_handle_active(monkeypatch):
    a = torch.randn(4, 4)
    originals = _functions()
    first = amp.init(patch_type=torch.bfloat16)
    assert torch.mm(a, a).dtype == torch.bfloat16
    real = AmpHandle._activate

    def refuse_new(self):
        if self is not first:
            raise RuntimeError("activation refused")
        return real(self)

    monkeypatch.setattr(AmpHandle, "_activate", refuse_new)
    with pytest.raises(RuntimeError, match="activation refused"):
        amp.init(patch_type=torch.bfloat16)
    monkeypatch.undo()
    assert first.is_active() and _amp_state.handle is first and _amp_state.init_handle is first
    assert torch.mm(a, a).dtype == torch.bfloat16
    now = _functions()
    assert now["torch.mm"] is not originals["torch.mm"]
    for name, fn in now.items():  # patched once, on the originals (no wrapper of a wrapper)
        orig = originals[name] or getattr(torch._C.TensorBase, name.rsplit(".", 1)[1])  # (inherited by Tensor)
        assert fn is originals[name] or fn._apex_amp_init_original is orig, name
    amp.deinitialize()
    assert _functions() == originals and torch.mm(a, a).dtype == torch.float32


def test_deinitialize_ends_an_amp_init_that_an_initialize_followed():
    a = torch.randn(4, 4)
    before = _functions()
    amp.init(patch_type=torch.bfloat16)
    m = net()
    amp.initialize(m, sgd(m), opt_level="O2", verbosity=0)
    assert torch.mm(a, a).dtype == torch.bfloat16
    amp.deinitialize()
    assert _functions() == before and torch.mm(a, a).dtype == torch.float32


# ---------------------------------------------------------------- amp.initialize O1 and the registry


def test_initialize_o1_with_a_stale_registration_changes_nothing():
    _stale_registration()
    m = net()
    o = _trained_sgd(m)
    snap = Snapshot([m], [o])
    with pytest.raises(ValueError, match="No function named fn"):
        amp.initialize(m, o, opt_level="O1", verbosity=0)
    snap.assert_unchanged()


def test_initialize_o1_that_fails_installing_casts_changes_nothing_and_keeps_the_earlier_session(monkeypatch):
    m0 = net()
    o0 = sgd(m0)
    amp.initialize(m0, o0, opt_level="O1", verbosity=0)
    earlier = _amp_state.session
    ns = types.ModuleType("ns")
    ns.fn = torch.mm
    amp.register_float_function(ns, "fn")
    assert ns.fn is not torch.mm  # the active session wrapped it
    m = net()
    o = _trained_sgd(m)
    snap = Snapshot([m, m0], [o])
    wrapped = ns.fn
    real = FunctionPatches.install_registry

    def refuse_new(self):
        if self is not earlier.function_patches:
            raise RuntimeError("install refused")
        return real(self)

    monkeypatch.setattr(FunctionPatches, "install_registry", refuse_new)
    with pytest.raises(RuntimeError, match="install refused"):
        amp.initialize(m, o, opt_level="O1", verbosity=0)
    monkeypatch.undo()
    snap.assert_unchanged()
    # the earlier session's casts are back in place (its wrappers are new objects, of the same originals)
    assert _amp_state.session is earlier and len(earlier.function_patches) > 0
    assert ns.fn._apex_amp_patch_of is wrapped._apex_amp_patch_of is torch.mm
    with amp.scale_loss(m0(torch.randn(3, 4)).float().sum(), o0) as scaled:
        scaled.backward()
    o0.step()


# ---------------------------------------------------------------- nested scale_loss blocks


class Boom(Exception):
    pass


def _nested_run(level, combine, nested, accumulate):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    o = sgd(m)
    kw = {"combine_grad": True} if combine else {}
    m, o = amp.initialize(m, o, opt_level=level, num_losses=2, verbosity=0, **kw)
    g = torch.Generator().manual_seed(1)
    x0, x1, x2 = (torch.randn(16, 4, generator=g) * s for s in (1, 10, 1))
    o.zero_grad()
    if accumulate:
        with amp.scale_loss(m(x2).float().pow(2).mean(), o) as scaled:
            scaled.backward()
    with amp.scale_loss(m(x0).float().pow(2).mean(), o) as outer:
        if nested:
            grads = [None if p.grad is None else p.grad.clone() for p in amp.master_params(o)]
            scale = amp.state_dict()
            with pytest.raises(RuntimeError, match=r"optimizer 0 \(SGD\) already has a scale_loss block open "
                                                   r"\(loss_id 0\)"):
                with amp.scale_loss(m(x1).float().pow(2).mean(), o, loss_id=1) as inner:
                    inner.backward()
                    raise Boom()
            assert [None if p.grad is None else p.grad.clone() for p in amp.master_params(o)].__len__() == len(grads)
            for p, before in zip(amp.master_params(o), grads):
                assert (p.grad is None) == (before is None)
                if before is not None:
                    assert torch.equal(p.grad, before)
            assert amp.state_dict() == scale
        outer.backward()
    result = [p.grad.clone() for p in amp.master_params(o)]
    o.step()
    weights = [p.detach().clone() for p in m.parameters()]
    amp.deinitialize()
    return result, weights


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("combine", [False, True])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_block_nested_in_an_open_block_of_its_optimizer_is_refused(level, combine, accumulate):
    ref_grads, ref_weights = _nested_run(level, combine, False, accumulate)
    grads, weights = _nested_run(level, combine, True, accumulate)
    for a, b in zip(ref_grads + ref_weights, grads + weights):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_blocks_of_different_optimizers_still_nest():
    m1, m2 = net(), net()
    o1, o2 = sgd(m1), sgd(m2)
    [m1, m2], [o1, o2] = amp.initialize([m1, m2], [o1, o2], opt_level="O2", num_losses=2, verbosity=0)
    x = torch.randn(3, 4)
    with amp.scale_loss(m1(x).float().sum(), o1) as s1:
        with amp.scale_loss(m2(x).float().sum(), o2, loss_id=1) as s2:
            s2.backward()
        s1.backward()
    assert all(p.grad is not None for p in amp.master_params(o1))
    assert all(p.grad is not None for p in amp.master_params(o2))


def test_an_optimizer_listed_twice_in_scale_loss_is_refused():
    m = net()
    o = sgd(m)
    m, o = amp.initialize(m, o, opt_level="O1", verbosity=0)
    with amp.scale_loss(m(torch.randn(3, 4)).float().sum(), o) as scaled:
        scaled.backward()
    grads = [p.grad.clone() for p in m.parameters()]
    scale = amp.state_dict()
    with pytest.raises(ValueError, match=r"optimizers\[1\] is the same optimizer as optimizers\[0\]"):
        with amp.scale_loss(m(torch.randn(3, 4)).float().sum(), [o, o]) as scaled:
            scaled.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), grads)) and amp.state_dict() == scale
    assert o._amp_stash.open_block is None


# ---------------------------------------------------------------- TorchScript models under O2/O3


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("where", ["model", "submodule"])
def test_a_scripted_model_with_fp32_state_dict_is_refused_before_the_cast(level, where):
    inner = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    m = inner if where == "model" else torch.nn.Sequential(torch.nn.Linear(4, 4), inner)
    o = _trained_sgd(m)
    snap = Snapshot([m], [o])
    what = "model 0" if where == "model" else "model 0 \\(its submodule '1'\\)"
    with pytest.raises(RuntimeError, match=f"{what} is a TorchScript module .*fp32_state_dict=False"):
        amp.initialize(m, o, opt_level=level, verbosity=0)
    snap.assert_unchanged()
    # the way the message names works
    m, o = amp.initialize(m, o, opt_level=level, fp32_state_dict=False, verbosity=0)
    assert next(m.parameters()).dtype == torch.bfloat16
    assert m(torch.randn(2, 4)).dtype == torch.float32


# ---------------------------------------------------------------- the same model twice


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_same_model_twice_is_refused(level):
    m, other = net(), net()
    o = _trained_sgd(m)
    snap = Snapshot([m, other], [o])
    with pytest.raises(RuntimeError, match="model 2 appears twice in the list passed to amp.initialize "
                                           r"\(also as model 0\)"):
        amp.initialize([m, other, m], o, opt_level=level, verbosity=0)
    snap.assert_unchanged()
    # listed once, it goes through, and a later initialize takes it back
    amp.initialize([m, other], o, opt_level=level, verbosity=0)
    amp.initialize(m, sgd(m), opt_level="O1", verbosity=0)
    assert all(p.dtype == torch.float32 for p in m.parameters())


# ---------------------------------------------------------------- initial loss scale and its bounds


@pytest.mark.parametrize("init, lo, hi, expect", [
    (1.0, 1024.0, 2.0 ** 24, 1024.0),  # below the min: raised to it
    (2.0 ** 30, None, 2.0 ** 20, 2.0 ** 20),  # above the max: lowered to it
    (2.0 ** 12, 1024.0, 2.0 ** 20, 2.0 ** 12),  # inside: as given
])
def test_the_initial_scale_is_clamped_into_min_max(init, lo, hi, expect):
    m = net()
    o = sgd(m)
    m, o = amp.initialize(m, o, opt_level="O2", dynamic_init_scale=init, min_loss_scale=lo, max_loss_scale=hi,
                          verbosity=0)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": expect, "unskipped": 0}
    with amp.scale_loss(m(torch.randn(2, 4)).float().sum() * float("inf"), o) as scaled:
        scaled.backward()
    o.step()
    after = amp.state_dict()["loss_scaler0"]["loss_scale"]
    assert after == max(expect / 2, lo or 0.0) and after <= expect  # a back-off never raises the scale


def test_loss_scaler_clamps_its_initial_scale_too():
    assert amp.LossScaler("dynamic", init_scale=1.0, min_loss_scale=8.0).loss_scale() == 8.0
    assert amp.LossScaler("dynamic", init_scale=2.0 ** 30).loss_scale() == 2.0 ** 24
    assert amp.LossScaler(4.0, min_loss_scale=8.0).loss_scale() == 4.0  # a static scale is used as given


# ---------------------------------------------------------------- amp.load_state_dict


def test_two_keys_naming_one_scaler_are_refused_before_loading():
    m = net()
    amp.initialize(m, opt_level="O1", num_losses=2, verbosity=0)
    before = amp.state_dict()
    bad = {"loss_scaler1": {"loss_scale": 4.0, "unskipped": 3},
           "loss_scaler0": {"loss_scale": 2.0, "unskipped": 1},
           "loss_scaler00": {"loss_scale": 8.0, "unskipped": 2}}
    with pytest.raises(ValueError, match="'loss_scaler0' and 'loss_scaler00' both name loss scaler 0"):
        amp.load_state_dict(bad)
    assert amp.state_dict() == before
    amp.load_state_dict({"loss_scaler00": {"loss_scale": 8.0, "unskipped": 2}})  # one spelling alone is fine
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 8.0, "unskipped": 2}


def test_an_optimizer_checkpoint_with_two_keys_for_one_scaler_is_refused():
    from apex._checkpoint_keys import AMP_SCALERS_KEY

    m = net()
    o = _trained_sgd(m)
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    sd = o.state_dict()
    sd[AMP_SCALERS_KEY] = {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0},
                           "loss_scaler000": {"loss_scale": 4.0, "unskipped": 0}}
    before = copy.deepcopy(o.state_dict())
    with pytest.raises(ValueError, match="both name loss scaler 0"):
        o.load_state_dict(sd)
    assert _same(o.state_dict(), before) and o._amp_stash.pending_scalers == {}


# ---------------------------------------------------------------- complex losses


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_a_complex_loss_is_refused_before_anything_changes(level):
    m = net()
    o = sgd(m)
    m, o = amp.initialize(m, o, opt_level=level, verbosity=0)
    with amp.scale_loss(m(torch.randn(3, 4)).float().sum(), o) as scaled:
        scaled.backward()
    grads = [p.grad.clone() for p in amp.master_params(o)]
    scale = amp.state_dict()
    loss = torch.complex(m(torch.randn(3, 4)).float().sum(), torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"loss must be a real tensor, got a torch\.complex64 one"):
        with amp.scale_loss(loss, o) as scaled:
            scaled.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(amp.master_params(o), grads))
    assert amp.state_dict() == scale and o._amp_stash.open_block is None
    with amp.scale_loss(loss.real, o) as scaled:  # what was meant goes through
        scaled.backward()
    o.step()
