"""State is validated where it enters: scaler values, amp and optimizer checkpoints, constructor arguments.

Each rejected call raises TypeError (wrong kind of value) or ValueError (wrong value) naming the key,
and leaves the object as it was: its state_dict is unchanged and it keeps stepping exactly like an
untouched twin.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _amp_harness import bn_mlp
from _state_cases import IDS, OPTIMIZERS, feed, make_params, run, same_state, snapshot

from apex import amp
from apex.amp import LossScaler
from apex.parallel import LARC

INF, NAN = float("inf"), float("nan")


# ---------------------------------------------------------------- LossScaler


@pytest.mark.parametrize("args,kwargs,exc", [
    ((-4.0,), {}, ValueError),
    ((0.0,), {}, ValueError),
    ((INF,), {}, ValueError),
    ((NAN,), {}, ValueError),
    (("static",), {}, ValueError),
    (([1.0],), {}, TypeError),
    (("dynamic",), dict(init_scale=NAN), ValueError),
    (("dynamic",), dict(init_scale=INF), ValueError),
    (("dynamic",), dict(init_scale=-1.0), ValueError),
    (("dynamic",), dict(init_scale="big"), TypeError),
    (("dynamic",), dict(scale_window=0), ValueError),
    (("dynamic",), dict(scale_window=2.5), TypeError),
    (("dynamic",), dict(scale_factor=0.5), ValueError),
    (("dynamic",), dict(backoff_factor=2.0), ValueError),
    (("dynamic",), dict(backoff_factor=0.0), ValueError),
    (("dynamic",), dict(min_loss_scale=NAN), ValueError),
    (("dynamic",), dict(max_loss_scale=INF), ValueError),
    (("dynamic",), dict(min_loss_scale=8.0, max_loss_scale=4.0), ValueError),
])
def test_loss_scaler_rejects_bad_construction(args, kwargs, exc):
    with pytest.raises(exc, match="LossScaler"):
        LossScaler(*args, **kwargs)


def test_loss_scaler_load_rejects_and_keeps_state():
    s = LossScaler("dynamic", init_scale=64.0, scale_window=3)
    s.load(32.0, 2)
    for scale, count, exc in [(INF, 0, ValueError), (NAN, 0, ValueError), (-1.0, 0, ValueError), (0.0, 0, ValueError),
                              ("8", 0, TypeError), (8.0, -1, ValueError), (8.0, "1", TypeError), (8.0, 1.5, TypeError)]:
        with pytest.raises(exc):
            s.load(scale, count)
        assert s.state() == {"loss_scale": 32.0, "unskipped": 2}
    assert s.update_scale() is False and s.state() == {"loss_scale": 64.0, "unskipped": 0}


def test_growth_resumes_for_a_count_at_or_above_the_window():
    """A count loaded from a run with a larger window (>= this window) grows at the next clean step."""
    s = LossScaler("dynamic", init_scale=8.0, scale_window=2)
    s.load(8.0, 5000)
    assert s.update_scale() is False
    assert s.state() == {"loss_scale": 16.0, "unskipped": 0}
    s.update_scale()
    s.update_scale()
    assert s.state() == {"loss_scale": 32.0, "unskipped": 0}  # and the normal cycle continues


# ---------------------------------------------------------------- amp.load_state_dict

pytestmark_amp = pytest.mark.usefixtures("amp_env")


def _amp_step(m, o, x):
    o.zero_grad()
    with amp.scale_loss((m(x).float() - 1).pow(2).mean(), o) as scaled:
        scaled.backward()
    o.step()


@pytestmark_amp
@pytest.mark.parametrize("entry,exc", [
    ({"loss_scale": INF, "unskipped": 0}, ValueError),
    ({"loss_scale": NAN, "unskipped": 0}, ValueError),
    ({"loss_scale": 0.0, "unskipped": 0}, ValueError),
    ({"loss_scale": -8.0, "unskipped": 0}, ValueError),
    ({"loss_scale": "8", "unskipped": 0}, TypeError),
    ({"loss_scale": True, "unskipped": 0}, TypeError),
    ({"loss_scale": torch.tensor([1.0, 2.0]), "unskipped": 0}, TypeError),
    ({"loss_scale": 8.0, "unskipped": -1}, ValueError),
    ({"loss_scale": 8.0, "unskipped": "3"}, TypeError),
    ({"loss_scale": 8.0, "unskipped": 1.5}, TypeError),
    ({"loss_scale": 8.0}, TypeError),
    ("not a dict", TypeError),
])
def test_amp_load_state_dict_rejects_with_nothing_changed(entry, exc):
    torch.manual_seed(0)
    m = bn_mlp(4, 8, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, o, opt_level="O1", num_losses=2, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 512.0, "unskipped": 3},
                         "loss_scaler1": {"loss_scale": 64.0, "unskipped": 1}})
    before = amp.state_dict()
    with pytest.raises(exc, match="loss_scaler1"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "loss_scaler1": entry})
    assert amp.state_dict() == before
    _amp_step(m, o, torch.randn(8, 4))
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 512.0, "unskipped": 4}
    assert all(torch.isfinite(p).all() for p in m.parameters())


@pytestmark_amp
def test_amp_loaded_count_above_window_grows_at_next_step():
    torch.manual_seed(0)
    m = bn_mlp(4, 8, 2)
    o = torch.optim.SGD(m.parameters(), lr=0.01)
    amp.initialize(m, o, opt_level="O1", scale_window=10, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 256.0, "unskipped": 50}})
    _amp_step(m, o, torch.randn(8, 4))
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 512.0, "unskipped": 0}


# ---------------------------------------------------------------- optimizer load_state_dict


def _trained(cls, kw, steps=2):
    params = make_params()
    opt = cls(params, **kw)
    run(opt, params, steps)
    return opt, params


def _where_step(sd):
    """('state', key) when steps are per param, ('group', None) when the group holds it, else None."""
    key = sd["param_groups"][0]["params"][0]
    if "step" in sd["state"][key]:
        return "state"
    if "step" in sd["param_groups"][0]:
        return "group"
    return None


def _corruptions(sd):
    """(name, mutate(sd), exception type, message fragment) for this optimizer's state_dict."""
    key = sd["param_groups"][0]["params"][0]
    entry = sd["state"][key]
    shaped = next(n for n, v in entry.items() if isinstance(v, torch.Tensor) and v.shape == (3, 4))
    out = [
        ("not a tensor", lambda s: s["state"][key].__setitem__(shaped, 3.0), TypeError, repr(shaped)),
        ("a list", lambda s: s["state"][key].__setitem__(shaped, [[0.0] * 4] * 3), TypeError, repr(shaped)),
        ("wrong size", lambda s: s["state"][key].__setitem__(shaped, torch.zeros(5)), ValueError, "expected shape"),
        ("wrong shape", lambda s: s["state"][key].__setitem__(shaped, torch.zeros(4, 3)), ValueError,
         "expected shape"),
        ("int dtype", lambda s: s["state"][key].__setitem__(shaped, torch.zeros(3, 4, dtype=torch.int64)),
         TypeError, "floating point"),
        ("meta", lambda s: s["state"][key].__setitem__(shaped, torch.zeros(3, 4, device="meta")), ValueError,
         "a meta tensor holds no values"),
        ("missing entry", lambda s: s["state"][key].pop(shaped), ValueError, "lacks")
        if sum(isinstance(v, torch.Tensor) and v.shape == (3, 4) for v in entry.values()) > 1 else None,
        ("unknown id", lambda s: s["state"].__setitem__(999, {}), ValueError, "999"),
        ("entry not a dict", lambda s: s["state"].__setitem__(key, 1.0), TypeError, "dict"),
        ("group count", lambda s: s["param_groups"].append(dict(s["param_groups"][0], params=[])), ValueError,
         "number of parameter groups"),
        ("group size", lambda s: s["param_groups"][0]["params"].pop(), ValueError, "params"),
        ("inf lr", lambda s: s["param_groups"][0].__setitem__("lr", INF), ValueError, "learning rate"),
    ]
    # per-param scalar states (NovoGrad's grad norm, LAMB's norms): finite and within float32's range
    for name in [n for n, v in entry.items() if n != "step" and (not isinstance(v, torch.Tensor) or v.dim() == 0)]:
        for bad in (INF, 1.7e290, torch.tensor(-1e300, dtype=torch.float64)):
            out.append((f"{name} {bad!r}", lambda s, n=name, b=bad: s["state"][key].__setitem__(n, b), ValueError,
                        repr(name)))
    where = _where_step(sd)
    for bad, exc in [("three", TypeError), (-1, ValueError), (NAN, ValueError), (INF, ValueError),
                     (torch.tensor(-2.0), ValueError), (torch.tensor([1.0, 2.0]), TypeError)]:
        if where == "state":
            out.append((f"step {bad!r}", lambda s, b=bad: s["state"][key].__setitem__("step", b), exc, "'step'"))
        elif where == "group":
            out.append((f"group step {bad!r}", lambda s, b=bad: s["param_groups"][0].__setitem__("step", b), exc,
                        "'step'"))
    return [c for c in out if c is not None]


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=IDS)
def test_optimizer_load_rejects_corrupt_state_with_nothing_changed(cls, kw):
    opt, params = _trained(cls, kw)
    good = snapshot(opt)
    twin_opt, twin_params = _trained(cls, kw)  # what the optimizer must keep doing
    cases = _corruptions(good)
    assert len(cases) >= 10
    for name, mutate, exc, fragment in cases:
        bad = copy.deepcopy(good)
        mutate(bad)
        with pytest.raises(exc, match=fragment) as info:
            opt.load_state_dict(bad)
        assert type(opt).__name__ in str(info.value), name
        assert same_state(opt.state_dict(), good), name
    run(opt, params, 2, start=2)
    run(twin_opt, twin_params, 2, start=2)
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
    assert same_state(opt.state_dict(), twin_opt.state_dict())


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=IDS)
def test_optimizer_error_names_group_param_and_key(cls, kw):
    opt, _ = _trained(cls, kw)
    sd = snapshot(opt)
    key = sd["param_groups"][0]["params"][1]
    name = next(n for n, v in sd["state"][key].items() if isinstance(v, torch.Tensor) and v.shape == (5,))
    sd["state"][key][name] = torch.zeros(7)
    with pytest.raises(ValueError, match=rf"state of param 1 in param group 0, key '{name}': expected shape \(5,\)"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=IDS)
def test_optimizer_good_checkpoint_still_loads(cls, kw):
    opt, params = _trained(cls, kw, steps=3)
    sd = snapshot(opt)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = cls(fresh_params, **kw)
    fresh.load_state_dict(sd)
    run(opt, params, 1, start=3)
    run(fresh, fresh_params, 1, start=3)
    for p, q in zip(params, fresh_params):
        assert torch.equal(p, q)


def test_torch_checkpoint_with_steps_loads_into_nvidia_family():
    params = make_params()
    ref = torch.optim.Adam(params, lr=1e-2)
    run(ref, params, 2)
    import apex.optimizers as O
    opt = O.FusedAdam([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["step"] == 2


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=IDS)
def test_duplicate_params_rejected_at_construction(cls, kw):
    a, b = make_params()
    with pytest.raises(ValueError, match=r"param 2 of param group 0 is the same tensor as param 0"):
        cls([a, b, a], **kw)
    with pytest.raises(ValueError, match=r"more than one parameter group: param 0 of param group 1 is param 1 of "
                                         r"param group 0"):
        cls([{"params": [a, b]}, {"params": [b]}], **kw)
    opt = cls([a], **kw)
    with pytest.raises(ValueError, match=r"param 1 of param group 1 is param 0 of param group 0"):
        opt.add_param_group({"params": [b, a]})
    assert len(opt.param_groups) == 1  # nothing added
    opt.add_param_group({"params": [b]})
    run(opt, [a, b], 1)
    extra = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    opt.add_param_group({"params": extra[:2]})
    with pytest.raises(ValueError, match=r"param 1 of param group 3 is param 1 of param group 2"):
        opt.add_param_group({"params": [extra[2], extra[1]]})
    assert len(opt.param_groups) == 3


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=IDS)
@pytest.mark.parametrize("key", ["lr", "weight_decay"])
@pytest.mark.parametrize("value", [INF, -INF, NAN])
def test_non_finite_hyperparameters_rejected(cls, kw, key, value):
    a, b = make_params()
    if key not in cls([a], **kw).defaults:
        pytest.skip(f"{cls.__name__} has no {key}")
    with pytest.raises(ValueError, match="learning rate|lr" if key == "lr" else "weight_decay"):
        cls([a], **{**kw, key: value})
    opt = cls([a], **kw)
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [b], key: value})
    assert len(opt.param_groups) == 1


def test_duplicate_appended_after_construction_is_named_at_step():
    import apex.optimizers as O
    a, b = make_params()
    opt = O.NpuFusedAdam([a, b])
    opt.param_groups[0]["params"].append(a)
    feed([a, b], 0)
    with pytest.raises(ValueError, match=r"NpuFusedAdam: param 2 of a param group is the same tensor as its param 0"):
        opt.step()


def test_larc_rejects_duplicates_and_infinite_rates():
    a, b = make_params()
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch only warns
        dup = torch.optim.SGD([a, a], lr=0.1)
    with pytest.raises(ValueError, match="param 1 of param group 0 is the same tensor as param 0"):
        LARC(dup)
    with pytest.raises(ValueError, match="lr=inf"):
        LARC(torch.optim.SGD([a], lr=INF))
    larc = LARC(torch.optim.SGD([a], lr=0.1, weight_decay=1e-4))
    with pytest.raises(ValueError, match="param group 1 is param 0 of param group 0"):
        larc.add_param_group({"params": [a]})
    with pytest.raises(ValueError, match="weight_decay=inf"):
        larc.add_param_group({"params": [b], "weight_decay": INF})
    larc.add_param_group({"params": (t for t in [b])})  # a generator is read once, as torch reads it
    assert larc.param_groups[1]["params"] == [b]
    feed([a, b], 0)
    larc.step()
    assert all(math.isfinite(float(p.detach().sum())) for p in (a, b))


# ---------------------------------------------------------------- amp O3: state re-cast at initialize


@pytestmark_amp
@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adam(ps, lr=1e-2), lambda ps: __import__(
    "apex.optimizers", fromlist=["x"]).NpuFusedAdam(ps, lr=1e-2)], ids=["torch", "apex"])
def test_o3_recasts_optimizer_state_loaded_before_initialize(make):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    o = make(m.parameters())
    for _ in range(2):
        o.zero_grad()
        m(torch.randn(3, 4)).pow(2).mean().backward()
        o.step()
    sd = copy.deepcopy(o.state_dict())
    m2 = copy.deepcopy(m)
    o2 = make(m2.parameters())
    o2.load_state_dict(sd)
    amp.initialize(m2, o2, opt_level="O3", verbosity=0)
    low = next(m2.parameters()).dtype
    assert low in (torch.float16, torch.bfloat16)
    for i, p in enumerate(m2.parameters()):
        for name, v in o2.state[p].items():
            if name != "step":
                assert v.dtype == low, name
                torch.testing.assert_close(v.float(), sd["state"][i][name].to(low).float(), rtol=0, atol=0)
    o2.zero_grad()
    m2(torch.randn(3, 4, dtype=low)).float().pow(2).mean().backward()
    o2.step()
    assert all(torch.isfinite(p.float()).all() for p in m2.parameters())


def test_novograd_refuses_a_bad_norm_entry_before_counting_the_step():
    """FusedNovoGrad's ``exp_avg_sq`` is one norm per tensor: a param-shaped tensor set there is refused by name,
    and the group's step count stays where it was."""
    from apex.optimizers import FusedNovoGrad

    ps = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))]
    opt = FusedNovoGrad(ps, lr=0.1)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.state[ps[0]]["exp_avg_sq"] = torch.zeros(9)
    before = [p.detach().clone() for p in ps]
    with pytest.raises(TypeError, match="state 'exp_avg_sq' of param 0: expected a number or a 1-element"):
        opt.step()
    assert opt.param_groups[0]["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(ps, before))
    opt.state[ps[0]]["exp_avg_sq"] = torch.tensor(0.5)  # a norm of the right form is taken
    opt.step()
    assert opt.param_groups[0]["step"] == 2


def test_base_class_and_clip_function_name_what_they_need():
    from apex.optimizers import CombinedOptimizer, clip_optimizer_grad_norm_fused

    p = torch.nn.Parameter(torch.randn(2))
    with pytest.raises(TypeError, match="defaults must be a dict"):
        CombinedOptimizer([p], [])
    with pytest.raises(KeyError, match="needs an 'lr'"):
        CombinedOptimizer([p], {})
    with pytest.raises(TypeError, match="expected an apex optimizer"):
        clip_optimizer_grad_norm_fused([], 1.0)


# ---------------------------------------------------------------- state rewritten between steps


def _step_options(opt):
    """The options a group must keep (torch's behaviour options may be absent: their default applies)."""
    return [k for k in opt.defaults if k not in ("maximize", "capturable", "differentiable", "foreach", "fused")]


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=IDS)
def test_a_deleted_group_option_is_named_at_the_step_with_nothing_changed(cls, kw):
    opt, params = _trained(cls, kw)
    keys = _step_options(opt)
    assert "lr" in keys
    for key in keys:
        value = opt.param_groups[0].pop(key)
        good = snapshot(opt)
        values = [p.detach().clone() for p in params]
        feed(params, 7)
        with pytest.raises(KeyError, match=rf"{cls.__name__}: param group 0 has no '{key}'"):
            opt.step()
        assert same_state(opt.state_dict(), good), key
        assert all(torch.equal(p, v) for p, v in zip(params, values)), key
        opt.param_groups[0][key] = value
    twin_opt, twin_params = _trained(cls, kw)
    run(opt, params, 1, start=7)
    run(twin_opt, twin_params, 1, start=7)
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=IDS)
@pytest.mark.parametrize("bad", [5, None, [1.0]], ids=["int", "None", "list"])
def test_a_state_entry_that_is_not_a_dict_is_refused_at_the_step(cls, kw, bad):
    opt, params = _trained(cls, kw)
    good = snapshot(opt)
    values = [p.detach().clone() for p in params]
    saved = opt.state[params[1]]
    opt.state[params[1]] = bad
    feed(params, 7)
    with pytest.raises(TypeError, match=r"state of param 1\b.*dict.*got " + type(bad).__name__):
        opt.step()
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    opt.state[params[1]] = saved
    assert same_state(opt.state_dict(), good)
    run(opt, params, 1, start=7)


# ---------------------------------------------------------------- options rewritten between steps (check cache)
# A group whose options are plain values equal, type for type, to those of its last passed check is not checked
# again at the step; every rewrite below must still be seen at the next step, with nothing changed.
_REWRITES = [  # (option, the value of the checked steps or None to keep it, the rewrite, the error)
    ("lr", None, float("nan"), ValueError),
    ("lr", 1.0, True, TypeError),  # equal to the checked 1.0, but no number
    ("lr", None, -1.0, ValueError),
    ("weight_decay", None, "0.1", TypeError),
]


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=IDS)
@pytest.mark.parametrize("key,before,bad,exc", _REWRITES, ids=[f"{k}={v!r}" for k, _, v, _ in _REWRITES])
def test_an_option_rewritten_after_checked_steps_is_refused_at_the_next(cls, kw, key, before, bad, exc):
    opt, params = _trained(cls, kw)
    group = opt.param_groups[0]
    if key not in group:
        pytest.skip(f"{cls.__name__} has no {key!r}")
    if before is not None:
        group[key] = before
    run(opt, params, 2, start=5)  # checked steps: the group's options are the ones last passed
    good = snapshot(opt)
    values = [p.detach().clone() for p in params]
    saved = group[key]
    group[key] = bad
    feed(params, 7)
    with pytest.raises(exc):
        opt.step()
    group[key] = saved
    assert same_state(opt.state_dict(), good)
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    run(opt, params, 1, start=7)


def test_betas_changed_in_place_are_checked_again():
    from apex.optimizers import NpuFusedAdam

    params = make_params()
    opt = NpuFusedAdam(params, lr=1e-3, betas=[0.9, 0.999])
    run(opt, params, 2)
    opt.param_groups[0]["betas"][1] = 1.5  # the same list object, one value rewritten
    feed(params, 7)
    with pytest.raises(ValueError, match=r"beta parameter at index 1"):
        opt.step()


def test_an_optimizer_option_changed_after_checked_steps_is_checked_with_the_groups():
    """FusedAdam's decay rule is checked against each group's; flipping ``adam_w_mode`` on the optimizer makes
    every group be checked again, though the groups did not change."""
    from apex.optimizers import FusedAdam

    params = make_params()
    opt = FusedAdam(params, lr=1e-3, weight_decay=0.01, adam_w_mode=True)
    opt.param_groups[0]["decoupled_weight_decay"] = True  # a torch AdamW checkpoint's option, which agrees
    run(opt, params, 2)
    opt.adam_w_mode = False
    feed(params, 7)
    with pytest.raises(ValueError, match=r"adam_w_mode=False"):
        opt.step()


def test_unchanged_groups_are_not_checked_again(monkeypatch):
    """One group per param: after a step has checked them, a group is checked again only when its options
    change (a scheduler's new lr), or when an option is a tensor (it can change in place)."""
    from apex.optimizers import NpuFusedAdamW

    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(6)]
    opt = NpuFusedAdamW([{"params": [p]} for p in params], lr=1e-3)
    checked = []
    real = type(opt)._validate_group
    monkeypatch.setattr(type(opt), "_validate_group", lambda self, g: checked.append(g["lr"]) or real(self, g))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert len(checked) == 6
    checked.clear()
    opt.step()
    assert checked == []
    opt.param_groups[2]["lr"] = 5e-4
    opt.param_groups[4]["lr"] = torch.tensor(1e-4)
    opt.step()
    opt.step()
    assert len(checked) == 3 and checked[0] == 5e-4  # group 2 once, group 4 at both steps
