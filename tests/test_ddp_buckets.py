"""apex.parallel.DistributedDataParallel bucketing: ``message_size`` is the minimum bucket size (whole params,
never split), ``allreduce_trigger_params`` set the boundaries instead; the grads equal torch DDP's averaged
grads (gloo, spawned ranks, see _dist_harness.py)."""

from __future__ import annotations

import pytest
import torch
from _dist_harness import run

from apex.parallel.reducer import plan_param_buckets

# both wrappers sum the same fp32 per-rank grads over 2 ranks and divide by 2: identical up to summation order
F32 = dict(rtol=1e-6, atol=1e-6)


def _same_grads(res):
    for r in res:
        for ours, theirs in r["grads"]:
            for g, t in zip(ours, theirs):
                torch.testing.assert_close(g, t, **F32)
    for (g0, _), (g1, _) in zip(res[0]["grads"], res[1]["grads"]):
        for a, b in zip(g0, g1):
            assert torch.equal(a, b)


# ---------------------------------------------------------------- the plan (no process group needed)


def test_plan_one_bucket_per_param_when_message_size_is_small():
    slots = [(0, 30), (32, 40), (80, 0), (96, 4)]
    ranges, sb = plan_param_buckets(100, slots, 1)
    assert ranges == [(96, 100), (32, 96), (0, 32)]  # last params first; padding covered; nothing split
    assert sb == [[2], [1], [], [0]]


def test_plan_minimum_size_groups_whole_params():
    slots = [(0, 10), (10, 10), (20, 10), (30, 10), (40, 5)]
    ranges, sb = plan_param_buckets(45, slots, 12)
    # from the last: 5 + 10 >= 12 closes; 10 + 10 >= 12 closes; 10 is left
    assert ranges == [(30, 45), (10, 30), (0, 10)]
    assert sb == [[2], [1], [1], [0], [0]]
    assert plan_param_buckets(45, slots, 10**7)[0] == [(0, 45)]


def test_plan_trigger_boundaries():
    slots = [(0, 10), (10, 10), (20, 10), (30, 10)]
    ranges, sb = plan_param_buckets(40, slots, None, [2, 0])
    assert ranges == [(20, 40), (0, 20)]  # a bucket closes right after each trigger (walking from the last)
    assert sb == [[1], [1], [0], [0]]
    assert plan_param_buckets(40, slots, None)[0] == [(0, 40)]


def test_plan_degenerate_inputs():
    assert plan_param_buckets(0, [], 5) == ([], [])
    assert plan_param_buckets(0, [(0, 0)], 5) == ([(0, 0)], [[]])
    with pytest.raises(ValueError, match="bucket size"):
        plan_param_buckets(10, [(0, 10)], 0)


# ---------------------------------------------------------------- DDP on 2 gloo ranks


def test_message_size_one_gives_one_bucket_per_param_and_torch_ddp_grads():
    sizes = (4096, 4096, 4096, 4096)
    res = run(2, "ddp_buckets", sizes=sizes, message_size=1)
    r = res[0]
    assert len(r["buckets"]) == len(sizes)
    assert r["members"] == [[3], [2], [1], [0]]  # bucket b holds param 3 - b
    assert r["order"] == [0, 1, 2, 3]  # expected arrival order: the last param's bucket first
    offsets = r["offsets"]
    for b, (start, numel) in enumerate(r["buckets"]):
        i = r["members"][b][0]
        assert start == offsets[i] and numel >= sizes[i]  # a whole param (plus alignment padding)
    assert r["flat_bytes"] <= 4 * sum(sizes) + 4 * 64 * len(sizes)  # one flat buffer the size of the model
    _same_grads(res)


def test_message_size_is_a_minimum():
    sizes = (10, 300, 20, 20, 20, 7)
    res = run(2, "ddp_buckets", sizes=sizes, message_size=30)
    # from the last: 7 + 20 + 20 >= 30 closes; 20 + 300 closes; 10 is left
    assert res[0]["members"] == [[3, 4, 5], [1, 2], [0]]
    assert res[0]["buckets"] == res[1]["buckets"]  # the same plan on every rank
    _same_grads(res)


def test_trigger_params_set_the_boundaries_and_ignore_message_size():
    sizes = (16, 16, 16, 16, 16)
    res = run(2, "ddp_buckets", sizes=sizes, message_size=1, trigger=[3, 1])
    assert res[0]["members"] == [[3, 4], [1, 2], [0]]
    _same_grads(res)


@pytest.mark.full
def test_message_size_one_with_two_large_params():
    """Two 4M-element params with message_size=1: two buckets, memory of the model, torch DDP's grads."""
    sizes = (4 * 2**20, 4 * 2**20)
    res = run(2, "ddp_buckets", sizes=sizes, message_size=1, steps=1, timeout=300)
    assert len(res[0]["buckets"]) == 2
    assert res[0]["flat_bytes"] <= 4 * sum(sizes) + 4096
    _same_grads(res)


def test_different_streams_need_overlap():
    from apex.parallel import DistributedDataParallel

    with pytest.raises(ValueError, match="delay_allreduce=False"):
        DistributedDataParallel(torch.nn.Linear(2, 2), num_allreduce_streams=2, delay_allreduce=True)
