"""The torch executor's use of torch's fused kernels: which calls it makes, and that they give torch's results.

Where the grads are the flat grad buffer's own views (kept grads: ``zero_grad(set_to_none=False)``), every slot
is updated at one step count and the device's fused kernels are position-free (CUDA), Adam(W), SGD and NVIDIA's
FusedAdam make one fused call over the whole flat buffers instead of one tensor per param. On CUDA that is
checked bitwise against torch's ``fused=True``; on CPU, whose fused kernels are not position-free, the flat call
is forced (`FUSED_POSITION_FREE_DEVICES` patched) and checked within a few fp32 roundings.
"""

from __future__ import annotations

import pytest
import torch
from _optim_harness import use_executor

import apex.optimizers as ao
import apex.optimizers.sgd as sgd_module
from apex import _core, _device

SHAPES = [(7, 3), (1,), (130,), (2, 2, 5), (0,), (33,)]

CASES = {
    "NpuFusedAdam": (ao.NpuFusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1), "_fused_adam_"),
    "NpuFusedAdam-amsgrad": (ao.NpuFusedAdam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True), "_fused_adam_"),
    "NpuFusedAdamW": (ao.NpuFusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), "_fused_adamw_"),
    "FusedAdam": (ao.FusedAdam, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), "_fused_adamw_"),
    "FusedAdam-L2": (ao.FusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False),
                     "_fused_adam_"),
    "NpuFusedSGD": (ao.NpuFusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.1), "sgd"),
}


def _twins(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=gen) for s in SHAPES]
    ours = [torch.nn.Parameter(t.clone().to(device)) for t in base]
    ref = [torch.nn.Parameter(t.clone().to(device)) for t in base]
    return ours, ref, gen


def _set_grads(ours, ref, gen, device, skip=()):
    for k, (p, q) in enumerate(zip(ours, ref)):
        if k in skip:
            continue
        g = torch.randn(p.shape, generator=gen).to(device)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)  # kept grads: written into what the optimizer bound (the flat buffer's views)
        if q.grad is None:
            q.grad = g.clone()
        else:
            q.grad.copy_(g)


class _Spy:
    """Records the list lengths of each call of a fused op made while ``on`` (ours; torch's reference calls the
    same op), then calls it."""

    def __init__(self, fn):
        self.fn, self.sizes, self.on = fn, [], True

    def __call__(self, params, *args, **kwargs):
        if self.on:
            self.sizes.append(len(params))
        return self.fn(params, *args, **kwargs)

    def off(self, fn):
        self.on = False
        try:
            fn()
        finally:
            self.on = True


def _spy(monkeypatch, op: str) -> _Spy:
    if op == "sgd":
        spy = _Spy(sgd_module._FUSED_SGD)
        monkeypatch.setattr(sgd_module, "_FUSED_SGD", spy)
    else:
        spy = _Spy(getattr(torch, op))
        monkeypatch.setattr(torch, op, spy)
    return spy


def _close(ours, ref, device, what):
    for k, (p, q) in enumerate(zip(ours, ref)):
        if device == "cuda":
            assert torch.equal(p.detach(), q.detach()), f"{what}: param {k} differs from torch's fused kernel"
        else:  # CPU's fused kernels round a tensor's vector body and its tail differently
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7,
                                       msg=lambda m, k=k: f"{what} {k}: {m}")


def _forced_flat_twins(monkeypatch, device, case, seed=0):
    """Ours on the torch executor with this device's fused kernels taken as position-free, torch's fused=True
    twin, and a spy on the op ours calls: (ours, its params, torch's, its params, generator, spy)."""
    if device not in _device.fused_optimizer_devices():
        pytest.skip(f"torch has no fused optimizer kernels for {device}")
    cls, ref_cls, hp, op = CASES[case]
    use_executor(monkeypatch, "torch", device)
    monkeypatch.setattr(_device, "FUSED_POSITION_FREE_DEVICES", frozenset({device}))
    ours_p, ref_p, gen = _twins(device, seed=seed)
    opt = cls(ours_p, **hp)
    ref = ref_cls(ref_p, fused=True, **{k: v for k, v in hp.items() if k != "adam_w_mode"})
    return opt, ours_p, ref, ref_p, gen, _spy(monkeypatch, op)


@pytest.mark.parametrize("case", list(CASES))
def test_kept_grads_take_one_flat_call(monkeypatch, device, case):
    opt, ours_p, ref, ref_p, gen, spy = _forced_flat_twins(monkeypatch, device, case)
    for _ in range(4):
        _set_grads(ours_p, ref_p, gen, device)
        opt.step()
        spy.off(ref.step)
        opt.zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=False)
    # the first step reads the fresh grads in place (one tensor per param with a grad); from the second the
    # grads are the flat buffer's views, and each step is one call over the flat buffers
    assert spy.sizes[0] > 1, spy.sizes
    assert spy.sizes[-3:] == [1, 1, 1], spy.sizes
    assert opt.last_executor == "torch"
    _close(ours_p, ref_p, device, case)
    s = opt._all_sets()[0]
    ends = [o + p.numel() for o, p in zip(s.offsets, s.params)]
    for name, flat in [("param", s.flat_p), ("grad", s.flat_g), *s.flat_s.items()]:  # the gaps stay zero
        gaps = [flat[e:o] for e, o in zip(ends, s.offsets[1:]) if o > e]
        assert all(not bool(g.any()) for g in gaps), name


@pytest.mark.parametrize("case", ["NpuFusedAdam", "NpuFusedSGD"])
def test_a_param_without_grad_takes_calls_per_slot(monkeypatch, device, case):
    """A skipped slot (no grad this step) or differing step counts: one tensor per updated param."""
    opt, ours_p, ref, ref_p, gen, spy = _forced_flat_twins(monkeypatch, device, case, seed=1)
    for step in range(4):
        _set_grads(ours_p, ref_p, gen, device, skip=(2,) if step == 1 else ())
        if step == 1:
            ours_p[2].grad, ref_p[2].grad = None, None
        opt.step()
        spy.off(ref.step)
        if step == 1:  # param 2 gets its grad back into the buffer at the next step
            ours_p[2].grad, ref_p[2].grad = torch.zeros_like(ours_p[2]), torch.zeros_like(ref_p[2])
        else:
            opt.zero_grad(set_to_none=False)
            ref.zero_grad(set_to_none=False)
    assert 1 not in spy.sizes[1:] or case == "NpuFusedSGD", spy.sizes  # Adam's step counts differ from step 2 on
    _close(ours_p, ref_p, device, case)


def test_fused_adam_without_bias_correction_takes_torch_ops(monkeypatch, device):
    """torch's fused Adam always corrects the bias: NVIDIA's bias_correction=False runs plain torch ops."""
    use_executor(monkeypatch, "torch", device)
    ours_p, _, gen = _twins(device)
    opt = ao.FusedAdam(ours_p, lr=1e-2, bias_correction=False)
    spy = _spy(monkeypatch, "_fused_adamw_")
    _set_grads(ours_p, ours_p, gen, device)
    opt.step()
    assert spy.sizes == [] and opt.last_executor == "torch"


def test_scale_on_a_device_takes_torch_fused_unscale(device):
    """`_core.scale_` in place with the check, off CPU: torch's fused unscale (one pass); the same values and
    flag as the check-then-multiply path."""
    if device == "cpu":
        pytest.skip("CPU tensors take apex_C or the plain path")
    for values, bad in (([1.0, -2.0, 3.5], False), ([1.0, float("inf"), 2.0], True), ([float("nan")], True)):
        t = torch.tensor(values, device=device)
        expect = torch.tensor(values) * 0.25
        assert _core.scale_(t, 0.25) is bad
        torch.testing.assert_close(t.cpu(), expect, equal_nan=True)


def test_torch_fused_unscale_falls_back_where_the_op_is_missing(monkeypatch):
    def missing(*args):
        raise NotImplementedError("no kernel for this backend")

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", missing)
    t = torch.tensor([1.0, float("inf")])
    assert _core.torch_fused_unscale_([t], 0.5) is None
    assert torch.equal(t, torch.tensor([1.0, float("inf")]))  # unchanged: the caller's plain path runs next


def test_torch_fused_unscale_on_cpu_matches_the_plain_path():
    t = torch.tensor([2.0, -4.0, float("inf"), float("nan")])
    assert _core.torch_fused_unscale_([t], 0.5) is True
    torch.testing.assert_close(t, torch.tensor([1.0, -2.0, float("inf"), float("nan")]), equal_nan=True)
    t = torch.tensor([2.0, -4.0])
    assert _core.torch_fused_unscale_([t], 0.5) is False


def test_torch_fused_unscale_reuses_its_flag_and_factor_without_carrying_a_verdict_over(device):
    """The flag and factor kept between calls never leak a previous call's verdict or scale into the next."""
    dev = torch.device(device)
    calls = [
        ([2.0, -4.0], 0.5, False),
        ([2.0, float("inf")], 0.5, True),
        ([2.0, -4.0], 0.5, False),  # the flag the inf set is not reused
        ([2.0, -4.0], 2.0, False),  # a new scale gets a new factor
        ([2.0, float("nan")], 2.0, True),
        ([2.0, -4.0], 0.0, False),
        ([2.0, -4.0], -0.0, False),  # equal to 0.0 as a float, yet it scales to -0.0 and 0.0
        ([1.0, 3.0], 0.25, False),
    ]
    for values, scale, bad in calls:
        t = torch.tensor(values, device=dev)
        expect = torch.tensor(values) * torch.tensor(scale)
        got = _core.torch_fused_unscale_([t], scale)
        if got is None:
            pytest.skip(f"torch has no fused unscale op for {device}")
        assert got is bad, (values, scale)
        torch.testing.assert_close(t.cpu(), expect, rtol=0, atol=0, equal_nan=True)
        finite = expect.isfinite()
        assert torch.equal(torch.signbit(t.cpu()[finite]), torch.signbit(expect[finite])), (values, scale)


def test_step_counts_reach_the_device_unchanged(device):
    steps = torch.tensor([1.0, 2.0, 7.0])
    moved = _device.host_scalars_to(steps, torch.device(device))
    steps.add_(1.0)  # the host may change its copy at once: the device copy was staged before the call returned
    assert moved.cpu().tolist() == [1.0, 2.0, 7.0]
