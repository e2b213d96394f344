"""Distributed faults on 3 ranks (inf on one rank, mismatched shapes, a dying rank) in the fast tier.

The main files (test_distributed.py, test_distributed_ddp.py, test_sync_batchnorm.py) cover the grid; this one
adds, in the fast tier:

* an inf injected on the *last* of 3 ranks during gradient accumulation with ``delay_unscale`` under combine_ddp:
  every rank skips the same step and the run still equals single-process training on the whole batch;
* a parameter *shape* that differs on the last of 3 ranks: every rank raises the same error naming the first
  differing parameter and both shapes, nothing was changed by the failed ``amp.initialize``, and the group is
  still usable afterwards (the ranks did not drift apart in their collectives: no later hang);
* a rank that *dies* mid-training on a 3-rank group: both survivors get ``CollectiveError`` within the process-group
  timeout (the 2-rank "dies" cases of test_distributed_ddp.py are slow-tier only).

Scenario functions live here (the pool's ranks import this module by name, see _dist_harness.py).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from _dist_harness import get_pool, spawn_once
from test_distributed import _check_train

from apex import amp

HERE = "test_distributed_faults"


# ---------------------------------------------------------------- scenarios (run on every rank)


def _mlp(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 4))


def uneven_shape_then_recover(rank, world):
    """The last rank's hidden layer is one unit wider; after the error the same group trains a correct model."""
    model = _mlp(25 if rank == world - 1 else 24)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        amp.initialize(model, opt, opt_level="O1", combine_grad=True, combine_ddp=True, verbosity=0)
        msg = None
    except RuntimeError as exc:
        msg = str(exc)
    untouched = (amp._amp_state.session is None and not hasattr(opt, "_amp_stash")
                 and "forward" not in model.__dict__ and model[0].weight.dtype == torch.float32)
    # still in step: one more collective completes on every rank (no rank is left waiting in a half-done one)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    # and a correct model trains on the same group
    torch.manual_seed(rank)  # different inits: the broadcast from rank 0 must fix them
    model = _mlp(24)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", combine_grad=True, combine_ddp=True, verbosity=0)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(4 * world, 8, generator=g)[rank * 4:(rank + 1) * 4]
        with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"msg": msg, "untouched": untouched, "sum": t.item(), "params": params}


# ---------------------------------------------------------------- tests


def test_inf_on_last_of_three_ranks_during_delayed_accumulation():
    # O1 + fused Adam + fp16: step 2's micro-batches are poisoned on rank 2 only; delay_unscale defers the unscale
    # and the all-reduce to the last micro-batch, whose reduced grads then carry the inf to every rank
    results = get_pool(3).run("_dist_scenarios", "train", opt_level="O1", optimizer="fused_adam",
                              amp_dtype="float16", steps=6, accumulate=2, delay_unscale=True, inject_step=2,
                              inject_rank=2)
    _check_train(results, "O1", "float16", skipped=(2,))
    assert results[0]["scales"][2] == results[0]["scales"][1] / 2  # backed off once, on every rank


@pytest.mark.full
def test_inf_on_middle_rank_o2_torch_adam_delayed_accumulation():
    results = get_pool(3).run("_dist_scenarios", "train", opt_level="O2", optimizer="adam", amp_dtype="float16",
                              steps=6, accumulate=3, delay_unscale=True, inject_step=4, inject_rank=1)
    _check_train(results, "O2", "float16", skipped=(4,))


def test_uneven_shape_on_three_ranks_names_it_everywhere_and_leaves_the_group_usable():
    res = get_pool(3).run(HERE, "uneven_shape_then_recover")
    expect = ("First difference at state_dict entry 0: rank 0 has '0.weight' of shape (24, 8) (float32), "
              "rank 2 has '0.weight' of shape (25, 8) (float32)")
    for rank, r in enumerate(res):
        assert r["msg"] is not None and expect in r["msg"], f"rank {rank}: {r['msg']}"
        assert "amp.initialize(combine_ddp=True): the state_dict entries differ across ranks" in r["msg"]
        assert r["untouched"], f"rank {rank}: the failed amp.initialize left state behind"
        assert r["sum"] == 6.0
    for r in res[1:]:
        assert torch.equal(r["params"], res[0]["params"])


def test_rank_dying_mid_training_fails_both_survivors_within_the_timeout():
    pg_timeout = 4.0
    t0 = time.monotonic()
    res = spawn_once(3, "dead_rank", timeout=90, pg_timeout_s=pg_timeout, where="backward")
    assert res[1] is None  # rank 1 exited at step 1
    for rank in (0, 2):
        r = res[rank]
        assert r is not None and r["error"] is None, f"rank {rank}: {r}"
        assert "amp combine_ddp" in r["collective"] and "failed" in r["collective"], r["collective"]
        assert r["seconds"] < pg_timeout + 10.0, r  # initialize + 1 step + detection: within timeout plus slack
    assert time.monotonic() - t0 < 60.0  # start included: the spawned test stays under a minute
