"""apex.parallel.SyncBatchNorm / convert_syncbn_model.

Distributed (gloo, spawned ranks with uneven local batches): outputs, input
grads, weight/bias grads (summed over ranks) and running stats equal
torch.nn.BatchNorm on the whole batch in float64. float64 inputs agree to
rounding (1e-10); float32 inputs to fp32 accuracy of a normalisation (rtol 1e-4,
atol 1e-5: the statistics are formed in float64 from float32 moments).
Single-process: without a process group it is exactly torch's batch norm.
"""

from __future__ import annotations

import pytest
import torch
from _dist_harness import run

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
