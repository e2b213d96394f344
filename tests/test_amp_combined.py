"""combine_grad: flat grad buffers, one unscale+check pass per buffer, sharing checks, folded unscale,
gradient accumulation, torch fused optimizers, apex optimizers, and the npu overflow-flag path."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from _amp_harness import bn_mlp

from apex import _core, _device, amp

pytestmark = pytest.mark.usefixtures("amp_env")

LOW = torch.bfloat16
S = 2.0**16


def net(seed=5):
    torch.manual_seed(seed)
    return bn_mlp(4, 16, 3)


def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def loss_of(m, x, y):
    return (m(x).float() - y).pow(2).mean()


def o1_backward_by_hand(m, x, y):
    """O1's math without amp: the forward under autocast, loss_of's fp32 loss, an unscaled backward."""
    with torch.autocast("cpu", dtype=LOW):
        out = m(x)
    (out.float() - y).pow(2).mean().backward()


def storage(t):
    return t.untyped_storage().data_ptr()


def apex_adam(params, **kw):
    optimizers = pytest.importorskip("apex.optimizers")
    return optimizers.NpuFusedAdam(params, lr=0.01, **kw)


# ---------------------------------------------------------------- structure


def test_grads_live_in_one_buffer_per_group_and_dtype():
    m = net()
    o = torch.optim.SGD([{"params": m[0].parameters()}, {"params": list(m[1].parameters()) +
                                                          list(m[3].parameters()), "lr": 0.5}], lr=0.1)
    amp.initialize(m, o, opt_level="O1", combine_grad=True, verbosity=0)
    for x, y in data(2):
        o.zero_grad(set_to_none=False)
        with amp.scale_loss(loss_of(m, x, y), o) as scaled:
            scaled.backward()
        o.step()
    flats = o._amp_stash.combined.flat_buffers()
    assert len(flats) == 2
    for group, flat in zip(o.param_groups, flats):
        for p in group["params"]:
            assert storage(p.grad) == storage(flat)


def test_one_pass_per_buffer(monkeypatch):
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, o, opt_level="O1", combine_grad=True, verbosity=0)
    (x, y), = data(1)
    with amp.scale_loss(loss_of(m, x, y), o) as scaled:
        scaled.backward()
    o.step()
    calls = []
    real = _core.scale_

    def spy(src, scale, out=None, check=True):
        calls.append((src.numel(), scale, check))
        return real(src, scale, out=out, check=check)

    monkeypatch.setattr(_core, "scale_", spy)
    o.zero_grad(set_to_none=False)
    with amp.scale_loss(loss_of(m, x, y), o) as scaled:
        scaled.backward()
    flat = o._amp_stash.combined.flat_buffers()[0]
    assert calls == [(flat.numel(), 1.0 / S, True)]  # zero_grad made it known-zero: no pre-scale pass


def test_combined_matches_uncombined_with_accumulation():
    """Micro-batches without zeroing in between; the combined run uses pre-scaling, not a stash."""
    runs = []
    for combine in (False, True):
        m = net()
        o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        amp.initialize(m, o, opt_level="O1", combine_grad=combine or None, num_losses=2, verbosity=0)
        batches = data(6)
        for step in range(3):
            o.zero_grad(set_to_none=step % 2 == 0)
            for k, (x, y) in enumerate(batches[2 * step:2 * step + 2]):
                with amp.scale_loss(loss_of(m, x, y), o, loss_id=k) as scaled:
                    scaled.backward()
            o.step()
        runs.append([p.detach().clone() for p in m.parameters()])
        amp.deinitialize()
    ref = net()
    ro = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    batches = data(6)
    for step in range(3):
        ro.zero_grad()
        for x, y in batches[2 * step:2 * step + 2]:
            o1_backward_by_hand(ref, x, y)
        ro.step()
    for a, b, r in zip(runs[0], runs[1], ref.parameters()):
        torch.testing.assert_close(a, r, rtol=0, atol=0)
        torch.testing.assert_close(b, r, rtol=0, atol=0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_delay_unscale_accumulation(level):
    """delay_unscale leaves grads scaled until the last micro-batch.

    Combined and per-tensor bookkeeping agree bit for bit either way. Under O1 (fp32 grads, power-of-two
    scale) delaying changes nothing at all; under O2 the delayed model grads accumulate in bf16, as upstream.
    """
    results = {}
    for combine in (False, True):
        for delayed in (False, True):
            m = net()
            o = torch.optim.SGD(m.parameters(), lr=0.1)
            amp.initialize(m, o, opt_level=level, combine_grad=combine or None, verbosity=0)
            for step in range(2):
                o.zero_grad()
                micro = data(3, seed=step)
                for i, (x, y) in enumerate(micro):
                    last = i == len(micro) - 1
                    with amp.scale_loss(loss_of(m, x, y), o, delay_unscale=delayed and not last) as scaled:
                        scaled.backward()
                o.step()
            results[combine, delayed] = [p.detach().clone() for p in m.parameters()]
            amp.deinitialize()
    pairs = [((False, d), (True, d)) for d in (False, True)]
    if level == "O1":
        pairs.append(((False, False), (False, True)))
    for ka, kb in pairs:
        for a, b in zip(results[ka], results[kb]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- sharing broken by user code


def _run_breaking(breaker, check):
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    amp.initialize(m, o, opt_level="O1", combine_grad=True, check_combined_tensors=check or None, verbosity=0)
    for i, (x, y) in enumerate(data(4)):
        o.zero_grad(set_to_none=False)
        if i == 2:
            breaker(m)
        with amp.scale_loss(loss_of(m, x, y), o) as scaled:
            scaled.backward()
        o.step()
    flat = o._amp_stash.combined.flat_buffers()[0]
    shared = all(storage(p.grad) == storage(flat) for p in m.parameters())
    # fresh grad tensors are unscaled where they are (gathered), unless check_combined_tensors wants the buffers
    shared = shared or (not check and o._amp_stash.combined.gathered)
    return [p.detach().clone() for p in m.parameters()], shared


def _reference_params():
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    for x, y in data(4):
        o.zero_grad()
        o1_backward_by_hand(m, x, y)
        o.step()
    return [p.detach().clone() for p in m.parameters()]


def _set_none(m):
    for p in m.parameters():
        p.grad = None


def _new_tensor(m):
    for p in m.parameters():
        p.grad = torch.zeros_like(p)


def _rebind_data(m):
    for p in m.parameters():
        p.grad.data = torch.zeros_like(p)


@pytest.mark.parametrize("breaker,needs_check", [(_set_none, False), (_new_tensor, False), (_rebind_data, True)],
                         ids=["grad=None", "grad=new", "grad.data=new"])
def test_broken_sharing_is_healed(breaker, needs_check):
    expected = _reference_params()
    params, shared = _run_breaking(breaker, check=needs_check)
    for a, b in zip(params, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert shared


# ---------------------------------------------------------------- folded unscale, torch fused


class SpyAdam(torch.optim.Adam):
    """Records what amp hands the fused kernel at each step."""

    def step(self, closure=None):
        self.seen = dict(grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
                         grad=self.param_groups[0]["params"][0].grad.clone())
        return super().step(closure)


def test_fold_unscale_with_torch_fused_passes_scale_to_kernel():
    m = net()
    o = SpyAdam(m.parameters(), lr=0.01, fused=True)
    amp.initialize(m, o, opt_level="O1", combine_grad=True, fold_unscale=True, verbosity=0)
    assert o._amp_stash.fold
    (x, y), = data(1)
    with amp.scale_loss(loss_of(m, x, y), o) as scaled:
        scaled.backward()
    scaled_grad = m[0].weight.grad.clone()
    o.step()
    assert o.seen["grad_scale"].item() == S and o.seen["found_inf"].item() == 0.0
    torch.testing.assert_close(o.seen["grad"], scaled_grad)  # the exit left the grads scaled
    assert "grad_scale" not in o.__dict__ and "found_inf" not in o.__dict__
    ref = net()
    ro = torch.optim.Adam(ref.parameters(), lr=0.01, fused=True)
    o1_backward_by_hand(ref, x, y)
    torch.testing.assert_close(scaled_grad / S, ref[0].weight.grad, rtol=0, atol=0)
    ro.step()
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # an overflow: the step is skipped before the fused kernel (no found_inf call), nothing changes
    o.zero_grad()
    w = m[0].weight.detach().clone()
    o.seen = None
    with amp.scale_loss(loss_of(m, x, y), o) as scaled:
        scaled.backward()
        m[0].weight.grad.view(-1)[0] = float("nan")
    o.step()
    assert o.seen is None
    assert torch.equal(m[0].weight, w) and o.state[m[0].weight]["step"].item() == 1.0


def test_fold_unscale_first_step_overflow_leaves_torch_fused_sgd_as_stock():
    """A first step that overflows must leave no state: torch's fused SGD, called with found_inf = 1, would create
    its momentum buffers without writing them, and the next step would read them."""
    (x, y), = data(1)
    runs = []
    for fused in (True, False):
        m = net()
        o = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, fused=fused)
        amp.initialize(m, o, opt_level="O1", combine_grad=True, fold_unscale=True, verbosity=0)
        for step in range(3):
            o.zero_grad()
            with amp.scale_loss(loss_of(m, x, y), o) as scaled:
                scaled.backward()
                if step == 0:
                    m[0].weight.grad.view(-1)[0] = float("inf")
            o.step()
            if step == 0:
                assert not any(o.state[p] for p in m.parameters()), "a skipped step created optimizer state"
        runs.append([p.detach().clone() for p in m.parameters()])
        amp.deinitialize()
    for a, b in zip(*runs):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_fold_unscale_ignored_for_plain_torch_optimizer(caplog):
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with caplog.at_level("INFO", logger="apex.amp"):
        amp.initialize(m, o, opt_level="O1", combine_grad=True, fold_unscale=True)
    assert "fold_unscale does not apply to SGD" in caplog.text
    (x, y), = data(1)
    with amp.scale_loss(loss_of(m, x, y), o) as scaled:
        scaled.backward()
    ref = net()
    o1_backward_by_hand(ref, x, y)
    torch.testing.assert_close(m[0].weight.grad, ref[0].weight.grad, rtol=0, atol=0)  # unscaled at exit


# ---------------------------------------------------------------- apex optimizers (the protocol)


@pytest.mark.parametrize("fold", [False, True])
def test_apex_optimizer_owns_the_buffers(fold):
    optimizers = pytest.importorskip("apex.optimizers")

    class SpyFusedAdam(optimizers.NpuFusedAdam):
        seen: list

        def step(self, closure=None):
            self.seen.append(self.apex_grad_scale)
            return super().step(closure)

    m = net()
    o = SpyFusedAdam(m.parameters(), lr=0.01)
    o.seen = []
    amp.initialize(m, o, opt_level="O1", combine_grad=True, fold_unscale=fold or None, verbosity=0)
    for x, y in data(5):
        o.zero_grad(set_to_none=False)
        with amp.scale_loss(loss_of(m, x, y), o) as scaled:
            scaled.backward()
        o.step()
    assert o.apex_grad_scale is None
    assert o.seen == ([1.0 / S] * 5 if fold else [None] * 5)
    flats = o.combined_grad_buffers()
    assert [f.data_ptr() for f in flats] == [f.data_ptr() for f in o._amp_stash.combined.flat_buffers()]
    assert o.recombine_count == 1  # combined once, never re-combined because of amp
    ref = net()
    ro = torch.optim.Adam(ref.parameters(), lr=0.01)
    for x, y in data(5):
        ro.zero_grad()
        o1_backward_by_hand(ref, x, y)
        ro.step()
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_apex_optimizer_o2_master_copy_is_attached():
    m = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    o = apex_adam(m.parameters())
    amp.initialize(m, o, opt_level="O2", combine_grad=True, verbosity=0)
    assert o._amp_stash.attached
    for x, y in data(3):
        o.zero_grad()
        with amp.scale_loss(loss_of(m, x, y), o) as scaled:
            scaled.backward()
        o.step()
    for master, model_p in zip(amp.master_params(o), m.parameters()):
        assert torch.equal(master.to(LOW), model_p)


def test_fold_applies_where_the_update_takes_the_scale(device):
    """fold_unscale with an apex optimizer: on the apex_C kernel (CPU) the exit only checks and the update
    multiplies; where the torch executor runs (other devices, or executor="torch"), which would have to copy the
    grads and run unfused ops to take a scale, the exit unscales instead and the update reads the grads in place."""
    optimizers = pytest.importorskip("apex.optimizers")
    for executor in ("auto", "torch"):
        m = net().to(device)
        o = optimizers.NpuFusedAdam(m.parameters(), lr=0.01)
        o.executor = executor
        seen = []
        real_step = type(o).step

        def spy(self, closure=None, seen=seen, real_step=real_step):
            seen.append(self.apex_grad_scale)
            return real_step(self, closure)

        o.step = types.MethodType(spy, o)
        amp.initialize(m, o, opt_level="O1", combine_grad=True, fold_unscale=True, verbosity=0)
        for x, y in data(2):
            m.zero_grad()
            with amp.scale_loss(loss_of(m, x.to(device), y.to(device)), o) as scaled:
                scaled.backward()
            o.step()
        folds = executor == "auto" and device == "cpu" and _core.ext_available()
        assert o.folds_grad_scale() == folds
        assert seen == ([1.0 / S] * 2 if folds else [None] * 2)
        if executor == "auto":  # grads read where they are, on the kernel or through torch's fused op
            assert not any(s.has_grad_buffer for g in o._groups.values() for s in g.sets)
        amp.deinitialize()


# ---------------------------------------------------------------- fp16 grad buffers: stash instead of pre-scaling


def test_fp16_buffer_accumulation_uses_fp32_stash():
    """An fp16 param outside the model (O1 allows it in the optimizer) accumulating across backwards.

    Each backward's grad 0.6 * 2**16 fits fp16, but pre-scaling the accumulated grads (1.2 * 2**16) would
    overflow: the old grads wait in an fp32 stash and are added back after the unscale.
    """
    m = net()
    extra = torch.nn.Parameter(torch.full((3,), 0.5, dtype=torch.float16))
    o = torch.optim.SGD([*m.parameters(), extra], lr=0.01)
    amp.initialize(m, o, opt_level="O1", combine_grad=True, verbosity=0)
    ref = extra.detach().clone().requires_grad_()
    for x, y in data(3):
        loss = loss_of(m, x, y) + (extra.float() * 0.6).sum()
        with amp.scale_loss(loss, o) as scaled:
            scaled.backward()
        (ref.float() * 0.6).sum().backward()
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": S, "unskipped": 3}
    assert extra.grad.dtype == torch.float16
    torch.testing.assert_close(extra.grad, ref.grad, rtol=0, atol=0)
    assert storage(extra.grad) == storage(o._amp_stash.combined.flat_buffers()[1])


# ---------------------------------------------------------------- npu overflow flag (test double)


class FakeOverflowNpu(types.ModuleType):
    """torch_npu stand-in: records calls to the float-status helpers and reports a settable flag."""

    def __init__(self):
        super().__init__("torch_npu")
        self.calls = []
        self.flag = False
        utils = types.SimpleNamespace(
            get_npu_overflow_flag=self._get, clear_npu_overflow_flag=self._clear, is_support_inf_nan=lambda: False)
        self.npu = types.SimpleNamespace(utils=utils)

    def _get(self):
        self.calls.append("get")
        return self.flag

    def _clear(self):
        self.calls.append("clear")


@pytest.mark.parametrize("combine", [False, True])
def test_npu_overflow_flag_replaces_value_scan(monkeypatch, combine):
    fake = FakeOverflowNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(_device, "npu_needs_overflow_flag", lambda device=None: True)
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, o, opt_level="O1", combine_grad=combine or None, verbosity=0)
    (x, y), = data(1)
    ref = net()
    o1_backward_by_hand(ref, x, y)

    # the register says "overflow" although every value is finite: skipped on the flag alone
    fake.flag = True
    order = []
    w0 = m[0].weight.detach().clone()
    with amp.scale_loss(loss_of(m, x, y), o) as scaled:
        order.append(list(fake.calls))
        scaled.backward()
    assert order == [["clear"]] and fake.calls == ["clear", "get"]
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == S / 2
    torch.testing.assert_close(m[0].weight.grad, ref[0].weight.grad, rtol=0, atol=0)  # unscaled all the same
    o.step()
    assert torch.equal(m[0].weight, w0)

    # saturation mode never looks at values: an inf with a clear register is not an overflow
    fake.calls.clear()
    fake.flag = False
    o.zero_grad()
    with amp.scale_loss(loss_of(m, x, y), o) as scaled:
        scaled.backward()
        m[0].weight.grad.view(-1)[0] = float("inf")
    assert fake.calls == ["clear", "get"]
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": S / 2, "unskipped": 1}
    o.step()
    assert not torch.isfinite(m[0].weight).all()


@pytest.mark.parametrize("close", ["other loss", "step"])
@pytest.mark.parametrize("combine", [False, True])
def test_npu_overflow_flag_of_a_delayed_block_reaches_the_exit_that_closes_its_chain(monkeypatch, combine, close):
    """A delay_unscale block of loss 1 raises the register; its chain is closed by loss 0's exit, or by a
    step() with no closing exit: that unscale acts on the flag (back-off, step skipped) though no value is
    scanned, and the flag is consumed, so loss 1's next exit does not skip a clean step."""
    fake = FakeOverflowNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(_device, "npu_needs_overflow_flag", lambda device=None: True)
    m = net()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize(m, o, opt_level="O1", combine_grad=combine or None, verbosity=0, num_losses=2)
    (x, y), = data(1)
    w0 = m[0].weight.detach().clone()
    fake.flag = True
    with amp.scale_loss(loss_of(m, x, y), o, loss_id=1, delay_unscale=True) as scaled:
        scaled.backward()
    fake.flag = False
    if close == "other loss":
        with amp.scale_loss(loss_of(m, x, y), o, loss_id=0) as scaled:
            scaled.backward()
        o.step()
    else:
        with pytest.warns(RuntimeWarning, match="delay_unscale"):
            o.step()
    assert torch.equal(m[0].weight, w0)
    scales = [amp.state_dict()[f"loss_scaler{i}"]["loss_scale"] for i in (0, 1)]
    assert scales == ([S / 2, S] if close == "other loss" else [S, S / 2])
    assert not amp._amp_state.session.pending_flag_overflow
    with amp.scale_loss(loss_of(m, x, y), o, loss_id=1) as scaled:
        scaled.backward()
    o.step()
    assert not torch.equal(m[0].weight, w0)


class TwoBranch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(9)
        self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)

    def forward(self, x, use_b=True):
        return self.a(x) + (self.b(x) if use_b else 0)


def _two_branch_run(opt_cls, level, zero_grad, after_backward=None):
    """Two iterations under `level` + combine_grad: the second leaves branch b out of the forward."""
    m = TwoBranch()
    o = opt_cls(m.parameters(), lr=0.1)
    amp.initialize(m, o, opt_level=level, combine_grad=True, verbosity=0)
    x = torch.randn(8, 4)
    for use_b in (True, False):
        zero_grad(o)
        with amp.scale_loss(m(x, use_b).float().sum(), o) as scaled:
            scaled.backward()
        if after_backward is not None:
            after_backward(m, o)
    return m, o


def test_unused_param_keeps_torch_semantics_under_o1():
    """O1 + combine_grad: after zero_grad(set_to_none=True), a param without a grad is skipped as in torch."""
    b_before = []

    def step(m, o):
        b_before.append(m.b.weight.detach().clone())
        o.step()

    m, _ = _two_branch_run(torch.optim.Adam, "O1", lambda o: o.zero_grad(set_to_none=True), step)
    assert m.b.weight.grad is None and torch.equal(m.b.weight, b_before[-1])


@pytest.mark.parametrize("opt", ["sgd", "apex"])
def test_unused_param_keeps_torch_semantics_under_o2(opt):
    """O2 + combine_grad: the master of a model param no backward wrote since the last step has no grad (the
    model's grad slot stays bound for later backwards), so a momentum optimizer leaves it alone, as torch does."""
    seen = []

    def step(m, o):
        masters = list(amp.master_params(o))  # a.weight, a.bias, b.weight, b.bias
        seen.append(([p.grad is None for p in masters], masters[2].detach().clone()))
        o.step()
        seen[-1] += (masters[2].detach().clone(),)

    make = (lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9)) if opt == "sgd" else (
        lambda ps, lr: apex_adam(ps))
    _two_branch_run(make, "O2", lambda o: o.zero_grad(), step)
    (first_none, _, _), (second_none, before, after) = seen
    assert first_none == [False] * 4
    assert second_none == [False, False, True, True]
    assert torch.equal(before, after)


def test_add_param_group_rebuilds_buffers():
    m, extra = net(), torch.nn.Linear(4, 3)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    amp.initialize([m, extra], o, opt_level="O1", combine_grad=True, verbosity=0)
    (x, y), = data(1)
    with amp.scale_loss(loss_of(m, x, y), o) as scaled:
        scaled.backward()
    o.step()
    o.add_param_group({"params": extra.parameters(), "lr": 0.5})
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(extra.state_dict())
    o1_backward_by_hand(ref, x, y)
    for it in range(2):
        o.zero_grad(set_to_none=False)  # the new group's grads are fresh at the first exit, kept at the second
        loss = loss_of(m, x, y) + (extra(x).float() - y).pow(2).mean()
        with amp.scale_loss(loss, o) as scaled:
            scaled.backward()
        flats = o._amp_stash.combined.flat_buffers()
        assert len(flats) == 2 and flats[1].numel() >= sum(p.numel() for p in extra.parameters())  # aligned slots
        # read where autograd left them at the first exit, combined once they are kept
        assert all(storage(p.grad) == storage(flats[1]) for p in extra.parameters()) == (it == 1)
        torch.testing.assert_close(extra.weight.grad, ref.weight.grad, rtol=0, atol=0)


def test_attached_copy_is_verified_once(caplog):
    """An optimizer that accepts attach_model_params but never copies: amp notices after one step."""
    optimizers = pytest.importorskip("apex.optimizers")

    class ForgetfulAdam(optimizers.NpuFusedAdam):
        def attach_model_params(self, pairs):
            pass

    m = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    o = ForgetfulAdam(m.parameters())
    amp.initialize(m, o, opt_level="O2", verbosity=0)
    with caplog.at_level("WARNING", logger="apex.amp"):
        for x, y in data(2):
            o.zero_grad()
            with amp.scale_loss(loss_of(m, x, y), o) as scaled:
                scaled.backward()
            o.step()
    assert "did not update 4 of 4 model params" in caplog.text and not o._amp_stash.attached
    for master, model_p in zip(amp.master_params(o), m.parameters()):
        assert torch.equal(master.to(LOW), model_p)


@pytest.mark.parametrize("kind", ["torch", "apex"])
def test_o2_param_first_used_later(kind):
    """A branch unused in the first iteration (no slot bound yet) and used in the second: its master gets
    the gradient, exactly as without combine_grad."""
    results = []
    for combine in (False, True):
        m = TwoBranch()
        o = apex_adam(m.parameters()) if kind == "apex" else torch.optim.Adam(m.parameters(), lr=0.01)
        amp.initialize(m, o, opt_level="O2", combine_grad=combine or None, verbosity=0)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        for use_b in (False, True):
            o.zero_grad()
            with amp.scale_loss(m(x, use_b).float().pow(2).sum(), o) as scaled:
                scaled.backward()
            o.step()
        results.append([p.detach().clone() for p in m.parameters()])
        amp.deinitialize()
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(results[1][2], TwoBranch().b.weight.to(LOW))  # b was trained


# ---------------------------------------------------------------- torch's default zero_grad(): no grad buffer


def _fresh_grad_run(make_opt, combine, fold, device="cpu", steps=5, micro=2, inf_at=2):
    """O1 with model.zero_grad() (grads set to None) before each step, ``micro`` accumulated backwards per step,
    an overflowing loss at step ``inf_at`` (the step is skipped)."""
    m = net().to(device)
    o = make_opt(m.parameters())
    amp.initialize(m, o, opt_level="O1", combine_grad=combine or None, fold_unscale=(fold and combine) or None,
                   verbosity=0)
    batches = data(steps * micro, seed=3)
    for step in range(steps):
        m.zero_grad()
        for k in range(micro):
            x, y = batches[step * micro + k]
            loss = loss_of(m, x.to(device), y.to(device))
            if step == inf_at and k == micro - 1:
                loss = loss * float("inf")
            with amp.scale_loss(loss, o) as scaled:
                scaled.backward()
        o.step()
    out = [p.detach().clone() for p in m.parameters()]
    stash = o._amp_stash
    amp.deinitialize()
    return out, o, stash


@pytest.mark.parametrize("fold", [False, True], ids=["unscale", "fold"])
@pytest.mark.parametrize("kind", ["torch", "apex"])
def test_fresh_grads_never_make_a_grad_buffer(kind, fold, device):
    """Every exit unscales and checks the grads where autograd left them (one pass over their address table);
    before a backward onto present grads (accumulation) they are rescaled where they are, so no flat grad buffer
    is ever made, by amp or by the optimizer. Accumulated and skipped steps give the bits of an uncombined run."""
    if kind == "apex":
        make = apex_adam
    else:
        def make(ps):
            return torch.optim.SGD(ps, lr=0.05, momentum=0.9)
    ref, _, _ = _fresh_grad_run(make, False, fold, device)
    out, o, stash = _fresh_grad_run(make, True, fold, device)
    for k, (a, b) in enumerate(zip(out, ref)):
        assert torch.equal(a.cpu(), b.cpu()), f"param {k}"
    combined = stash.combined
    if kind == "apex":
        sets = [s for g in o._groups.values() for s in g.sets]
        assert sets and not any(s.has_grad_buffer for s in sets)
        assert o.recombine_count <= 1
    assert combined.buffers is None


@pytest.mark.parametrize("kind", ["torch", "apex"])
def test_fresh_then_kept_grads_are_combined_once(kind):
    """Steps with grads set to None, then steps with grads zeroed in place, then None again: kept grads are
    combined into the flat buffers once (they are then the slot views), fresh ones read where they are; the bits
    equal an uncombined run's."""
    def run(combine):
        m = net()
        o = apex_adam(m.parameters()) if kind == "apex" else torch.optim.SGD(m.parameters(), lr=0.05,
                                                                               momentum=0.9)
        amp.initialize(m, o, opt_level="O1", combine_grad=combine or None, verbosity=0)
        bound = []
        for step, (x, y) in enumerate(data(6, seed=4)):
            o.zero_grad(set_to_none=step not in (2, 3))
            with amp.scale_loss(loss_of(m, x, y), o) as scaled:
                scaled.backward()
            if combine:
                flats = o._amp_stash.combined.flat_buffers()
                bound.append(bool(flats) and all(storage(p.grad) == storage(flats[0]) for p in m.parameters()))
            o.step()
        out = [p.detach().clone() for p in m.parameters()]
        amp.deinitialize()
        return out, bound

    ref, _ = run(False)
    out, bound = run(True)
    assert bound == [False, False, True, True, False, False]
    for k, (a, b) in enumerate(zip(out, ref)):
        assert torch.equal(a, b), f"param {k}"


# ---------------------------------------------------------------- O2: zeroing one of several models mid-accumulation
def _two_models():
    torch.manual_seed(3)
    return torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)


_PARTIAL_PATTERNS = {
    # per optimizer step: the micro-batches, each "real" (unscaled at exit) or "delay" (delay_unscale), and after
    # which micro-batch model A alone is zeroed (model B's grads accumulate over the step's micro-batches)
    "real-zeroA-real": (("real", "real"), 0),
    "delay-zeroA-real": (("delay", "real"), 0),
    "real-delay-zeroA-real": (("real", "delay", "real"), 1),
    "real-real-zeroA-real": (("real", "real", "real"), 1),
}


def _partial_zero_run(pattern, combine, steps=2):
    kinds, zero_after = _PARTIAL_PATTERNS[pattern]
    a, b = _two_models()
    o = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    (a, b), o = amp.initialize([a, b], o, opt_level="O2", combine_grad=combine, loss_scale=128.0, verbosity=0,
                               cast_model_outputs=torch.float32)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for k, kind in enumerate(kinds):
            x = torch.randn(5, 4, generator=g)
            with amp.scale_loss(b(a(x.to(LOW))).pow(2).sum(), o, delay_unscale=kind == "delay") as scaled:
                scaled.backward()
            if k == zero_after:
                a.zero_grad()
        o.step()
        o.zero_grad()
    return [p.detach().clone() for p in amp.master_params(o)]


def _partial_zero_reference(pattern, steps=2):
    kinds, zero_after = _PARTIAL_PATTERNS[pattern]
    a, b = _two_models()
    o = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for k, _kind in enumerate(kinds):
            b(a(torch.randn(5, 4, generator=g))).pow(2).sum().backward()
            if k == zero_after:
                a.zero_grad()
        o.step()
        o.zero_grad()
    return [p.detach().clone() for p in o.param_groups[0]["params"]]


@pytest.mark.parametrize("pattern", list(_PARTIAL_PATTERNS))
def test_o2_zeroing_one_model_mid_accumulation_drops_only_its_master_grads(pattern):
    """Two models, one optimizer; ``a.zero_grad()`` between micro-batches: a's masters keep only the later
    micro-batches' grads, b's the whole step's, with combined master grads as without (fp32 torch reference,
    bf16 model: atol 2e-2; keeping a's earlier grads moves its masters by 0.1 or more here)."""
    ref = _partial_zero_reference(pattern)
    plain = _partial_zero_run(pattern, combine=None)
    amp.deinitialize()
    combined = _partial_zero_run(pattern, combine=True)
    for k, (p, q, r) in enumerate(zip(combined, plain, ref)):
        torch.testing.assert_close(p, r, rtol=0, atol=2e-2, msg=lambda m, k=k: f"master {k} vs torch: {m}")
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"master {k} vs plain O2: {m}")


@pytest.mark.parametrize("opt", ["sgd", "apex"])
def test_unused_param_under_o2_after_a_state_dict_roundtrip(opt):
    """A state_dict round trip between iterations rebuilds the buffers; a branch the next backward leaves out
    still gets no master grad (the leftover zeroed model grads are not counted as written): the same params as
    without combine_grad."""
    import copy

    results = []
    for combine in (None, True):
        torch.manual_seed(0)
        m = TwoBranch()
        o = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) if opt == "sgd"
             else apex_adam(m.parameters()))
        m, o = amp.initialize(m, o, opt_level="O2", combine_grad=combine, verbosity=0)
        x = torch.randn(8, 4).to(LOW)
        for k, use_b in enumerate((True, False, False)):
            with amp.scale_loss(m(x, use_b).float().sum(), o) as scaled:
                scaled.backward()
            o.step()
            o.zero_grad()
            if k == 0:
                o.load_state_dict(copy.deepcopy(o.state_dict()))
        results.append([p.detach().clone() for p in amp.master_params(o)])
        amp.deinitialize()
    for p, q in zip(*results):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
