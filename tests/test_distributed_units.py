"""apex.parallel pieces that need no process group: bucket planning, argument checks, clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from apex import amp
from apex.parallel import DistributedDataParallel, Reducer, default_backend
from apex.parallel.reducer import BucketedAllReduce, combine_ddp_bucket_elems, plan_buckets

M = 2**20


@pytest.mark.parametrize("numel,replicas,size,expect", [
    (25 * M, 4, 4, 25 * M // 4),      # numel / ddp_replica_count
    (400 * M, 4, 4, 24 * M),          # capped at 24M 4-byte elements
    (400 * M, 4, 2, 48 * M),          # 48M for 2-byte elements
    (3 * M, 4, 4, M),                 # at least 1M
    (10, 4, 4, M),
    (10 * M + 1, 10, 4, M + 1),       # rounded up, so numel / replicas buckets cover the buffer
])
def test_combine_ddp_bucket_size(numel, replicas, size, expect):
    assert combine_ddp_bucket_elems(numel, replicas, size) == expect


def test_plan_buckets_maps_slots_to_overlapping_ranges():
    ranges, slots = plan_buckets(100, [(0, 30), (32, 40), (96, 4), (80, 0)], 32)
    assert ranges == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert slots == [[0], [1, 2], [3], []]
    with pytest.raises(ValueError, match="bucket size must be >= 1"):
        plan_buckets(10, [], 0)


def test_bucketed_allreduce_order_must_be_a_permutation():
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="permutation"):
        BucketedAllReduce([[t], [t]], [[0], [1]], [0, 0])


def test_default_backend():
    assert default_backend("cpu") == "gloo"
    assert default_backend("cuda:1") == "nccl"
    assert default_backend("npu:0") == "hccl"
    assert default_backend(torch.device("cpu")) == "gloo"
    with pytest.raises(ValueError):
        default_backend("tpu")


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="needs no default process group")
def test_clear_errors_without_a_process_group():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="needs an initialized default process group"):
        DistributedDataParallel(model)
    with pytest.raises(RuntimeError, match="needs an initialized default process group"):
        Reducer(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"amp.initialize\(combine_ddp=True\) needs an initialized"):
        amp.initialize(model, opt, opt_level="O1", combine_grad=True, combine_ddp=True, verbosity=0)
    assert not hasattr(opt, "_amp_stash")  # nothing was changed
    assert model.weight.dtype == torch.float32 and "forward" not in model.__dict__


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(shared_param=True), ValueError, "shared_param is no longer an option"),
    (dict(message_size=0), ValueError, r"message_size \(elements\) must be >= 1, got 0"),
    (dict(message_size=2.5), TypeError, r"message_size \(elements\) must be an int, got 2.5"),
    (dict(num_allreduce_streams=0), ValueError, "num_allreduce_streams must be >= 1, got 0"),
    (dict(num_allreduce_streams=True), TypeError, "num_allreduce_streams must be an int, got True"),
    (dict(gradient_predivide_factor=0.0), ValueError, "gradient_predivide_factor must be a positive number"),
])
def test_ddp_argument_checks(kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedDataParallel(torch.nn.Linear(2, 2), **kwargs)


def test_ddp_rejects_non_modules():
    with pytest.raises(TypeError, match=r"expects a torch\.nn\.Module, got int"):
        DistributedDataParallel(3)
    with pytest.raises(TypeError, match=r"Reducer expects a torch\.nn\.Module or an iterable"):
        Reducer(3)


_SHUTDOWN_SCRIPT = r"""
import gc, sys, datetime
import torch
import torch.distributed as dist
import {module}  # before any process group, as a training script does
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
pg = dist.group.WORLD
torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])  # torch imports torch._dynamo here
held = [f.__name__ for f in vars(sys.modules["torch.distributed.nn.functional"]).values()
        if callable(f) and any(d is pg for d in (getattr(f, "__defaults__", None) or ()))]
dist.destroy_process_group()
gc.collect()
print(len(held), sys.getrefcount(pg) - 1)
"""


@pytest.mark.parametrize("module", ["apex.amp", "apex.optimizers", "apex.parallel"])
def test_importing_apex_first_lets_destroy_process_group_release_the_group(module, tmp_path):
    """torch.distributed.nn.functional binds the default group into its defaults when first imported after
    init_process_group; apex imports it before, so the last reference to the group goes with
    destroy_process_group (gloo's worker threads must not outlive the interpreter's shutdown)."""
    out = subprocess.run([sys.executable, "-c", _SHUTDOWN_SCRIPT.format(module=module), str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    held, refs = map(int, out.stdout.split()[-2:])
    assert held == 0, f"{held} torch.distributed.nn functions hold the default group in their defaults"
    assert refs == 1, f"the group is still referenced {refs - 1} more time(s) after destroy_process_group"


def test_distributed_nn_import_is_skipped_once_a_group_exists(monkeypatch):
    """After init_process_group, importing torch.distributed.nn would itself hold the group: apex does not."""
    from apex import _torch_workarounds

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert _torch_workarounds.import_distributed_nn_first() is False


@pytest.mark.parametrize("bad,exc,match", [
    (-1, ValueError, "group_size must be >= 0, got -1"),
    ("2", TypeError, "group_size must be an int, got '2'"),
    (2.0, TypeError, "group_size must be an int, got 2.0"),
    (True, TypeError, "group_size must be an int, got True"),
])
def test_create_syncbn_process_group_argument_checks(bad, exc, match):
    """The size is checked before any collective call, so a wrong one fails the same on every rank."""
    from apex.parallel import create_syncbn_process_group

    with pytest.raises(exc, match=f"create_syncbn_process_group: {match}"):
        create_syncbn_process_group(bad)
    assert create_syncbn_process_group(0) is None


def test_flat_dist_call_names_an_entry_that_is_not_a_tensor():
    """Checked before the process group is looked up, so no collective starts on a bad list."""
    from apex.parallel import flat_dist_call

    with pytest.raises(TypeError, match=r"tensors\[1\] must be a tensor, got list"):
        flat_dist_call([torch.ones(2), [1]], dist.all_reduce)


# ---------------------------------------------------------------- wrong arguments: refused before any collective

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
                "new_group")


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A default group of one rank (so a misplaced check would reach a collective) and the list of the collective
    calls made through torch.distributed while the test runs."""
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    if dist.is_initialized():
        pytest.skip("needs to own the default process group")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    calls = []
    for name in _COLLECTIVES:
        real = getattr(dist, name)

        def record(*args, _name=name, _real=real, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, record)
    try:
        yield calls
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def _model_state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _untouched(model, before):
    """Same values, no grads and no hooks left on the parameters."""
    after = model.state_dict()
    return (before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
            and all(p.grad is None and not getattr(p, "_post_accumulate_grad_hooks", None)
                    for p in model.parameters()))


_FLOAT32_NORMAL_LOW = 2.0 ** -126


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(process_group="x"), TypeError,
     r"DistributedDataParallel: process_group must be a torch\.distributed process group \(or None for the "
     r"default group\), got 'x' \(str\)"),
    (dict(process_group=0), TypeError, r"process_group must be a torch\.distributed process group .*got 0 \(int\)"),
    (dict(allreduce_communicators=3), TypeError,
     r"allreduce_communicators must be a list or tuple of torch\.distributed process groups \(or None\), got 3"),
    (dict(num_allreduce_streams=2, allreduce_communicators=["a", "b"]), TypeError,
     r"allreduce_communicators\[0\] must be a torch\.distributed process group .*got 'a' \(str\)"),
    (dict(num_allreduce_streams=2, allreduce_communicators=[None, None]), TypeError,
     r"allreduce_communicators\[0\] must be a torch\.distributed process group, got None"),
    (dict(allreduce_trigger_params=torch.ones(2)), TypeError, "must be a list of parameters, got one tensor"),
    (dict(allreduce_trigger_params=5), TypeError, "must be a list of parameters, got int"),
    (dict(allreduce_trigger_params=[1.0]), TypeError, r"allreduce_trigger_params\[0\] must be a parameter"),
    (dict(allreduce_trigger_params=[]), ValueError, "must name at least one parameter"),
    (dict(gradient_predivide_factor=float("inf")), ValueError,
     r"gradient_predivide_factor must be a positive number that, like its reciprocal, is a normal float32 "
     r"\(in \[1\.17549e-38, 8\.50706e\+37\]\), got inf"),
    (dict(gradient_predivide_factor=1e39), ValueError, "normal float32 .*got 1e\\+39"),
    (dict(gradient_predivide_factor=1e-300), ValueError, "normal float32 .*got 1e-300"),
    (dict(gradient_predivide_factor=2.0 ** 127), ValueError, "normal float32"),  # its reciprocal is subnormal
    (dict(gradient_predivide_factor=float("nan")), ValueError, "normal float32 .*got nan"),
    (dict(gradient_predivide_factor=-2.0), ValueError, "normal float32 .*got -2.0"),
    (dict(gradient_predivide_factor=10**400), ValueError, "normal float32"),
    (dict(gradient_predivide_factor="2"), TypeError, r"gradient_predivide_factor must be a positive number, got '2'"),
    (dict(gradient_predivide_factor=True), TypeError, r"must be a positive number, got True \(bool\)"),
    (dict(delay_allreduce="no"), TypeError, r"DistributedDataParallel: delay_allreduce must be True or False, "
                                            r"got 'no' \(str\)"),
    (dict(gradient_average="no"), TypeError, r"gradient_average must be True or False, got 'no'"),
    (dict(gradient_average=None), TypeError, r"gradient_average must be True or False, got None"),
    (dict(allreduce_always_fp32="False"), TypeError, r"allreduce_always_fp32 must be True or False, got 'False'"),
    (dict(retain_allreduce_buffers=[True]), TypeError, r"retain_allreduce_buffers must be True or False"),
    (dict(prof="yes"), TypeError, r"prof must be True or False"),
    (dict(delay_allreduce=2), ValueError, r"delay_allreduce must be True or False \(or 0/1\), got 2"),
    (dict(gradient_average=1.0), TypeError, r"gradient_average must be True or False, got 1\.0 \(float\)"),
])
def test_ddp_refuses_wrong_arguments_before_any_collective(one_rank, kwargs, error, match):
    model = torch.nn.Linear(2, 2)
    before = _model_state(model)
    with pytest.raises(error, match=match):
        DistributedDataParallel(model, **kwargs)
    assert one_rank == []
    assert _untouched(model, before)


def test_ddp_names_the_deprecated_factor_it_was_given(one_rank):
    model = torch.nn.Linear(2, 2)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="gradient_average_split_factor must be"):
        DistributedDataParallel(model, gradient_average_split_factor=float("inf"))
    assert one_rank == []


def test_ddp_communicators_must_match_the_stream_count(one_rank):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="allreduce_communicators has 1 groups, num_allreduce_streams is 2"):
        DistributedDataParallel(model, num_allreduce_streams=2, allreduce_communicators=[dist.group.WORLD])
    assert one_rank == []


def test_ddp_takes_bools_as_upstream_scripts_pass_them(one_rank):
    np = pytest.importorskip("numpy")
    model = torch.nn.Linear(2, 2)
    ddp = DistributedDataParallel(model, delay_allreduce=1, gradient_average=np.bool_(True), prof=0,
                                  allreduce_always_fp32=np.bool_(False), retain_allreduce_buffers=True,
                                  gradient_predivide_factor=_FLOAT32_NORMAL_LOW)
    assert (ddp.delay_allreduce, ddp.gradient_average, ddp.prof, ddp.allreduce_always_fp32) == (True, True, False,
                                                                                                 False)
    assert all(type(v) is bool for v in (ddp.delay_allreduce, ddp.gradient_average, ddp.prof,
                                         ddp.allreduce_always_fp32, ddp.retain_allreduce_buffers))
    assert "all_reduce" in one_rank  # the recorder sees what a construction does (the layout check)
    ddp = DistributedDataParallel(torch.nn.Linear(2, 2), gradient_predivide_factor=2.0 ** 126,
                                  num_allreduce_streams=1, allreduce_communicators=(dist.group.WORLD,))
    assert ddp.gradient_predivide_factor == 2.0 ** 126
    ddp(torch.ones(3, 2)).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in ddp.module.parameters())


@pytest.mark.parametrize("args,error,match", [
    ((torch.nn.Linear(2, 2),), TypeError, r"apex\.parallel\.Reducer: process_group must be a torch\.distributed "
                                          r"process group \(or None for the default group\), got 'x' \(str\)"),
    (([torch.ones(2)],), TypeError, r"Reducer: process_group must be a torch\.distributed process group"),
])
def test_reducer_refuses_a_process_group_that_is_not_one(one_rank, args, error, match):
    with pytest.raises(error, match=match):
        Reducer(*args, process_group="x")
    assert one_rank == []
