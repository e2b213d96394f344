"""apex.parallel.SyncBatchNorm / convert_syncbn_model.

Distributed (gloo, spawned ranks with uneven local batches): outputs, input
grads, weight/bias grads (summed over ranks) and running stats equal
torch.nn.BatchNorm on the whole batch in float64. float64 inputs agree to
rounding (1e-10); float32 inputs to fp32 accuracy of a normalisation (rtol 1e-4,
atol 1e-5: the statistics are formed in float64 from float32 moments).
Single-process: without a process group it is exactly torch's batch norm.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _dist_harness import get_pool, run

from apex.parallel import SyncBatchNorm, convert_syncbn_model

TOL = {"float64": dict(rtol=1e-10, atol=1e-10), "float32": dict(rtol=1e-4, atol=1e-5)}


def _check(res, dtype, affine=True):
    tol = TOL[dtype]
    for r in res:
        for step in (0, 1):
            s = r[step]
            torch.testing.assert_close(s["y"], s["y_ref"], **tol)
            torch.testing.assert_close(s["gx"], s["gx_ref"], **tol)
            if affine:
                torch.testing.assert_close(s["gw"], s["gw_ref"], **tol)
                torch.testing.assert_close(s["gb"], s["gb_ref"], **tol)
        rm, rv, rm_ref, rv_ref, n, n_ref = r["running"]
        torch.testing.assert_close(rm, rm_ref, **tol)
        torch.testing.assert_close(rv, rv_ref, **tol)
        assert n == n_ref == 2
        torch.testing.assert_close(r["eval"][0], r["eval"][1], **tol)


@pytest.mark.parametrize("world,dtype,kwargs", [
    (2, "float64", {}),
    (2, "float32", dict(channel_last=True)),
    (2, "float32", dict(dims=2, momentum=None)),
    (3, "float32", {}),
    (2, "float64", dict(sizes=[0, 4], dims=3)),  # an empty local batch (its backward too)
    (2, "float64", dict(sizes=[0, 5], channel_last=True)),
    (2, "float64", dict(offset=1e5)),  # a mean large against the spread: no cancellation in the variance
    pytest.param(2, "float64", dict(affine=False, dims=3), marks=pytest.mark.full),
    pytest.param(3, "float64", dict(channel_last=True, dims=3), marks=pytest.mark.full),
])
def test_syncbn_equals_whole_batch_batchnorm(world, dtype, kwargs):
    res = run(world, "syncbn", dtype=dtype, **kwargs)
    _check(res, dtype, affine=kwargs.get("affine", True))


@pytest.mark.parametrize("channel_last", [False, True])
def test_synchronized_output_takes_an_inplace_relu(channel_last):
    for r in run(2, "syncbn_inplace_relu", channel_last=channel_last):
        assert r == {"same_y": True, "same_grad": True, "positive": True, "grad_nonzero": True}


@pytest.mark.parametrize("bad", [3, None, [torch.nn.BatchNorm1d(2)]])
def test_convert_syncbn_model_needs_a_module(bad):
    with pytest.raises(TypeError, match=r"expected an nn\.Module"):
        convert_syncbn_model(bad)


def test_without_process_group_is_torch_batchnorm():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3)
    sync = convert_syncbn_model(torch.nn.Sequential(bn))[0]
    assert isinstance(sync, SyncBatchNorm) and isinstance(sync, torch.nn.modules.batchnorm._BatchNorm)
    assert not isinstance(sync, torch.nn.SyncBatchNorm)  # torch's DDP refuses its own class on CPU
    ref = torch.nn.BatchNorm2d(3)
    x = torch.randn(4, 3, 5, 5, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    y, yr = sync(x), ref(xr)
    y.square().sum().backward()
    yr.square().sum().backward()
    torch.testing.assert_close(y, yr, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)
    torch.testing.assert_close(sync.running_var, ref.running_var, rtol=0, atol=0)


def test_convert_keeps_params_buffers_and_mode():
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.BatchNorm2d(4, momentum=0.3, eps=1e-3),
                                torch.nn.Sequential(torch.nn.BatchNorm1d(4, affine=False)))
    model[1].running_mean.fill_(0.5)
    model[1].weight.requires_grad_(False)
    model.eval()
    weight = model[1].weight
    out = convert_syncbn_model(model, channel_last=True)
    assert out is model
    bn = out[1]
    assert isinstance(bn, SyncBatchNorm) and bn.channel_last and not bn.training
    assert bn.weight is weight and not bn.weight.requires_grad  # the same Parameter: optimizers keep working
    assert bn.eps == 1e-3 and bn.momentum == 0.3 and torch.all(bn.running_mean == 0.5)
    inner = out[2][0]
    assert isinstance(inner, SyncBatchNorm) and inner.weight is None and inner.num_features == 4
    # a bare batch norm is replaced and returned
    assert isinstance(convert_syncbn_model(torch.nn.BatchNorm3d(2)), SyncBatchNorm)


def test_channel_last_fuse_relu_and_z_without_group():
    torch.manual_seed(0)
    bn = SyncBatchNorm(3, channel_last=True, fuse_relu=True)
    ref = torch.nn.BatchNorm2d(3)
    x = torch.randn(2, 4, 4, 3)
    z = torch.randn(2, 4, 4, 3)
    expect = torch.relu(ref(x.movedim(-1, 1)).movedim(1, -1) + z)
    torch.testing.assert_close(bn(x, z), expect)


def test_bad_inputs():
    bn = SyncBatchNorm(3)
    with pytest.raises(ValueError, match="expected at least 2D input"):
        bn(torch.randn(3))
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(3\) got an input with 4 channels"):
        bn(torch.randn(2, 4, 5))


def test_torch_ddp_trains_a_converted_model_like_whole_batch_batchnorm():
    """2 gloo ranks, torch's DistributedDataParallel over convert_syncbn_model: outputs, trained params and running
    stats after 3 SGD steps equal one process with BatchNorm over the concatenated batch (float64)."""
    res = run(2, "syncbn_torch_ddp")
    tol = TOL["float64"]
    for r in res:
        for y, y_ref in r["outs"]:
            torch.testing.assert_close(y, y_ref, **tol)
        for p, p_ref in r["params"]:
            torch.testing.assert_close(p, p_ref, **tol)
        rm, rv, rm_ref, rv_ref = r["running"]
        torch.testing.assert_close(rm, rm_ref, **tol)
        torch.testing.assert_close(rv, rv_ref, **tol)
    for (p0, _), (p1, _) in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(p0, p1)


def test_state_dict_matches_torch_batchnorm():
    sync = convert_syncbn_model(torch.nn.BatchNorm2d(3))
    assert set(sync.state_dict()) == set(torch.nn.BatchNorm2d(3).state_dict())
    torch.nn.BatchNorm2d(3).load_state_dict(sync.state_dict())


def test_a_process_group_of_the_wrong_type_is_refused_at_construction():
    from apex.parallel import SyncBatchNorm

    with pytest.raises(TypeError, match=r"process_group must be a torch\.distributed process group"):
        SyncBatchNorm(4, process_group="x")


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(process_group=3), TypeError, r"SyncBatchNorm: process_group must be a torch\.distributed process group "
                                       r"\(or None for the default group\), got 3 \(int\)"),
    (dict(channel_last="no"), TypeError, r"SyncBatchNorm: channel_last must be True or False, got 'no' \(str\)"),
    (dict(fuse_relu="yes"), TypeError, r"SyncBatchNorm: fuse_relu must be True or False, got 'yes'"),
    (dict(affine="False"), TypeError, r"SyncBatchNorm: affine must be True or False, got 'False'"),
    (dict(track_running_stats=None), TypeError, r"SyncBatchNorm: track_running_stats must be True or False"),
    (dict(fuse_relu=2), ValueError, r"SyncBatchNorm: fuse_relu must be True or False \(or 0/1\), got 2"),
])
def test_wrong_options_are_refused_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        SyncBatchNorm(4, **kwargs)


def test_flags_take_upstreams_spellings():
    np = pytest.importorskip("numpy")
    bn = SyncBatchNorm(4, affine=0, track_running_stats=np.bool_(True), channel_last=1, fuse_relu=False)
    assert (bn.affine, bn.track_running_stats, bn.channel_last, bn.fuse_relu) == (False, True, True, False)
    assert all(type(v) is bool for v in (bn.affine, bn.track_running_stats, bn.channel_last, bn.fuse_relu))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(channel_last="yes"), TypeError, r"convert_syncbn_model: channel_last must be True or False"),
    (dict(process_group="x"), TypeError, r"convert_syncbn_model: process_group must be a torch\.distributed"),
])
def test_convert_refuses_wrong_options_before_replacing_anything(kwargs, error, match):
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(2), torch.nn.Sequential(torch.nn.BatchNorm1d(3)))
    with pytest.raises(error, match=match):
        convert_syncbn_model(model, **kwargs)
    assert type(model[0]) is torch.nn.BatchNorm2d and type(model[1][0]) is torch.nn.BatchNorm1d


# ---------------------------------------------------------------- num_features that differs across ranks
# (scenarios run on every rank of a spawned pool, which imports this module by name)

HERE = "test_sync_batchnorm"


def _bn_state(bn):
    return {k: v.clone() for k, v in bn.state_dict().items()}


def num_features_differ(rank, world):
    """The last rank builds SyncBatchNorm(4), the others SyncBatchNorm(3): every rank must raise (gloo would
    terminate the process on statistics of different sizes), with the module unchanged and the group usable."""
    c = 4 if rank == world - 1 else 3
    bn = SyncBatchNorm(c)
    before = _bn_state(bn)
    x = torch.randn(4, c, 2, requires_grad=True)
    try:
        bn(x)
        msg = None
    except RuntimeError as exc:
        msg = str(exc)
    after = bn.state_dict()
    untouched = all(torch.equal(before[k], after[k]) for k in before) and x.grad is None
    # the ranks are still in step: one more collective completes everywhere
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    # a matching module still synchronizes, after one agreement on its first forward only
    bn = SyncBatchNorm(3)
    calls = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_gather_object")}
    try:
        for name, fn in real.items():
            setattr(dist, name, lambda *a, _n=name, _f=fn, **k: (calls.append(_n), _f(*a, **k))[1])
        y1 = bn(torch.full((2, 3), float(rank)))
        first = list(calls)
        del calls[:]
        bn(torch.full((2, 3), float(rank)))
        second = list(calls)
        copied = copy.deepcopy(bn)  # a copy may meet ranks that never agreed with it: it agrees again
        del calls[:]
        copied(torch.full((2, 3), float(rank)))
        third = list(calls)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return {"msg": msg, "untouched": untouched, "sum": t.item(), "mean": bn.running_mean.clone(),
            "y1": y1.detach(), "calls": (first, second, third)}


def test_num_features_that_differ_across_ranks_raise_on_every_rank():
    res = get_pool(2).run(HERE, "num_features_differ")
    for rank, r in enumerate(res):
        assert r["msg"] is not None, f"rank {rank} raised nothing"
        assert ("apex.parallel.SyncBatchNorm: num_features differs across the ranks of the process group: "
                "3 on rank 0, 4 on rank 1") in r["msg"], r["msg"]
        assert r["untouched"], f"rank {rank}: the failed forward changed the module"
        assert r["sum"] == 3.0
        # the batch is [0, 0, 1, 1] per channel: mean 0.5 over both ranks, so each rank's output is -1 or +1
        torch.testing.assert_close(r["y1"], torch.full((2, 3), -1.0 if rank == 0 else 1.0), rtol=0, atol=1e-4)
        torch.testing.assert_close(r["mean"], torch.full((3,), 0.05 + 0.045))
        first, second, third = r["calls"]
        assert first == ["all_reduce", "all_gather"]  # the agreement, then the statistics
        assert second == ["all_gather"]  # agreed once per module: the statistics only
        assert third == ["all_reduce", "all_gather"]
