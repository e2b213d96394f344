"""What a step checks of things user code may change after construction, for every combined optimizer class.

* hyperparameters rewritten in ``param_groups`` (a scheduler bug, ``group["lr"] = None``): the step raises the
  construction-time error, naming the group, before any param, state or step count moves;
* inference tensors (made under ``torch.inference_mode()``) are refused as params at construction;
* optimizers whose update reads grad values on the host (per-tensor or global norms) refuse a meta-device group
  before updating the other groups.
"""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
from _optim_harness import assert_unchanged, snapshot

import apex.optimizers as ao

CLASSES = sorted(
    (c for c in vars(ao).values()
     if inspect.isclass(c) and issubclass(c, ao.CombinedOptimizer) and c is not ao.CombinedOptimizer),
    key=lambda c: c.__name__,
)
IDS = [c.__name__ for c in CLASSES]


def _two_groups(cls, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((5,), (3, 2), (4,))]
    opt = cls([{"params": ps[:2]}, {"params": ps[2:]}], lr=1e-2)
    return ps, opt, gen


def _grads(ps, gen):
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("key,bad,error", [
    ("lr", None, TypeError),
    ("lr", "0.1", TypeError),
    ("lr", (0.1,), TypeError),
    ("lr", float("nan"), ValueError),
    ("lr", -1.0, ValueError),
    ("weight_decay", "x", TypeError),
])
@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_hyperparameter_rewritten_after_construction_fails_the_step_before_any_change(cls, key, bad, error):
    ps, opt, gen = _two_groups(cls)
    _grads(ps, gen)
    opt.step()  # states and step counts exist
    good = opt.param_groups[1][key]
    opt.param_groups[1][key] = bad
    _grads(ps, gen)
    snap = snapshot(opt, ps)
    with pytest.raises(error, match=f"{cls.__name__}: param group 1: "):
        opt.step()
    opt.param_groups[1][key] = bad  # snapshot() saw the bad value too: compare like with like
    assert_unchanged(opt, ps, snap)
    opt.param_groups[1][key] = good
    opt.step()  # and the optimizer goes on


@pytest.mark.parametrize("cls,key", [(ao.FusedAdam, "bias_correction"), (ao.FusedLAMB, "grad_averaging"),
                                     (ao.FusedNovoGrad, "init_zero"), (ao.NpuFusedSGD, "nesterov"),
                                     (ao.NpuFusedRMSprop, "centered"), (ao.NpuFusedAdam, "amsgrad")],
                         ids=lambda v: getattr(v, "__name__", v))
def test_a_flag_without_a_truth_value_is_refused_at_construction(cls, key):
    """A multi-element tensor as a boolean option would fail the update halfway: TypeError naming the option, at
    construction and at add_param_group."""
    bad = torch.tensor([1.0, 1.0])
    with pytest.raises(TypeError, match=f"Invalid {key}: expected a bool"):
        cls([torch.nn.Parameter(torch.zeros(2))], lr=1e-2, **{key: bad})
    opt = cls([torch.nn.Parameter(torch.zeros(2))], lr=1e-2)
    with pytest.raises(TypeError, match=f"param group 1: Invalid {key}"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], key: bad})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_inference_tensors_are_refused_as_params(cls):
    with torch.inference_mode():
        w = torch.zeros(4)
    with pytest.raises(TypeError, match="param 1: it is an inference tensor"):
        cls([torch.nn.Parameter(torch.zeros(2)), w], lr=1e-2)
    _, opt, _ = _two_groups(cls)
    with pytest.raises(TypeError, match="inference tensor"):
        opt.add_param_group({"params": [w]})
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("cls", [c for c in CLASSES if c._reads_values], ids=[c.__name__ for c in CLASSES
                                                                            if c._reads_values])
def test_meta_group_of_an_optimizer_reading_grad_values_fails_before_any_update(cls):
    ps, opt, gen = _two_groups(cls)
    _grads(ps, gen)
    opt.step()
    m = torch.nn.Parameter(torch.ones(2, device="meta"))
    m.grad = torch.ones(2, device="meta")
    opt.add_param_group({"params": [m]})
    _grads(ps, gen)
    values = [p.detach().clone() for p in ps]
    states = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in ps]
    steps = [torch.as_tensor(g.get("step", 0)).clone() for g in opt.param_groups[:2]]
    with pytest.raises(RuntimeError, match="param group 2 is on the meta device"):
        opt.step()
    assert all(torch.equal(p, v) for p, v in zip(ps, values))
    for p, before in zip(ps, states):
        assert all(torch.equal(opt.state[p][k], v) if torch.is_tensor(v) else opt.state[p][k] == v
                   for k, v in before.items())
    assert all(torch.equal(torch.as_tensor(g.get("step", 0)), s) for g, s in zip(opt.param_groups[:2], steps))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("cls", CLASSES, ids=IDS)
def test_copies_keep_the_options_and_train_on_like_the_original(cls, how):
    """torch's ``Optimizer.__getstate__`` keeps defaults, state and param groups only; NVIDIA's classes keep
    constructor options as attributes (``adam_w_mode``, ``set_grad_none``, ...). A deep copy or a pickle round
    trip of (params, optimizer) keeps them and the executor choice, and the copy's steps equal the original's."""
    ps, opt, gen = _two_groups(cls, seed=3)
    opt.executor = "torch"
    _grads(ps, gen)
    opt.step()
    dup = copy.deepcopy if how == "deepcopy" else (lambda obj: pickle.loads(pickle.dumps(obj)))
    ps2, opt2 = dup((ps, opt))
    options = {k: v for k, v in vars(opt).items() if isinstance(v, (bool, int, float, str, torch.dtype))}
    assert opt2.executor == "torch"
    for key in ("adam_w_mode", "set_grad_none", "capturable", "use_nvlamb", "moment_mode", "wd_after_momentum",
                "adagrad_w_mode", "reduced_precision_dtype"):
        if key in options:
            assert getattr(opt2, key) == options[key], key
    for _ in range(2):
        g = [torch.randn(p.shape, generator=gen) for p in ps]
        for p, q, x in zip(ps, ps2, g):
            p.grad, q.grad = x.clone(), x.clone()
        opt.step()
        opt2.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, ps2))


# ---------------------------------------------------------------- more of what user code rewrites between steps
@pytest.mark.parametrize("cls", [ao.FusedNovoGrad, ao.NpuFusedBertAdam, ao.NpuFusedAdam], ids=lambda c: c.__name__)
def test_an_int_beyond_int64_is_refused_before_anything_moves(cls):
    """torch's ops take Python ints as int64: a larger int option would fail halfway through the update."""
    ps, opt, gen = _two_groups(cls)
    _grads(ps, gen)
    opt.step()
    key = "max_grad_norm" if cls is ao.NpuFusedBertAdam else "eps"
    opt.param_groups[1][key] = 2**200 if key == "max_grad_norm" else 2**64
    _grads(ps, gen)
    snap = snapshot(opt, ps)
    with pytest.raises(ValueError, match=r"param group 1: Invalid .*an int must fit in int64"):
        opt.step()
    assert_unchanged(opt, ps, snap)
    with pytest.raises(ValueError, match="an int must fit in int64"):
        cls(ps, lr=1e-2, **{key: 2**64})


@pytest.mark.parametrize("cls", [ao.FusedAdam, ao.FusedLAMB, ao.FusedNovoGrad, ao.FusedMixedPrecisionLamb],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("bad, error, match", [
    (-1, ValueError, "expected a finite step count >= 0"),
    (float("nan"), ValueError, "expected a finite step count >= 0"),
    ("x", TypeError, "expected a number"),
    (torch.tensor([True]), TypeError, "expected a number or a 1-element real tensor"),
], ids=["negative", "nan", "str", "bool-tensor"])
def test_nvidia_group_step_rewritten_to_a_non_count_is_refused(cls, bad, error, match):
    ps, opt, gen = _two_groups(cls)
    _grads(ps, gen)
    opt.step()
    opt.param_groups[1]["step"] = bad
    _grads(ps, gen)
    snap = snapshot(opt, ps)
    with pytest.raises(error, match=rf"{cls.__name__}: param group 1: 'step': {match}"):
        opt.step()
    assert_unchanged(opt, ps, snap)


@pytest.mark.parametrize("cls", [ao.FusedLAMB, ao.FusedMixedPrecisionLamb], ids=lambda c: c.__name__)
def test_lamb_with_a_global_norm_steps_without_any_grad(cls):
    """No grad anywhere (a new optimizer, or one restored from a pickle or a checkpoint): the global norm is 0,
    nothing is updated, and the group step counts on, as upstream's."""
    ps, opt, gen = _two_groups(cls)
    before = [p.detach().clone() for p in ps]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ps))
    _grads(ps, gen)
    pickle.loads(pickle.dumps(opt)).step()  # the copy's params have no grads


def test_add_param_group_names_what_is_missing():
    _, opt, _ = _two_groups(ao.NpuFusedAdam)
    with pytest.raises(KeyError, match="param_group must have a 'params' entry"):
        opt.add_param_group({"lr": 0.1})
    for bad in (None, 5):
        with pytest.raises(TypeError, match=r"param_group\['params'\] must be a tensor or an iterable of tensors"):
            opt.add_param_group({"params": bad})
    assert len(opt.param_groups) == 2


def test_load_state_dict_takes_param_groups_as_a_tuple():
    ps, opt, gen = _two_groups(ao.NpuFusedAdam)
    _grads(ps, gen)
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"] = tuple(sd["param_groups"])  # torch accepts a tuple
    _, opt2, _ = _two_groups(ao.NpuFusedAdam, seed=1)
    opt2.load_state_dict(sd)
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


@pytest.mark.parametrize("bad", ["lr='abc'", "lr=None", "eps=None", "betas='ab'", "state", "expanded", "step=-1",
                                 "step='x'"])
def test_reference_lamb_checks_what_user_code_rewrote_before_any_update(bad):
    """apex.optimizers.Lamb (torch ops, no combining) re-checks its groups, states and params at every step."""
    ps, opt, gen = _two_groups(ao.Lamb)
    _grads(ps, gen)
    opt.step()
    if bad == "state":
        opt.state[ps[0]]["exp_avg"] = torch.zeros(7)
    elif bad.startswith("step="):
        opt.state[ps[1]]["step"] = eval(bad[5:])
    elif bad == "expanded":
        ps[2].data = torch.randn(1).expand(4)
    else:
        key, value = bad.split("=")
        opt.param_groups[0][key] = eval(value)
    snap = snapshot(opt, ps)
    with pytest.raises((TypeError, ValueError, RuntimeError), match="Lamb: "):
        opt.step()
    assert_unchanged(opt, ps, snap)


def test_step_names_a_closure_that_is_not_callable():
    _, opt, _ = _two_groups(ao.NpuFusedAdam)
    with pytest.raises(TypeError, match="the closure must be a callable"):
        opt.step(5)


@pytest.mark.parametrize("key", ["decoupled_decay", "lr_in_momentum"])
def test_rmsprop_tf_flags_without_a_truth_value_are_refused_at_construction(key):
    with pytest.raises(TypeError, match=f"Invalid {key}: expected a bool"):
        ao.NpuFusedRMSpropTF([torch.nn.Parameter(torch.randn(3))], **{key: torch.ones(2)})
