"""Checkpoints after combining: compact by default, safetensors-compatible, loadable in place; amp O2/O3
checkpoint parity with NVIDIA's amp (fp32 model state_dict, optimizer state re-cast, either load order)."""

from __future__ import annotations

import copy
import io
import logging
import pickle

import pytest
import torch
from _amp_harness import amp_steps

import apex.optimizers as O
from apex import amp
from apex.contrib.combine_tensors import is_combined_tensor_valid


class Net(torch.nn.Module):
    """A large body and a small head, so a head checkpoint that drags the body along is obvious."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(256, 256)
        self.norm = torch.nn.LayerNorm(256)
        self.head = torch.nn.Linear(256, 4)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.body(x))))


def _bytes(obj) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return len(buf.getvalue())


def _own_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def _trained(opt_cls=O.NpuFusedAdam, steps=2, seed=0):
    torch.manual_seed(seed)
    model = Net()
    opt = opt_cls(model.parameters(), lr=1e-2)
    for i in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 256, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        opt.step()
    return model, opt


def _flat_params(opt):
    return [s.flat_p for c in opt._groups.values() for s in c.sets]


def test_head_state_dict_holds_only_the_head():
    model, opt = _trained()
    assert is_combined_tensor_valid(_flat_params(opt)[0], list(model.parameters()))
    head_bytes = _own_bytes(model.head)
    assert head_bytes == 4 * (256 * 4 + 4)
    assert _bytes(model.head.state_dict()) < head_bytes + 2048  # own elements + pickle overhead
    full = _bytes(model.state_dict())
    assert full < _own_bytes(model) + 4096
    for v in model.state_dict().values():
        assert v.untyped_storage().nbytes() == v.numel() * v.element_size()


@pytest.fixture
def fresh_tracking(monkeypatch):
    """Module tracking as in a new process (not started); the registration hook a test starts is removed."""
    import gc

    from apex.contrib import combine_tensors as ct

    before = (ct._tracked_modules, ct._registration_handle)
    ct._tracked_modules, ct._registration_handle = None, None
    calls = []
    real = gc.get_objects
    monkeypatch.setattr(gc, "get_objects", lambda *a, **k: calls.append(1) or real(*a, **k))
    yield calls
    if ct._registration_handle is not None:
        ct._registration_handle.remove()
    ct._tracked_modules, ct._registration_handle = before


def test_an_optimizer_walks_the_objects_once_for_all_its_groups(fresh_tracking):
    """Several groups and dtypes: every module holding a param gets the compacting hook (a tied weight's second
    owner included) from one walk over the interpreter's objects, and a re-combine walks no more."""
    from apex.contrib.combine_tensors import _has_compact_hook

    calls = fresh_tracking
    model = Net()
    model.body.half()
    tied = torch.nn.Linear(256, 4)
    tied.weight = model.head.weight
    groups = [{"params": list(model.body.parameters())}, {"params": list(model.norm.parameters())},
              {"params": list(model.head.parameters()), "lr": 1e-3}]
    opt = O.NpuFusedSGD(groups, lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert len(calls) == 1
    assert all(_has_compact_hook(m) for m in (model.body, model.norm, model.head, tied))
    assert not _has_compact_hook(model)  # holds no param of its own
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    opt.step()
    assert len(calls) == 2  # only for the new param, which no module holds
    opt.param_groups[0]["params"][0].data = torch.zeros_like(model.body.weight)  # rebinding forces a re-combine
    opt.step()
    assert len(calls) == 2
    assert _bytes(tied.state_dict()) < _own_bytes(tied) + 2048


def test_per_param_groups_look_at_each_param_once_per_pass(fresh_tracking, monkeypatch):
    """One group per param (mmengine's paramwise options make them): the first step hooks the owning modules
    with one call over the params of every group it combines, a walk included, instead of one call over all
    groups' params per group (quadratic in the number of groups); later steps hook nothing."""
    import apex.optimizers._base as base

    seen = []
    real = base._hook_owning_modules
    monkeypatch.setattr(base, "_hook_owning_modules", lambda ps: seen.append(len(list(ps))) or real([]))
    model = torch.nn.Sequential(*(torch.nn.Linear(3, 3) for _ in range(20)))
    params = list(model.parameters())
    opt = O.NpuFusedAdamW([{"params": [p], "weight_decay": 0.1 * (k % 2)} for k, p in enumerate(params)], lr=0.1)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        opt.zero_grad()
    assert seen == [len(params)]
    seen.clear()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    opt.step()
    assert seen == [1]  # only the new group is combined


def test_modules_made_after_the_first_walk_are_found_without_another(fresh_tracking):
    """After the first walk, torch's parameter-registration hook keeps the set of modules: a model built later
    (a test matrix, a second run in one process) is found without walking the interpreter's objects again, also
    a param put straight into a known module's ``_parameters`` and one shared with a module built later."""
    from apex.contrib.combine_tensors import _has_compact_hook

    calls = fresh_tracking
    first = Net()
    O.NpuFusedSGD(first.parameters(), lr=0.1).step()  # no grads: combines, updates nothing
    assert len(calls) == 1
    later = Net()
    later.body._parameters["bias"] = torch.nn.Parameter(torch.zeros_like(later.body.bias))  # no registration
    tied = torch.nn.Linear(256, 4)
    tied.weight = later.head.weight
    opt = O.NpuFusedSGD(later.parameters(), lr=0.1)
    for p in later.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert len(calls) == 1
    assert all(_has_compact_hook(m) for m in (later.body, later.norm, later.head, tied))
    assert _bytes(later.body.state_dict()) < _own_bytes(later.body) + 2048
    free = [torch.nn.Parameter(torch.zeros(5)) for _ in range(3)]  # held by no module: one walk to know that
    O.NpuFusedAdam(free, lr=0.1).step()
    O.NpuFusedAdam(free, lr=0.1).step()
    assert len(calls) == 2


def test_a_deep_copied_model_is_found_by_a_walk_and_tracked_after(fresh_tracking):
    """copy.deepcopy (and unpickling) builds modules without registering their params: a param no tracked
    module holds makes a walk, which finds the copy and tracks it from then on."""
    import copy

    from apex.contrib.combine_tensors import _has_compact_hook

    calls = fresh_tracking
    model = Net()
    O.NpuFusedSGD(model.parameters(), lr=0.1).step()
    ema = copy.deepcopy(model)
    O.NpuFusedSGD(ema.parameters(), lr=0.1).step()
    assert len(calls) == 2
    assert all(_has_compact_hook(m) for m in (ema.body, ema.norm, ema.head))
    ema.head.weight = torch.nn.Parameter(torch.zeros_like(ema.head.weight))  # registered: no walk needed
    O.NpuFusedSGD(ema.parameters(), lr=0.1).step()
    assert len(calls) == 2
    assert _bytes(ema.state_dict()) < _own_bytes(ema) + 4096


def test_state_dict_entries_alias_the_params_like_torch():
    """No copy: the entries share the params' memory (torch's ``param.detach()`` semantics)."""
    model, _ = _trained()
    sd = model.state_dict()
    assert sd["head.weight"].data_ptr() == model.head.weight.data_ptr()
    assert not sd["head.weight"].requires_grad
    kv = model.state_dict(keep_vars=True)
    assert kv["head.weight"] is model.head.weight  # keep_vars: the live params, untouched


def test_safetensors_save_file_and_roundtrip(tmp_path):
    model, _ = _trained()
    path = tmp_path / "model.safetensors"
    safetensors_torch = pytest.importorskip("safetensors.torch")  # in the test dependency group
    safetensors_torch.save_file(model.state_dict(), str(path))
    assert path.stat().st_size < _own_bytes(model) + 4096
    loaded = safetensors_torch.load_file(str(path))
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v)


def test_load_state_dict_into_combined_model_keeps_params_combined():
    model, opt = _trained()
    params = list(model.parameters())
    ptrs = [p.data_ptr() for p in params]
    count = opt.recombine_count
    target = {k: v.clone() + 0.5 for k, v in model.state_dict().items()}
    model.load_state_dict(target)
    assert [p.data_ptr() for p in params] == ptrs
    assert is_combined_tensor_valid(_flat_params(opt)[0], params)
    for k, v in model.state_dict().items():
        assert torch.equal(v, target[k])
    opt.zero_grad(set_to_none=False)  # grads stay in their slots too
    model(torch.randn(8, 256)).pow(2).mean().backward()
    opt.step()
    assert opt.recombine_count == count  # the step found params and grads where it left them


def test_checkpoint_loads_into_a_fresh_uncombined_model():
    model, _ = _trained()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = Net()
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_tied_weights_stay_tied_in_the_file():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 16)
    out = torch.nn.Linear(16, 50, bias=False)
    out.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "out": out, "extra": torch.nn.Linear(16, 16)})
    opt = O.NpuFusedSGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sd = model.state_dict()
    assert sd["emb.weight"].untyped_storage().nbytes() == 50 * 16 * 4
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert back["emb.weight"].data_ptr() == back["out.weight"].data_ptr()  # one storage in the file


def test_optimizer_state_dict_is_compact_and_a_copy():
    model, opt = _trained()
    sd = opt.state_dict()
    flat_ptrs = {s.flat_s[n].untyped_storage().data_ptr() for c in opt._groups.values() for s in c.sets
                 for n in s.flat_s}
    for entry in sd["state"].values():
        for name, v in entry.items():
            assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), name
            assert v.untyped_storage().data_ptr() not in flat_ptrs, name
    assert _bytes(sd) < 3 * _own_bytes(model) + 8192  # two moments + steps


def test_hooked_model_pickles_deepcopies_and_swaps():
    model, _ = _trained()
    clone = pickle.loads(pickle.dumps(model))
    twin = copy.deepcopy(model)
    for m in (clone, twin):
        for a, b in zip(m.state_dict().values(), model.state_dict().values()):
            assert torch.equal(a, b)
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.bfloat16)  # swap_tensors refuses params with weak references: none are taken
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert model.head.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------- amp parity

amp_env = pytest.mark.usefixtures("amp_env")


def _bn_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.ReLU(),
                               torch.nn.Linear(12, 3))


@amp_env
def test_o2_model_state_dict_is_fp32_and_loads_back():
    m = _bn_net()
    o = O.NpuFusedAdam(m.parameters(), lr=1e-2)
    amp.initialize(m, o, opt_level="O2", verbosity=0)
    low = m[0].weight.dtype
    assert low in (torch.float16, torch.bfloat16)
    amp_steps(m, o, 0, 2)
    sd = m.state_dict()
    assert all(v.dtype == torch.float32 for k, v in sd.items() if v.is_floating_point())
    assert torch.equal(sd["0.weight"], m[0].weight.float())
    plain = _bn_net(seed=5)
    plain.load_state_dict(sd)  # an fp32 model takes an O2 checkpoint
    assert torch.equal(plain[0].weight, m[0].weight.float())
    amp.deinitialize()
    m2 = _bn_net(seed=7)
    o2 = O.NpuFusedAdam(m2.parameters(), lr=1e-2)
    amp.initialize(m2, o2, opt_level="O2", verbosity=0)
    m2.load_state_dict(sd)  # the fp32 checkpoint into an O2 model: converted into its low-precision params
    assert m2[0].weight.dtype == low and torch.equal(m2[0].weight, m[0].weight)


@amp_env
def test_o2_state_dict_keeps_tied_weights_tied():
    """A tied weight (an embedding shared with the output layer, as GPT-2 ties them) is one fp32 tensor under both
    keys, so a checkpoint stores it once, as an fp32 model's stores it; it loads back into a tied fp32 model.
    A plain dict given as ``destination`` cannot be tracked: the values are right, converted apart."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)
            self.head = torch.nn.Linear(8, 50, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    torch.manual_seed(0)
    m = Tied()
    fp32_bytes = io.BytesIO()
    torch.save(m.state_dict(), fp32_bytes)
    amp.initialize(m, opt_level="O2", verbosity=0)
    sd = m.state_dict()
    assert sd["emb.weight"].dtype == torch.float32 and sd["emb.weight"] is sd["head.weight"]
    o2_bytes = io.BytesIO()
    torch.save(sd, o2_bytes)
    # one copy of the shared weight (a second would add its 50 x 8 x 4 bytes); the pickles differ by a few bytes
    assert abs(len(o2_bytes.getvalue()) - len(fp32_bytes.getvalue())) < 50 * 8 * 4 // 2
    o2_bytes.seek(0)
    back = Tied()
    back.load_state_dict(torch.load(o2_bytes, weights_only=True))
    assert back.head.weight is back.emb.weight and torch.equal(back.emb.weight, m.emb.weight.float())
    apart = m.state_dict(destination={})
    assert apart["emb.weight"] is not apart["head.weight"] and torch.equal(apart["emb.weight"], apart["head.weight"])


@amp_env
def test_fp32_state_dict_opt_out():
    m = _bn_net()
    amp.initialize(m, opt_level="O2", fp32_state_dict=False, verbosity=0)
    assert m.state_dict()["0.weight"].dtype in (torch.float16, torch.bfloat16)
    with pytest.raises(TypeError, match="fp32_state_dict"):
        amp.initialize(_bn_net(), opt_level="O2", fp32_state_dict="no", verbosity=0)


@amp_env
def test_fp32_state_dict_hooks_removed_by_deinitialize():
    m = _bn_net()
    amp.initialize(m, opt_level="O3", verbosity=0)
    assert m.state_dict()["0.weight"].dtype == torch.float32
    amp.deinitialize()
    assert m.state_dict()["0.weight"].dtype in (torch.float16, torch.bfloat16)


def _resume(level, make_opt, load_first, caplog):
    """Run 4 steps straight; separately, checkpoint after 2 and resume (optimizer loaded before or after
    initialize). Returns (straight params, resumed params, warnings logged)."""
    kw = dict(opt_level=level, verbosity=0, loss_scale=128.0 if level != "O3" else None)
    kw = {k: v for k, v in kw.items() if v is not None}
    m = _bn_net()
    o = make_opt(m)
    amp.initialize(m, o, **kw)
    amp_steps(m, o, 0, 2)
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": o.state_dict(), "amp": amp.state_dict()}, buf)
    amp_steps(m, o, 2, 4)
    straight = [p.detach().clone() for p in m.parameters()]
    amp.deinitialize()

    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    m2 = _bn_net(seed=9)
    o2 = make_opt(m2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="apex.amp"):
        if load_first:  # mmengine's Runner order: everything loaded, then amp.initialize
            m2.load_state_dict(ck["model"])
            o2.load_state_dict(ck["opt"])
            amp.initialize(m2, o2, **kw)
        else:
            amp.initialize(m2, o2, **kw)
            m2.load_state_dict(ck["model"])
            o2.load_state_dict(ck["opt"])
        amp.load_state_dict(ck["amp"])
    amp_steps(m2, o2, 2, 4)
    return straight, [p.detach().clone() for p in m2.parameters()], caplog.text


MAKERS = {
    "NpuFusedAdam": lambda m: O.NpuFusedAdam(m.parameters(), lr=1e-2),
    "FusedAdam": lambda m: O.FusedAdam(m.parameters(), lr=1e-2),
    "torch.Adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
}


@amp_env
@pytest.mark.parametrize("load_first", [True, False], ids=["loaded-before-initialize", "loaded-after"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("opt_name", list(MAKERS))
def test_resume_is_bit_identical_in_either_load_order(opt_name, level, load_first, caplog):
    straight, resumed, log = _resume(level, MAKERS[opt_name], load_first, caplog)
    if level == "O2" and load_first and opt_name == "torch.Adam":
        # a torch optimizer drops the checkpoint's masters: detected and explained, not silent
        assert "not bit-identical" in log and "after amp.initialize" in log
        return
    assert "not bit-identical" not in log
    for a, b in zip(straight, resumed):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)


# ---------------------------------------------------------------- the loss scale travels with the optimizer
def _overflowed_twice(level, make_opt, **kw):
    """An amp run whose scale backed off twice (two overflowing steps) and grew once (window 2)."""
    m = _bn_net()
    o = make_opt(m)
    amp.initialize(m, o, opt_level=level, verbosity=0, scale_window=2, **kw)
    for i in range(5):
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(i))
        loss = m(x).float().pow(2).mean() * (float("inf") if i < 2 else 1.0)
        with amp.scale_loss(loss, o) as scaled:
            scaled.backward()
        o.step()
        o.zero_grad()
    return m, o


def _scale_used(m, o, loss_id=0):
    """The loss scale of one clean scale_loss block on ``o`` (the scaled loss over the loss)."""
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(99))
    loss = m(x.to(next(m.parameters()).dtype)).float().pow(2).mean()
    with amp.scale_loss(loss, o, loss_id=loss_id) as scaled:
        used = float(scaled.detach() / loss.detach())
        scaled.backward()
    o.step()
    o.zero_grad()
    return used


@amp_env
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("opt_name", list(MAKERS))
def test_optimizer_checkpoint_carries_the_loss_scale(opt_name, level):
    """Code that saves only the optimizer (transformers' Trainer, DeepSpeed) resumes at the loss scale it stopped
    at: the optimizer's state dict holds amp's scalers, and the loaded optimizer's first scale_loss per loss
    restores that loss's scaler."""
    _, o = _overflowed_twice(level, MAKERS[opt_name])
    saved = o.state_dict()
    assert saved["apex_amp_loss_scalers"] == dict(amp.state_dict())
    assert saved["apex_amp_loss_scalers"]["loss_scaler0"] == {"loss_scale": 2.0 ** 15, "unskipped": 1}
    ck = copy.deepcopy(saved)
    amp.deinitialize()
    m2 = _bn_net(seed=3)
    o2 = MAKERS[opt_name](m2)
    amp.initialize(m2, o2, opt_level=level, verbosity=0, scale_window=2)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0 ** 16
    o2.load_state_dict(ck)
    assert o2.state_dict()["apex_amp_loss_scalers"] == ck["apex_amp_loss_scalers"]  # held, saved again as loaded
    assert _scale_used(m2, o2) == 2.0 ** 15
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0 ** 16, "unskipped": 0}  # grew: window 2
    # a checkpoint without the entry (upstream's, or one saved before amp) leaves the scale alone
    del ck["apex_amp_loss_scalers"]
    amp._amp_state.loss_scalers[0].load(8.0, 0)
    o2.load_state_dict(ck)
    assert _scale_used(m2, o2) == 8.0


@amp_env
def test_optimizer_checkpoint_restores_only_the_losses_it_is_scaled_with():
    """NVIDIA's checkpoint tests train a restored copy beside the original in one process, the copy on other loss
    ids: loading the copy's optimizer must not move the original's scale (the scalers are process-wide)."""
    m, o = _overflowed_twice("O1", MAKERS["torch.Adam"], num_losses=2)
    ck = copy.deepcopy(o.state_dict())
    assert ck["apex_amp_loss_scalers"]["loss_scaler0"]["loss_scale"] == 2.0 ** 15
    m2 = _bn_net(seed=3)
    o2 = MAKERS["torch.Adam"](m2)
    amp.initialize(m2, o2, opt_level="O1", verbosity=0, scale_window=2, num_losses=2)
    o2.load_state_dict(ck)
    assert _scale_used(m, o, loss_id=0) == 2.0 ** 16  # the original, on the new session's fresh scaler 0
    assert _scale_used(m2, o2, loss_id=1) == 2.0 ** 16  # the copy: its checkpoint's (unused) scaler 1
    # an explicit amp checkpoint decides over what optimizers hold
    o2.load_state_dict(ck)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0},
                         "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}})
    assert _scale_used(m2, o2, loss_id=0) == 4.0


@amp_env
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("opt_name", ["NpuFusedAdam", "FusedAdam"])
def test_apex_optimizer_loaded_before_initialize_gives_initialize_the_loss_scale(opt_name, level):
    """mmengine's order (load, then initialize): an apex optimizer keeps the checkpoint's scalers for the
    initialize that follows, as it keeps its masters."""
    _, o = _overflowed_twice("O2", MAKERS[opt_name])
    ck = copy.deepcopy(o.state_dict())
    amp.deinitialize()
    m2 = _bn_net(seed=3)
    o2 = MAKERS[opt_name](m2)
    o2.load_state_dict(ck)
    amp.initialize(m2, o2, opt_level=level, verbosity=0, scale_window=2)
    assert o2.loaded_amp_scalers is None  # taken by initialize
    assert _scale_used(m2, o2) == 2.0 ** 15


@amp_env
@pytest.mark.parametrize("opt_name", list(MAKERS))
@pytest.mark.parametrize("bad, exc", [
    ({"loss_scaler0": {"loss_scale": float("nan"), "unskipped": 0}}, ValueError),
    ({"loss_scaler0": {"loss_scale": 1024.0}}, TypeError),
    ({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": -1}}, ValueError),
    ({"scaler": {"loss_scale": 1024.0, "unskipped": 0}}, RuntimeError),
    ([1024.0], TypeError),
])
def test_a_bad_loss_scale_entry_is_refused_before_anything_loads(opt_name, bad, exc):
    _, o = _overflowed_twice("O2", MAKERS[opt_name])
    ck = copy.deepcopy(o.state_dict())
    ck["apex_amp_loss_scalers"] = bad
    for group in ck["param_groups"]:
        group["lr"] = 0.5  # would change if the load went ahead
    before = copy.deepcopy(o.state_dict())
    with pytest.raises(exc, match="apex_amp_loss_scalers"):
        o.load_state_dict(ck)
    after = o.state_dict()
    assert [g["lr"] for g in after["param_groups"]] == [g["lr"] for g in before["param_groups"]]
    assert after["apex_amp_loss_scalers"] == before["apex_amp_loss_scalers"]
    amp.deinitialize()
    if opt_name != "torch.Adam":  # apex optimizers check the entry when loaded before initialize, too
        fresh = MAKERS[opt_name](_bn_net())
        with pytest.raises(exc, match="apex_amp_loss_scalers"):
            fresh.load_state_dict(ck)


@amp_env
def test_an_amp_checkpoint_loads_into_an_optimizer_without_amp():
    _, o = _overflowed_twice("O1", MAKERS["torch.Adam"])
    ck = copy.deepcopy(o.state_dict())
    amp.deinitialize()
    for name, make in MAKERS.items():
        plain = make(_bn_net())
        plain.load_state_dict(ck)  # the entry is not the optimizer's: ignored by torch's load, kept by ours
        assert plain.state_dict()["param_groups"][0]["lr"] == ck["param_groups"][0]["lr"], name


@amp_env
def test_o2_per_param_groups_search_the_modules_once_per_pass(fresh_tracking, monkeypatch):
    """amp O2 with one group per param: the first step combines the masters and their model copies and hooks
    the modules holding both in one search of the tracked modules (one per set's copies was quadratic in the
    number of groups); every module holding a model copy gets the compacting hook."""
    import apex.contrib.combine_tensors as ct

    searches = []
    real = ct._hook_owners
    monkeypatch.setattr(ct, "_hook_owners", lambda mods, ids: searches.append(len(ids)) or real(mods, ids))
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(12)))
    opt = O.NpuFusedAdam([{"params": [p]} for p in model.parameters()], lr=1e-2)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    amp_steps(model, opt, 0, 2)
    assert len(searches) <= 2, searches  # the masters' pass (and a walk), not one per group
    assert all(ct._has_compact_hook(m) for m in model)
