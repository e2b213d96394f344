"""apex.parallel.DistributedDataParallel and Reducer on gloo, with spawned ranks (see _dist_harness.py).

Gradients are compared with a float64 reference computed by hand on every rank:
the per-rank grads of the same model on each rank's rows, summed and divided as
upstream apex DDP promises (average: / world size; gradient_average=False: the
sum divided by gradient_predivide_factor).
"""

from __future__ import annotations

import pytest
import torch
from _dist_harness import get_pool, run, spawn_once

# fp32 grads of a tiny model, reduced in another summation order than the float64 reference
F32 = dict(rtol=1e-5, atol=1e-6)
# fp16/bf16 model: the per-rank grads are the same as the reference's; the pre-divided sum is rounded to the
# dtype twice (each addend, then the result): two ulps
LOW = {"float16": dict(rtol=2 * 2.0**-10, atol=1e-5), "bfloat16": dict(rtol=2 * 2.0**-7, atol=1e-5)}


def _check_grads(results, tol, world):
    for r in results:
        for grads, expect in r["steps"]:
            for g, e in zip(grads, expect):
                torch.testing.assert_close(g, e, **tol)
    for g0, g1 in zip(results[0]["steps"][-1][0], results[-1]["steps"][-1][0]):
        assert torch.equal(g0, g1)  # every rank holds the same reduced grads


@pytest.mark.parametrize("kwargs", [
    dict(),  # buckets of at least 20 elements (whole params): several, overlapping the backward
    dict(delay=True),
    dict(message_size=10**7, set_to_none=False),
    dict(predivide=4.0),
    dict(average=False, predivide=2.0),
    pytest.param(dict(dtype="float16", always_fp32=True), marks=pytest.mark.full),
    dict(dtype="bfloat16"),
    dict(trigger=True),
    dict(streams=2, prof=True),
    dict(freeze_at=1),
    dict(checkpoint=True),
])
def test_ddp_grads_match_reference(kwargs):
    res = run(2, "ddp_semantics", **kwargs)
    tol = LOW[kwargs["dtype"]] if "dtype" in kwargs else F32
    _check_grads(res, tol, 2)
    assert res[0]["views"]  # grads are views into the flat buffers (no copies at the next backward)
    if kwargs.get("message_size", 20) == 20 and not kwargs.get("trigger"):
        assert res[0]["buckets"] >= 3
    if "freeze_at" in kwargs:
        assert all(r["frozen_grad"] is None for r in res)


def test_ddp_three_ranks():
    res = run(3, "ddp_semantics")
    _check_grads(res, F32, 3)


@pytest.mark.parametrize("mode", ["no_sync", "disable", "every"])
def test_ddp_gradient_accumulation(mode):
    for r in run(2, "ddp_accumulate", mode=mode):
        for g, e in zip(r["grads"], r["expect"]):
            # grads of mean losses over each rank's rows, averaged: the mean-loss grad of the whole batch, summed
            # over the micro-batches
            torch.testing.assert_close(g, e, **F32)


def test_ddp_param_used_on_some_ranks():
    res = run(2, "ddp_unused")
    for r in res:
        assert r["never"]  # no rank produced a grad: stays None
        torch.testing.assert_close(r["side"], res[0]["side0"], **F32)  # rank 0's grad, averaged with rank 1's zeros


def test_ddp_shares_the_fused_optimizer_buffer():
    res = run(2, "ddp_adopt")
    for r in res:
        assert r["shared"]
        assert r["recombines"] == 1  # combined once; never had to re-bind grads afterwards
        torch.testing.assert_close(r["params"], r["ref"], **F32)
    assert torch.equal(res[0]["params"], res[1]["params"])


@pytest.mark.parametrize("zero", ["optimizer", "module"])
def test_ddp_with_torchs_default_zero_grad_reads_ddps_buffer_in_place(zero):
    res = run(2, "ddp_fresh_grads", zero=zero)
    for r in res:
        assert r["views"] and not r["own_buffer"]
        assert r["recombines"] == 1
        torch.testing.assert_close(r["params"], r["ref"], **F32)
    assert torch.equal(res[0]["params"], res[1]["params"])


def test_reducer():
    res = run(2, "reducer_manual")
    assert torch.equal(res[0]["params"], res[1]["params"])
    for r in res:
        assert r["grad_ok"]
        assert torch.equal(r["list"], torch.full((3,), 0.5))


# ---------------------------------------------------------------- a rank that dies or never arrives


@pytest.mark.parametrize("where", ["absent", pytest.param("initialize", marks=pytest.mark.full),
                                   pytest.param("backward", marks=pytest.mark.full)])
def test_dead_or_missing_rank_gives_collective_error(where):
    res = spawn_once(2, "dead_rank", timeout=90, pg_timeout_s=4.0, where=where)
    r0 = res[0]
    assert r0 is not None and r0["error"] is None, r0
    assert "failed" in r0["collective"] and "timeout" in r0["collective"]
    assert r0["seconds"] < 4.0 + 10.0  # within the process group timeout (plus scheduling slack)


# ---------------------------------------------------------------- sizes that differ across ranks
# (scenarios run on every rank of a spawned pool, which imports this module by name)

HERE = "test_distributed_ddp"


def _attempt(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except RuntimeError as exc:
        return str(exc)
    return None


def _in_step(rank):
    """One more collective completes on every rank: no rank was left behind in a half-done one."""
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def options_differ(rank, world):
    """Options that size the buckets' collectives differ on the last rank: every rank raises at construction,
    before any hook is registered or any bucket is reduced."""
    from apex.parallel import DistributedDataParallel

    last = rank == world - 1
    out = {}
    for key, kwargs in [("message_size", dict(message_size=30 if last else 20)),
                        ("always_fp32", dict(allreduce_always_fp32=last)),
                        ("streams", dict(num_allreduce_streams=2 if last else 1))]:
        model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
        out[key] = _attempt(DistributedDataParallel, model, **kwargs)
        out[key + "_hooks"] = any(getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    out["sum"] = _in_step(rank)
    return out


def reducer_sizes_differ(rank, world):
    """Reducer over tensors or parameters that differ on the last rank, and a reduce() where a parameter has a
    gradient on some ranks only: every rank raises instead of reducing buffers of different sizes."""
    from apex.parallel import Reducer

    last = rank == world - 1
    t = torch.ones(3 if last else 2)
    out = {"list": _attempt(Reducer, [t]), "list_value": t.clone()}
    model = torch.nn.Linear(2, 3 if last else 2)
    out["module"] = _attempt(Reducer, model)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    red = Reducer(model)
    for i, p in enumerate(model.parameters()):
        if not (last and i == 3):
            p.grad = torch.full_like(p, float(rank + 1))
    out["reduce"] = _attempt(red.reduce)
    out["grad"] = model[0].weight.grad.clone()
    out["sum"] = _in_step(rank)
    return out


def test_options_that_size_the_collectives_must_agree_across_ranks():
    res = _pool_run("options_differ")
    for rank, r in enumerate(res):
        assert ("apex.parallel.DistributedDataParallel: message_size differs across the ranks of the process group: "
                "20 on rank 0, 30 on rank 1. Every rank must pass the same options.") == r["message_size"]
        assert "allreduce_always_fp32 differs across the ranks of the process group: False on rank 0, True on " \
               "rank 1" in r["always_fp32"]
        assert "num_allreduce_streams differs across the ranks of the process group: 1 on rank 0, 2 on rank 1" \
               in r["streams"]
        assert not (r["message_size_hooks"] or r["always_fp32_hooks"] or r["streams_hooks"]), f"rank {rank}"
        assert r["sum"] == 3.0


def test_reducer_sizes_that_differ_across_ranks_raise_on_every_rank():
    res = _pool_run("reducer_sizes_differ")
    for rank, r in enumerate(res):
        assert "apex.parallel.Reducer: the gradient tensors differ across ranks. First difference at gradient " \
               "tensor 0: rank 0 has 'tensor 0' of shape (2,) (float32), rank 1 has 'tensor 0' of shape (3,)" \
               in r["list"], r["list"]
        assert torch.equal(r["list_value"], torch.ones(3 if rank == 1 else 2))
        assert "apex.parallel.Reducer: the parameters differ across ranks. First difference at parameter 0: " \
               "rank 0 has 'weight' of shape (2, 2)" in r["module"], r["module"]
        assert "apex.parallel.Reducer.reduce: the gradients differ across ranks. First difference at gradient 3: " \
               "rank 0 has '1.bias' of shape (2,) (float32), rank 1 has no gradient there" in r["reduce"], r["reduce"]
        torch.testing.assert_close(r["grad"], torch.full((2, 2), float(rank + 1)))  # not reduced
        assert r["sum"] == 3.0


def _pool_run(name):
    return get_pool(2).run(HERE, name)
