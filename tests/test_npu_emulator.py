"""The emulated npu device (tests/npu_emulator) and apex's npu path on it.

Runs with ``--device npu`` under ``APEX_NPU_EMULATOR=1`` (``nox -s tests -- --device npu``). Every result on the
emulated device is compared with the same computation on CPU: the emulator runs CPU kernels on npu-typed tensors,
so the answers must be identical (rtol=0, atol=0) while every tensor involved reports device type "npu".

The torch_npu stand-in's float-status flag is real here: it is raised by operators that produce inf/nan, and in
saturation mode (older Ascend chips) those values are clamped, so amp can only see the overflow through the flag.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from apex import _device, amp  # noqa: E402
from apex.contrib.combine_tensors import combine_tensors, is_combined_tensor_valid  # noqa: E402
from apex.optimizers import NpuFusedAdam, NpuFusedSGD  # noqa: E402

pytestmark = [
    pytest.mark.devices("npu"),
    pytest.mark.skipif(os.environ.get("APEX_NPU_EMULATOR", "").strip() != "1",
                       reason="needs the emulated npu (APEX_NPU_EMULATOR=1): it checks the emulator itself"),
]


@pytest.fixture
def torch_npu():
    import torch_npu as mod

    mod.clear_npu_overflow_flag()
    yield mod
    import npu_emulator

    npu_emulator.set_saturation_mode(False)
    mod.clear_npu_overflow_flag()


def same(a, b):
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0)


# ---------------------------------------------------------------- the device itself


def test_factories_copies_and_devices(torch_npu):
    torch.manual_seed(3)
    ref = torch.randn(5, 3)
    torch.manual_seed(3)
    x = torch.randn(5, 3, device="npu")
    assert x.device == torch.device("npu", 0) and x.is_npu
    same(x, ref)
    same(ref.npu(), ref)
    same(ref.to("npu:1"), ref)
    assert ref.to("npu:1").device.index == 1
    same(x.to("npu:1").to("npu:0"), ref)
    assert x.to(torch.float16).dtype == torch.float16 and x.half().device.type == "npu"
    assert torch.npu.device_count() == 2 and torch.npu.is_available()


def test_views_inplace_and_out_resize(torch_npu):
    x = torch.zeros(2, 3, device="npu")
    v = x[1]
    v.add_(2.0)
    same(x, torch.tensor([[0.0, 0, 0], [2, 2, 2]]))
    assert x.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    out = torch.empty(0, device="npu")
    torch.add(x, 1.0, out=out)  # out= resizes an empty npu tensor
    same(out, torch.tensor([[1.0, 1, 1], [3, 3, 3]]))
    assert out.device.type == "npu"
    t = x.t()
    t.mul_(3.0)
    same(x, torch.tensor([[0.0, 0, 0], [6, 6, 6]]))


def test_device_guard_and_memory_stats(torch_npu):
    with torch.npu.device(1):
        assert torch.npu.current_device() == 1
        y = torch.ones(4, device="npu")
    assert y.device.index == 1 and torch.npu.current_device() == 0
    before = torch.npu.memory_allocated(0)
    z = torch.empty(1000, device="npu:0")
    assert torch.npu.memory_allocated(0) >= before + 4000
    del z
    assert torch.npu.memory_allocated(0) == before
    with pytest.raises(ValueError, match=r"index must be in \[0, 2\)"):
        torch.npu.set_device(5)


def test_autograd_matches_cpu(torch_npu):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 6)
    m_npu = torch.nn.Sequential(*[torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)]).npu()
    m_npu.load_state_dict(m.state_dict())
    m(x).square().sum().backward()
    m_npu(x.npu()).square().sum().backward()
    for p, q in zip(m.parameters(), m_npu.parameters()):
        assert q.grad.device.type == "npu"
        same(q.grad, p.grad)


@pytest.mark.parametrize("impl", ["forloop", "foreach", "fused"])
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_torch_optimizers_match_cpu(torch_npu, impl, cls):
    torch.manual_seed(1)
    params = [torch.randn(7, 3), torch.randn(5)]
    grads = [torch.randn_like(p) for p in params]
    kwargs = {"forloop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    extra = dict(lr=0.1, momentum=0.9) if cls is torch.optim.SGD else dict(lr=0.01)
    results = []
    for dev in ("cpu", "npu"):
        ps = [p.clone().to(dev).requires_grad_() for p in params]
        for p, g in zip(ps, grads):
            p.grad = g.to(dev)
        opt = cls(ps, **extra, **kwargs)
        for _ in range(3):
            opt.step()
        results.append(ps)
    for a, b in zip(*results):
        assert b.device.type == "npu"
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_npu(torch_npu, dtype):
    lin = torch.nn.Linear(4, 3).npu()
    x = torch.randn(2, 4, device="npu")
    with torch.autocast("npu", dtype=dtype):
        y = lin(x)
        s = torch.softmax(y, dim=-1)  # fp32 policy on every backend
        assert torch.is_autocast_enabled("npu")
    assert y.dtype == dtype and y.device.type == "npu"
    assert s.dtype == torch.float32
    with torch.autocast("npu", dtype=torch.float16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        torch.nn.functional.binary_cross_entropy(torch.sigmoid(y.float()), torch.zeros_like(y.float()))


# ---------------------------------------------------------------- the torch_npu stand-in


def test_overflow_flag_follows_real_values(torch_npu):
    assert torch_npu.npu.utils.is_support_inf_nan() is True
    x = torch.tensor([1e30, 1.0], device="npu")
    assert not torch_npu.npu.utils.get_npu_overflow_flag()
    torch.tensor([float("inf")]).npu()  # a copy is not arithmetic: no flag
    assert not torch_npu.npu.utils.get_npu_overflow_flag()
    y = x * 1e30
    assert torch.isinf(y[0]) and torch_npu.npu.utils.get_npu_overflow_flag()
    assert _device.npu_get_overflow_flag()
    _device.npu_clear_overflow_flag()
    assert not torch_npu.npu.utils.get_npu_overflow_flag()


def test_saturation_mode_clamps_and_only_the_flag_tells(torch_npu):
    import npu_emulator

    npu_emulator.set_saturation_mode(True)
    assert _device.npu_overflow_supported() is False and _device.npu_needs_overflow_flag("npu") is True
    y = torch.tensor([1e30, -1e30, 1.0], device="npu") * 1e30
    assert torch.isfinite(y).all()
    same(y, torch.tensor([torch.finfo(torch.float32).max, torch.finfo(torch.float32).min, 1e30]))
    assert _device.npu_get_overflow_flag()
    h = torch.tensor([60000.0], device="npu", dtype=torch.float16) * 2
    assert h.item() == torch.finfo(torch.float16).max


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).npu()


@pytest.mark.parametrize("opt_cls", [NpuFusedAdam, NpuFusedSGD])
def test_amp_o2_skips_the_step_the_flag_reports(torch_npu, amp_env, opt_cls):
    """Saturation mode: an overflow in backward leaves finite (clamped) grads; amp reads the emulated register,
    skips that step (params unchanged, scale halved), and trains on the clean steps."""
    import npu_emulator

    npu_emulator.set_saturation_mode(True)
    m = _mlp()
    o = opt_cls(m.parameters(), lr=0.01)
    m, o = amp.initialize(m, o, opt_level="O2", combine_grad=True, verbosity=0)
    x, y = torch.randn(8, 4, device="npu"), torch.randn(8, 2, device="npu")

    def step(scale_loss_by=1.0):
        o.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x).float(), y) * scale_loss_by
        with amp.scale_loss(loss, o) as scaled:
            scaled.backward()
        o.step()

    step()
    before = [p.detach().clone() for p in m.parameters()]
    step(scale_loss_by=1e38)  # x 2**16 overflows fp16 in backward: saturated, flagged
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before)), "the flagged step was not skipped"
    assert all(torch.isfinite(p).all() for p in m.parameters())
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15
    step()
    assert not all(torch.equal(p, b) for p, b in zip(m.parameters(), before)), "a clean step did not train"


def test_combine_on_npu_default_and_private_formats(torch_npu):
    ts = [torch.randn(3, 4, device="npu"), torch.randn(5, device="npu")]
    values = [t.clone() for t in ts]
    buf = combine_tensors(ts)
    assert buf.device.type == "npu" and is_combined_tensor_valid(buf, ts)
    for t, v in zip(ts, values):
        same(t, v)
    nz = [torch_npu.npu_format_cast(torch.randn(4, 4, device="npu"), torch_npu.ACL_FORMAT_FRACTAL_NZ)
          for _ in range(2)]
    assert _device.npu_has_private_format(nz[0])
    values = [t.clone() for t in nz]
    buf = combine_tensors(nz)  # delegated to the stand-in's native combine
    assert buf.numel() == 32 and is_combined_tensor_valid(buf, nz)
    for t, v in zip(nz, values):
        same(t, v)


def test_detection_and_fused_devices(torch_npu):
    assert _device.npu_available() and _device.detect_device() == "npu"
    assert "npu" in _device.fused_optimizer_devices()
    assert _device.default_amp_dtype("npu") == torch.float16
