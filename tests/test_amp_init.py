"""amp.init's handle (scale_loss, wrap_optimizer, cache, deactivation), the no-op handle, and the upstream
``_amp_state`` fields (handle, allow_incoming_model_not_fp32, loss-scale bounds)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from apex import amp
from apex.amp._amp_state import _amp_state


@pytest.fixture(autouse=True)
def _env(amp_env):
    yield


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def fp32_grads(model, x):
    """float64 reference grads of the same loss."""
    ref = tiny().double()
    ref.load_state_dict(model.state_dict())
    ref(x.double()).float().sum().backward()
    return [p.grad for p in ref.parameters()]


# ------------------------------------------------------------------------------------------- init arguments


@pytest.mark.parametrize("kw,exc", [
    (dict(enabled="yes"), TypeError), (dict(enable_caching=1), TypeError), (dict(verbose=None), TypeError),
    (dict(allow_banned=0), TypeError), (dict(loss_scale=-1.0), ValueError), (dict(loss_scale="static"), ValueError),
    (dict(loss_scale=float("inf")), ValueError), (dict(patch_type=torch.float32), ValueError),
])
def test_bad_arguments_raise_and_change_nothing(kw, exc):
    linear = torch.nn.functional.linear
    with pytest.raises(exc):
        amp.init(**kw)
    assert torch.nn.functional.linear is linear
    assert _amp_state.handle is None


def test_handle_properties():
    handle = amp.init(enable_caching=False, verbose=True)
    assert _amp_state.handle is handle
    assert handle.is_active() and handle.verbose and not handle.has_cache
    handle._deactivate()
    handle = amp.init()
    assert handle.has_cache and not handle.verbose
    handle._deactivate()


def test_verbose_logs_each_cast(caplog):
    handle = amp.init(verbose=True)
    with caplog.at_level("INFO", logger="apex.amp"):
        torch.nn.functional.linear(torch.randn(2, 3), torch.randn(3, 3))
    handle._deactivate()
    assert any("linear (half cast)" in r.getMessage() for r in caplog.records)


def test_disabled_init_is_a_noop_handle():
    linear = torch.nn.functional.linear
    handle = amp.init(enabled=False)
    assert isinstance(handle, amp.NoOpHandle) and not handle.is_active() and not handle.has_cache
    assert torch.nn.functional.linear is linear
    loss = torch.tensor(3.0, requires_grad=True)
    opt = torch.optim.SGD([loss], lr=0.1)
    with handle.scale_loss(loss, opt) as scaled:
        assert scaled is loss
    wrapped = handle.wrap_optimizer(opt)
    with wrapped.scale_loss(loss) as scaled:
        assert scaled is loss
        scaled.backward()
    wrapped.step()
    assert loss.item() == pytest.approx(2.9)
    handle._deactivate()


# ------------------------------------------------------------------------------------------- scale_loss


def test_scale_loss_unscales_and_accumulates():
    handle = amp.init(loss_scale=128.0)
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(3, 4)
    refs = fp32_grads(model, x)
    for _ in range(2):  # two backwards without zeroing: the grads add up, each unscaled once
        with handle.scale_loss(model(x).float().sum(), opt) as scaled:
            assert scaled.item() == pytest.approx(128.0 * model(x).float().sum().item(), rel=1e-2)
            scaled.backward()
    for p, r in zip(model.parameters(), refs):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.double(), 2 * r, rtol=1e-2, atol=1e-2)
    handle._deactivate()


def test_scale_loss_unscales_uncoalesced_sparse_grads():
    """An Embedding(sparse=True) grad is uncoalesced (one row entry per lookup): it is unscaled as it is, not
    through a coalesced copy that would leave the grad itself scaled."""
    handle = amp.init(loss_scale=1024.0)
    emb = nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.0)
    idx = torch.tensor([1, 1, 2])
    for k in range(2):  # the second backward accumulates onto the first's (unscaled) sparse grad
        with handle.scale_loss(emb(idx).sum(), opt) as scaled:
            scaled.backward()
        g = emb.weight.grad
        assert g.is_sparse
        dense = g.to_dense()
        torch.testing.assert_close(dense[1], torch.full((3,), 2.0 * (k + 1)), rtol=0, atol=0)
        torch.testing.assert_close(dense[2], torch.full((3,), 1.0 * (k + 1)), rtol=0, atol=0)
        assert dense[0].abs().sum() == 0
    handle._deactivate()


def test_dynamic_overflow_skips_one_step_and_backs_off():
    handle = amp.init()
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scale = handle.loss_scale()
    with handle.scale_loss((w * float("inf")).sum(), opt) as scaled:
        scaled.backward()
    assert handle.loss_scale() == scale / 2
    assert "step" in opt.__dict__
    opt.step()  # skipped
    assert "step" not in opt.__dict__
    torch.testing.assert_close(w.detach(), torch.ones(2))
    opt.zero_grad()
    with handle.scale_loss(w.sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    torch.testing.assert_close(w.detach(), torch.zeros(2))
    handle._deactivate()


def test_error_inside_scale_loss_restores_earlier_grads():
    handle = amp.init()
    w = nn.Parameter(torch.ones(2))
    w.grad = torch.full((2,), 5.0)
    opt = torch.optim.SGD([w], lr=1.0)
    with pytest.raises(ValueError):
        with handle.scale_loss(w.sum(), opt):
            raise ValueError("boom")
    torch.testing.assert_close(w.grad, torch.full((2,), 5.0))
    with pytest.raises(TypeError, match="Optimizer"):
        with handle.scale_loss(w.sum(), "not an optimizer"):
            pass
    handle._deactivate()


def test_wrap_optimizer_multiple_losses():
    handle = amp.init()
    w = nn.Parameter(torch.ones(3))
    opt = handle.wrap_optimizer(torch.optim.SGD([w], lr=0.5), num_loss=2)
    assert opt.param_groups is opt._optimizer.param_groups  # everything else is the optimizer's
    for loss in (w.sum(), (2 * w).sum()):
        with opt.scale_loss(loss) as scaled:
            scaled.backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 3.0))
    with pytest.raises(RuntimeError, match="num_loss=2"):
        with opt.scale_loss(w.sum()):
            pass
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((3,), -0.5))
    # an overflow in either loss skips the step; only that loss's scaler backs off
    opt.zero_grad()
    with opt.scale_loss(w.sum()) as scaled:
        scaled.backward()
    with opt.scale_loss((w * float("inf")).sum()) as scaled:
        scaled.backward()
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((3,), -0.5))
    assert opt._loss_scaler[1].loss_scale() == opt._loss_scaler[0].loss_scale() / 2
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(ValueError, match="num_loss"):
        handle.wrap_optimizer(opt._optimizer, num_loss=0)
    handle._deactivate()


# ------------------------------------------------------------------------------------------- cast cache


class Twice(nn.Module):
    """Uses its weight in two matmuls: with caching it is cast once."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x.mm(self.weight).mm(self.weight)


def test_weight_cast_once_per_iteration_and_cleared_by_scale_loss():
    handle = amp.init(loss_scale=1.0)
    model = Twice()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    out = model(x)
    assert out.dtype == torch.float16 and len(handle.cache) == 1
    with handle.scale_loss(out.float().sum(), opt) as scaled:
        scaled.backward()
    assert len(handle.cache) == 0
    w = model.weight.detach().double()
    ref_w = w.clone().requires_grad_()
    x.double().mm(ref_w).mm(ref_w).sum().backward()
    torch.testing.assert_close(model.weight.grad.double(), ref_w.grad, rtol=2e-2, atol=2e-2)
    handle._deactivate()


def test_cache_not_reused_after_in_place_change_or_from_no_grad():
    handle = amp.init()
    model = Twice()
    x = torch.randn(2, 4)
    with torch.no_grad():
        model(x)  # an eval pass fills the cache with casts that have no graph
    out = model(x)  # a training forward must not reuse them
    out.float().sum().backward()
    assert model.weight.grad is not None
    first = handle.cache.cast(model.weight, torch.float16)
    with torch.no_grad():
        model.weight.add_(1.0)  # an in-place update moves the version counter
    second = handle.cache.cast(model.weight, torch.float16)
    assert second is not first
    torch.testing.assert_close(second.float(), model.weight.detach().half().float())
    handle._deactivate()


def test_without_caching_nothing_is_cached():
    handle = amp.init(enable_caching=False)
    Twice()(torch.randn(2, 4))
    assert len(handle.cache) == 0
    handle._deactivate()


# ------------------------------------------------------------------------------------------- _amp_state fields


def test_amp_state_fields_exist_with_upstream_defaults():
    for name in ("handle", "allow_incoming_model_not_fp32", "opt_properties", "verbosity", "loss_scalers",
                 "min_loss_scale", "max_loss_scale", "hard_override"):
        assert hasattr(_amp_state, name), name
    assert _amp_state.allow_incoming_model_not_fp32 is False


def test_initialize_records_handle_and_bounds():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", min_loss_scale=1.0, max_loss_scale=2.0**20,
                                verbosity=0)
    assert _amp_state.min_loss_scale == 1.0 and _amp_state.max_loss_scale == 2.0**20
    handle = _amp_state.handle
    assert handle.is_active()
    low = _amp_state.session.low_dtype
    assert model(torch.randn(2, 4)).dtype == low
    handle._deactivate()  # O1's casts stop; loss scaling keeps working
    assert not handle.is_active()
    assert model(torch.randn(2, 4)).dtype == torch.float32
    with amp.scale_loss(model(torch.randn(2, 4)).sum(), opt) as scaled:
        scaled.backward()
    opt.step()


def test_allow_incoming_model_not_fp32():
    model = tiny().half()
    with pytest.raises(RuntimeError, match=r"expected torch\.float32"):
        amp.initialize(model, opt_level="O1", verbosity=0)
    _amp_state.allow_incoming_model_not_fp32 = True
    try:
        amp.initialize(model, opt_level="O1", verbosity=0)
    finally:
        _amp_state.allow_incoming_model_not_fp32 = False


class WeightOps(nn.Module):
    """A weight of a given dtype used by half-, float- or promote-listed ops."""

    def __init__(self, kind, dtype):
        super().__init__()
        shape = (8, 8) if kind == "half" else (2, 8)
        self.weight = nn.Parameter(torch.arange(shape[0] * shape[1], dtype=dtype).view(shape) / 16)
        self.kind = kind

    def ops(self, x, w):
        if self.kind == "half":
            return x.mm(w).mm(w).sum()
        if self.kind == "float":
            return (x + torch.pow(w, 2) + torch.pow(w, 2)).sum()
        return ((x * w) * w).sum()

    def forward(self, x):
        return self.ops(x, self.weight)


@pytest.mark.parametrize("kind", ["half", "float", "promote"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_initialize_o1_train_eval_train(kind, dtype):
    """O1 through amp.initialize with a weight of either dtype: grads stay right across an eval pass."""
    model = WeightOps(kind, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    _amp_state.allow_incoming_model_not_fp32 = True
    try:
        model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0, amp_dtype=torch.float16)
    finally:
        _amp_state.allow_incoming_model_not_fp32 = False
    x = torch.ones(2, 8)

    def step():
        model.weight.grad = None
        loss = model(x).sum()
        _amp_state.loss_scalers[0]._loss_scale = 4.0
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        assert model.weight.grad.dtype == model.weight.dtype
        w = model.weight.detach().double().requires_grad_()
        model.ops(x.double(), w).backward()
        torch.testing.assert_close(model.weight.grad.double(), w.grad, rtol=2e-3, atol=1e-3)
        model.weight.data -= 1.0 / 16

    step()
    with torch.no_grad():
        model(x)
    step()
    _amp_state.handle._deactivate()
