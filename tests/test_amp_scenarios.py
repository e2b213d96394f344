"""apex.amp scenarios that cross the focused amp test files: fp16 on CPU, clipping, the overflow-flag path.

* fp16 on CPU chosen through ``APEX_AMP_DTYPE`` (the grid runs bf16, the CPU default):
  O1/O2, two losses x two optimizers, an overflow in one backward: only the owning
  optimizer skips, only that scaler backs off, params equal a hand-written reference;
* ``amp_dtype=`` wins over ``APEX_AMP_DTYPE``; a bad ``APEX_AMP_DTYPE`` fails before
  anything is changed;
* clipping ``amp.master_params()`` between the scale_loss exit and ``step()`` sees the
  unscaled grads (the reason the unscale happens at the exit), with and without
  combine_grad, O1 and O2: bit-identical to plain torch doing the same by hand;
* the npu overflow-flag path (older Ascend chips, through a torch_npu test double that
  behaves like the float-status register; on the emulated npu, the emulator's real register): O2 with a fused
  optimizer, several losses, and gradient accumulation with ``delay_unscale`` (an overflow in an earlier
  micro-batch must not be lost when the next ``scale_loss`` starts).
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from apex import _device, amp
from apex.amp._amp_state import _amp_state
from apex.optimizers import NpuFusedAdam, NpuFusedSGD


@pytest.fixture(autouse=True)
def _amp_env(monkeypatch):
    monkeypatch.delenv("APEX_AMP_DTYPE", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    amp.deinitialize()
    torch.set_num_threads(threads)


def mlp(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))


def data(it: int):
    g = torch.Generator().manual_seed(50 + it)
    return torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def crit(out, y):
    return (out.float() - y).pow(2).mean()


# ---------------------------------------------------------------- fp16 on CPU through APEX_AMP_DTYPE
ITERS = 3
INIT = 2.0**8  # fp16 grads of these models times 2**8 cannot overflow on their own


def _reference(level: str, inject, low=torch.float16):
    """Two models, opt j owns model j; loss0 = f(m0(x)) + f(m1(x)) feeds both, loss1 = f(m1(x2)) only opt 1.
    The same mixed-precision math by hand, unscaled; an injected overflow in loss k skips its optimizers."""
    models = [mlp(1), mlp(2)]
    masters = []
    if level == "O2":
        for m in models:
            m.to(low)
        masters = [[torch.nn.Parameter(p.detach().float()) for p in m.parameters()] for m in models]
        opts = [torch.optim.SGD(ms, lr=0.1, momentum=0.9) for ms in masters]
    else:
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]

    def fwd(m, x):
        if level == "O2":
            return m(x.to(low))
        with torch.autocast("cpu", dtype=low):
            return m(x)

    plan = [[0, 1], [1]]
    for it in range(ITERS):
        x, x2, y = data(it)
        for m in models:
            for p in m.parameters():
                p.grad = None
        for ms in masters:
            for p in ms:
                p.grad = None
        losses = [crit(fwd(models[0], x), y) + crit(fwd(models[1], x), y), crit(fwd(models[1], x2), y)]
        skip = set()
        for k, loss in enumerate(losses):
            loss.backward()
            if inject == (it, k):
                skip.update(plan[k])
            if level == "O2":  # master grads accumulate in fp32, one backward at a time
                for m, ms in zip(models, masters):
                    for p, mp in zip(m.parameters(), ms):
                        if p.grad is not None:
                            g = p.grad.float()
                            mp.grad = g if mp.grad is None else mp.grad + g
                            p.grad = None
        for j, o in enumerate(opts):
            if j not in skip:
                o.step()
        if level == "O2":
            with torch.no_grad():
                for m, ms in zip(models, masters):
                    for p, mp in zip(m.parameters(), ms):
                        p.copy_(mp)
    return models


def _amp_run(level: str, inject, **kw):
    models = [mlp(1), mlp(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    models, opts = amp.initialize(models, opts, opt_level=level, num_losses=2, dynamic_init_scale=INIT,
                                  verbosity=0, **kw)
    plan = [[0, 1], [1]]
    for it in range(ITERS):
        x, x2, y = data(it)
        for o in opts:
            o.zero_grad()
        losses = [crit(models[0](x), y) + crit(models[1](x), y), crit(models[1](x2), y)]
        for k, loss in enumerate(losses):
            with amp.scale_loss(loss, [opts[j] for j in plan[k]], loss_id=k) as scaled:
                scaled.backward()
                if inject == (it, k):
                    with torch.no_grad():
                        models[k][0].weight.grad.view(-1)[0] = float("inf")
        for o in opts:
            o.step()
    return models


@pytest.mark.parametrize("inject", [None, (1, 0), (1, 1)], ids=["clean", "inf-loss0", "inf-loss1"])
@pytest.mark.parametrize("combine", [False, True], ids=["plain", "combine_grad"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp16_on_cpu_via_env(level, combine, inject, monkeypatch):
    """APEX_AMP_DTYPE=fp16 on CPU: fp16 model/autocast; the overflow skips exactly the owning optimizers once.

    Tolerance: the reference rounds unscaled fp16 grads, amp rounds them scaled by 2**8 (more of them stay
    normal), so a few fp16 ulps of difference are expected (rtol/atol 4e-3); a skipped or extra step would
    differ by lr * grad, far beyond that.
    """
    monkeypatch.setenv("APEX_AMP_DTYPE", "fp16")
    ref = _reference(level, inject)
    got = _amp_run(level, inject, combine_grad=combine or None)
    for ma, mb in zip(got, ref):
        # keep_vars: the live tensors in the model's dtype (O2's state_dict() saves fp32 copies)
        for (name, a), b in zip(ma.state_dict(keep_vars=True).items(), mb.state_dict(keep_vars=True).values()):
            assert a.dtype == b.dtype == (torch.float16 if level == "O2" else torch.float32), name
            torch.testing.assert_close(a.float(), b.float(), rtol=4e-3, atol=4e-3, msg=lambda s, n=name: f"{n}: {s}")
    expected = {f"loss_scaler{k}": {"loss_scale": INIT / 2 if inject and inject[1] == k else INIT,
                                    "unskipped": ITERS - 2 if inject and inject[1] == k else ITERS} for k in (0, 1)}
    assert amp.state_dict() == expected


def test_amp_dtype_argument_beats_env(monkeypatch):
    monkeypatch.setenv("APEX_AMP_DTYPE", "fp16")
    m = mlp(0)
    amp.initialize(m, opt_level="O2", amp_dtype=torch.bfloat16, verbosity=0)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    amp.deinitialize()
    monkeypatch.setenv("APEX_AMP_DTYPE", "bf16")
    m = mlp(0)
    amp.initialize(m, opt_level="O3", amp_dtype="float16", verbosity=0)
    assert all(p.dtype == torch.float16 for p in m.parameters())


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_bad_env_dtype_changes_nothing(level, monkeypatch):
    monkeypatch.setenv("APEX_AMP_DTYPE", "int8")
    m = mlp(0)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"APEX_AMP_DTYPE: expected one of .*got 'int8'"):
        amp.initialize(m, o, opt_level=level, verbosity=0)
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert "forward" not in m.__dict__ and not hasattr(o, "_amp_stash") and _amp_state.session is None


# ---------------------------------------------------------------- clipping between exit and step
@pytest.mark.parametrize("combine", [False, True], ids=["plain", "combine_grad"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clip_master_params_between_exit_and_step(level, combine):
    """Users clip amp.master_params() after scale_loss: they must see unscaled grads (bit-identical to plain
    torch doing the same mixed precision by hand, bf16; power-of-two scales make the unscale exact)."""
    max_norm = 0.05  # small enough to clip at every step
    low = torch.bfloat16
    ref = mlp(3)
    if level == "O2":
        ref.to(low)
        masters = [torch.nn.Parameter(p.detach().float()) for p in ref.parameters()]
    else:
        masters = list(ref.parameters())
    ro = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    norms_ref = []
    for it in range(3):
        x, _, y = data(it)
        for p in [*ref.parameters(), *masters]:
            p.grad = None
        if level == "O2":
            out = ref(x.to(low))
        else:
            with torch.autocast("cpu", dtype=low):
                out = ref(x)
        crit(out, y).backward()
        if level == "O2":
            for mp, p in zip(masters, ref.parameters()):
                mp.grad = p.grad.float()
        norms_ref.append(torch.nn.utils.clip_grad_norm_(masters, max_norm))
        ro.step()
        if level == "O2":
            with torch.no_grad():
                for mp, p in zip(masters, ref.parameters()):
                    p.copy_(mp)

    m = mlp(3)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    amp.initialize(m, o, opt_level=level, combine_grad=combine or None, verbosity=0)
    norms = []
    for it in range(3):
        x, _, y = data(it)
        o.zero_grad()
        with amp.scale_loss(crit(m(x), y), o) as scaled:
            scaled.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(amp.master_params(o), max_norm))
        o.step()
    assert all(float(n) > max_norm for n in norms_ref), "the test must actually clip"
    for a, b in zip(norms, norms_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for (name, a), b in zip(m.state_dict(keep_vars=True).items(), ref.state_dict(keep_vars=True).values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda s, n=name: f"{n}: {s}")


# ---------------------------------------------------------------- npu overflow flag (test double)
class FloatStatusNpu(types.ModuleType):
    """torch_npu stand-in with a float-status register: ``overflow()`` sets it (what saturating hardware does),
    ``clear_npu_overflow_flag`` resets it, ``get_npu_overflow_flag`` reads it; every call is recorded."""

    def __init__(self):
        super().__init__("torch_npu")
        self.calls = []
        self.register = False
        utils = types.SimpleNamespace(get_npu_overflow_flag=self._get, clear_npu_overflow_flag=self._clear,
                                      is_support_inf_nan=lambda: False)
        self.npu = types.SimpleNamespace(utils=utils)

    def overflow(self):
        self.register = True

    def _get(self):
        self.calls.append("get")
        return self.register

    def _clear(self):
        self.calls.append("clear")
        self.register = False


class EmulatedFloatStatus(FloatStatusNpu):
    """The same interface over the emulated npu's real register (``APEX_NPU_EMULATOR=1``): ``overflow()`` makes an
    operator on the emulated device overflow for real, and the reads and clears go to the emulator's flag (still
    recorded, so the tests can check amp's order of calls)."""

    def __init__(self, real):
        super().__init__()
        self.real = real
        real.clear_npu_overflow_flag()

    def overflow(self):
        big = torch.full((2,), torch.finfo(torch.float16).max, dtype=torch.float16, device="npu")
        (big * 2).sum()  # inf in fp16: the emulated float-status register is raised by the value itself

    def _get(self):
        self.calls.append("get")
        return self.real.get_npu_overflow_flag()

    def _clear(self):
        self.calls.append("clear")
        self.real.clear_npu_overflow_flag()


@pytest.fixture
def npu_flag(monkeypatch):
    if os.environ.get("APEX_NPU_EMULATOR", "").strip() == "1":
        import torch_npu as real

        fake = EmulatedFloatStatus(real)
    else:
        fake = FloatStatusNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(_device, "npu_needs_overflow_flag", lambda device=None: True)
    return fake


def _step(m, o, x, y, fake, overflow=False, loss_id=0, delay_unscale=False, zero=True):
    if zero:
        o.zero_grad()
    with amp.scale_loss(crit(m(x), y), o, loss_id=loss_id, delay_unscale=delay_unscale) as scaled:
        scaled.backward()
        if overflow:
            fake.overflow()


@pytest.mark.parametrize("opt_cls", [NpuFusedAdam, NpuFusedSGD])
def test_npu_flag_o2_with_fused_optimizer(npu_flag, opt_cls):
    """O2 + combine_grad + our fused optimizer: the register alone decides; a flagged step is skipped (masters
    and model unchanged, scale halved), the others train; the register is cleared before every backward."""
    m = mlp(4)
    o = opt_cls(m.parameters(), lr=0.01)
    amp.initialize(m, o, opt_level="O2", combine_grad=True, verbosity=0)
    x, _, y = data(0)
    _step(m, o, x, y, npu_flag)
    o.step()
    assert npu_flag.calls == ["clear", "get"]
    before = [p.detach().clone() for p in m.parameters()]
    masters = [p.detach().clone() for p in amp.master_params(o)]
    _step(m, o, x, y, npu_flag, overflow=True)
    o.step()
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before)), "flagged step was not skipped"
    assert all(torch.equal(p, b) for p, b in zip(amp.master_params(o), masters))
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 0}
    _step(m, o, x, y, npu_flag)
    o.step()
    assert not all(torch.equal(p, b) for p, b in zip(amp.master_params(o), masters)), "clean step did not train"
    assert npu_flag.calls == ["clear", "get"] * 3
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 1}


def test_npu_flag_two_losses_only_the_flagged_one_backs_off(npu_flag):
    m = mlp(4)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, o, opt_level="O1", num_losses=2, verbosity=0)
    x, x2, y = data(0)
    o.zero_grad()
    _step(m, o, x, y, npu_flag, loss_id=0, zero=False)
    _step(m, o, x2, y, npu_flag, loss_id=1, overflow=True, zero=False)
    assert npu_flag.calls == ["clear", "get", "clear", "get"]
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 1},
                                "loss_scaler1": {"loss_scale": 2.0**15, "unskipped": 0}}
    w = m[0].weight.detach().clone()
    o.step()
    assert torch.equal(m[0].weight, w)


@pytest.mark.parametrize("combine", [False, True], ids=["plain", "combine_grad"])
def test_npu_flag_overflow_in_delayed_micro_batch_is_not_lost(npu_flag, combine):
    """Gradient accumulation with delay_unscale: an overflow in micro-batch 0 saturates grads that are only
    unscaled and checked at micro-batch 1's exit. The register must still report it there (it may not be
    cleared while scaled grads are pending), so the step is skipped and the scale backs off."""
    m = mlp(4)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, o, opt_level="O1", combine_grad=combine or None, verbosity=0)
    x, x2, y = data(0)
    w = m[0].weight.detach().clone()
    o.zero_grad()
    _step(m, o, x, y, npu_flag, overflow=True, delay_unscale=True, zero=False)
    _step(m, o, x2, y, npu_flag, zero=False)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 0}
    o.step()
    assert torch.equal(m[0].weight, w), "the overflowed accumulation was applied"
    # the next accumulation starts from a cleared register
    o.zero_grad()
    _step(m, o, x, y, npu_flag, delay_unscale=True, zero=False)
    _step(m, o, x2, y, npu_flag, zero=False)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 1}
    o.step()
    assert not torch.equal(m[0].weight, w)
