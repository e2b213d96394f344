"""combine_ddp (amp) and apex.parallel.DistributedDataParallel on gloo, with spawned ranks.

Acceptance: 2 and 3 ranks, O0 (apex DDP) / O1 / O2 (combine_ddp), torch and
fused optimizers, 20 steps of a model without batchnorm: params identical on
every rank (bitwise) and equal to single-process training on the concatenated
batch (fp32 tolerance for O0, the low dtype's for O1/O2); an inf injected on one
rank makes every rank skip the same step; gradient accumulation with
delay_unscale. The scenarios themselves live in _dist_scenarios.py, the
process pools in _dist_harness.py.

Tolerances: O0 is fp32 end to end; the all-reduce only changes the summation
order of the gradient, so 20 steps stay within rtol 1e-5 / atol 1e-6. Under
O1/O2 the forward/backward runs in the low dtype on a different batch split
(per-rank batches vs one batch), so params agree to that dtype's resolution:
bf16 (8 bits of mantissa): rtol 1.6e-2, atol 1e-2 (one ulp at magnitude 2 is
0.0156 under O2, where the model params themselves are bf16); fp16 (11 bits):
rtol 2e-3, atol 2e-3. Measured on this machine, the distributed runs differ
from the single-process ones by about as much as the single-process low-precision
runs differ from fp32 (ratio 0.4-1.1 over the grid). Adam runs with eps=1e-3
(see _dist_scenarios.make_optimizer) so that near-zero gradients do not turn
rounding noise into full-lr steps.
"""

from __future__ import annotations

import pytest
import torch
from _dist_harness import run

TOL = {
    "O0": dict(rtol=1e-5, atol=1e-6),
    "bfloat16": dict(rtol=1.6e-2, atol=1e-2),
    "float16": dict(rtol=2e-3, atol=2e-3),
}


def _check_train(results, opt_level, amp_dtype="bfloat16", skipped=()):
    r0 = results[0]
    for rank, r in enumerate(results[1:], start=1):
        assert torch.equal(r["params"], r0["params"]), f"rank {rank} params differ from rank 0's"
        assert r["changed"] == r0["changed"], f"rank {rank} skipped other steps than rank 0"
        assert r["scales"] == r0["scales"]
    ref = r0["reference"]
    tol = TOL["O0"] if opt_level == "O0" else TOL[amp_dtype]
    torch.testing.assert_close(r0["params"], ref["params"], **tol)
    expected = [i not in skipped for i in range(len(r0["changed"]))]
    assert r0["changed"] == expected
    assert ref["changed"] == expected


GRID = [(world, level, opt, dtype) for world in (2, 3) for level in ("O0", "O1", "O2")
        for opt in ("sgd", "adam", "fused_sgd", "fused_adam")
        for dtype in (("bfloat16",) if level == "O0" else ("bfloat16", "float16"))]
FAST = {(2, "O0", "adam", "bfloat16"), (2, "O1", "sgd", "bfloat16"), (2, "O1", "fused_adam", "float16"),
        (2, "O2", "adam", "bfloat16"), (2, "O2", "fused_sgd", "float16"), (3, "O0", "fused_sgd", "bfloat16"),
        (3, "O1", "fused_adam", "bfloat16"), (3, "O2", "sgd", "float16")}


@pytest.mark.parametrize("world,opt_level,optimizer,amp_dtype", [
    pytest.param(*case, marks=() if case in FAST else pytest.mark.full) for case in GRID])
def test_train_matches_single_process(world, opt_level, optimizer, amp_dtype):
    results = run(world, "train", opt_level=opt_level, optimizer=optimizer, amp_dtype=amp_dtype)
    _check_train(results, opt_level, amp_dtype)


@pytest.mark.parametrize("opt_level,optimizer", [
    ("O2", "fused_adam"), pytest.param("O1", "sgd", marks=pytest.mark.full),
    pytest.param("O2", "adam", marks=pytest.mark.full)])
def test_amp_with_apex_ddp_wrapper(opt_level, optimizer):
    # the upstream recipe: amp.initialize (no combine_ddp), then DistributedDataParallel(model), small buckets
    results = run(2, "train", opt_level=opt_level, optimizer=optimizer, use_ddp=True, message_size=100)
    _check_train(results, opt_level)


@pytest.mark.parametrize("world,opt_level,optimizer,inject_rank", [
    (2, "O1", "fused_adam", 1),
    (2, "O2", "sgd", 0),
    pytest.param(3, "O1", "sgd", 2, marks=pytest.mark.full),
    pytest.param(3, "O2", "fused_adam", 1, marks=pytest.mark.full),
])
def test_inf_on_one_rank_skips_everywhere(world, opt_level, optimizer, inject_rank):
    results = run(world, "train", opt_level=opt_level, optimizer=optimizer, amp_dtype="float16", inject_step=3,
                  inject_rank=inject_rank, steps=8)
    _check_train(results, opt_level, "float16", skipped=(3,))
    assert results[0]["scales"][3] == results[0]["scales"][2] / 2  # backed off once, on every rank


@pytest.mark.parametrize("opt_level,optimizer", [("O1", "fused_sgd"), ("O2", "adam")])
def test_accumulation_with_delay_unscale(opt_level, optimizer):
    results = run(2, "train", opt_level=opt_level, optimizer=optimizer, steps=6, accumulate=3, delay_unscale=True)
    _check_train(results, opt_level)


def test_accumulation_without_delay_unscale():
    # every micro-batch exit reduces: grads already holding reduced values are reduced again (linear, exact)
    results = run(2, "train", opt_level="O1", optimizer="sgd", steps=6, accumulate=2)
    _check_train(results, "O1")


@pytest.mark.parametrize("case", [
    dict(opt_level="O1", optimizer="fused_adam", amp_extra=dict(fold_unscale=True)),
    dict(opt_level="O1", optimizer="sgd", amp_extra=dict(check_combined_tensors=True), set_to_none=False),
    dict(opt_level="O2", optimizer="fused_sgd", set_to_none=False),
    dict(opt_level="O1", optimizer="adam", split=True),
    pytest.param(dict(opt_level="O2", optimizer="fused_adam", split=True, min_bucket=40), marks=pytest.mark.full),
], ids=["fold_unscale", "check_combined", "O2-zero-in-place", "two-optimizers", "O2-two-optimizers-buckets"])
def test_combine_ddp_options(case):
    results = run(2, "train", steps=10, **case)
    _check_train(results, case["opt_level"])


@pytest.mark.parametrize("opt_level,optimizer", [("O2", "sgd"), ("O2", "fused_sgd"), ("O1", "sgd")])
def test_a_param_used_on_one_rank_at_the_first_step_is_stepped_everywhere(opt_level, optimizer):
    """The reduced grad reaches every rank's master (O2: the model param that got it binds its master's grad),
    so all ranks take the same step: each param moved the same on both ranks, b by the same as a's bias."""
    r0, r1 = run(2, "amp_unused_on_one_rank", opt_level=opt_level, optimizer=optimizer)
    for a, b in zip(r0["moved"], r1["moved"]):
        assert torch.equal(a, b)
    assert all(bool(m.ne(0).all()) for m in r0["moved"])


@pytest.mark.parametrize("opt_level,optimizer", [
    ("O2", "fused_adam"), pytest.param("O1", "sgd", marks=pytest.mark.full)])
def test_syncbn_model_under_combine_ddp(opt_level, optimizer):
    # SyncBatchNorm on 2 ranks == BatchNorm on the whole batch; under O2 its fp32 params sit between bf16 runs
    # of the flat buffers, so buckets are made of several parts
    results = run(2, "train", opt_level=opt_level, optimizer=optimizer, steps=10, model_kind="bn", min_bucket=64)
    _check_train(results, opt_level)
    torch.testing.assert_close(results[0]["buffers"], results[0]["reference"]["buffers"], **TOL["bfloat16"])
    assert torch.equal(results[0]["buffers"], results[1]["buffers"])


def test_buckets_overlap_backward_in_order():
    # with a 64-element floor the test model's buffer splits into several buckets; from the second step on they
    # are all-reduced during the backward (before scale_loss exits), the first step at the exit
    res = run(2, "bucket_counts", min_bucket=64)
    r0 = res[0]
    assert r0["buckets"] > 3
    assert r0["reduced_in_backward"] == [False, True, True]
    assert r0["order"] == res[1]["order"]
    # the last params' grads arrive first: the highest buckets launch first
    assert r0["order"][0] == r0["buckets"] - 1


def test_multi_bucket_training_matches():
    results = run(2, "train", opt_level="O2", optimizer="fused_adam", min_bucket=96)
    _check_train(results, "O2")


def test_overflow_flag_is_agreed():
    res = run(2, "overflow_flag")
    assert res == [[True, False, True], [True, False, True]]


# ---------------------------------------------------------------- errors


def test_uneven_model_raises_on_every_rank():
    msgs = run(2, "uneven_model")
    for msg in msgs:
        assert msg is not None and "differ across ranks" in msg
        assert "'5.weight'" in msg and "rank 0 has no state_dict entry there" in msg


def test_uneven_ddp_raises_on_every_rank():
    msgs = run(2, "uneven_ddp")
    for msg in msgs:
        assert msg is not None and "apex.parallel.DistributedDataParallel" in msg and "'5.weight'" in msg


def test_uneven_grad_buffers_raise_after_first_backward():
    msgs = run(2, "uneven_buffers")
    for msg in msgs:
        assert msg is not None and "combined gradient buffers" in msg
        assert "first difference at gradient slot 4: rank 0 has 'buffer 0: 4.bias'" in msg.lower()


def test_wrapped_model_is_refused():
    for msgs in run(2, "wrapped_model"):
        assert len(msgs) == 2
        for msg in msgs:
            assert msg is not None and "Parallel wrappers should only be applied" in msg
        assert "apex.parallel.distributed.DistributedDataParallel" in msgs[0]


@pytest.mark.full
def test_torchrun_example_runs():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    example = root / "examples" / "torchrun_combine_ddp.py"
    if not example.exists():
        pytest.skip("examples/ not beside tests/")
    env = dict(os.environ, APEX_DEVICE="cpu", OMP_NUM_THREADS="1")
    if (root / "src" / "apex").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(example), "--nproc", "2", "--steps", "30"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "params identical on every rank" in proc.stdout
