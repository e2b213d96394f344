"""Copies of a model amp prepared: ``copy.deepcopy`` after ``amp.initialize`` (how timm, and most EMA helpers,
make their averaged model) gives a model that runs its own params, with amp's casts and autocast as the original,
and whose ``zero_grad`` touches only its own grads; a pickled model (``torch.save(model)``) loads and runs as amp
prepared it; the forward's signature stays the model's own; torch.nn.DataParallel's replicas (shallow copies of
the model) run their own params through amp's forward."""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch

from apex import amp
from apex.optimizers import NpuFusedAdam

LEVELS = ["O1", "O2"]


@pytest.fixture(autouse=True)
def _env(amp_env):
    yield


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def _prepared(level: str, combine=None):
    model = _model()
    opt = NpuFusedAdam(model.parameters(), lr=1e-2)
    return amp.initialize(model, opt, opt_level=level, combine_grad=combine, verbosity=0)


@pytest.mark.parametrize("combine", [None, True], ids=["plain", "combined"])
@pytest.mark.parametrize("level", LEVELS)
def test_a_deep_copy_runs_its_own_params_with_amps_casts(level, combine):
    model, _opt = _prepared(level, combine)
    x = torch.randn(5, 4)
    ema = copy.deepcopy(model)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(ema.parameters(), model.parameters()))
    assert torch.equal(ema(x), model(x))  # the same values, the same casts (output dtype included)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)  # an EMA update of the copy only
    assert not torch.equal(ema(x), model(x))
    twin = _model()  # the same arithmetic on a plain copy, amp's casts done by hand
    with torch.no_grad():
        for p, q in zip(twin.parameters(), ema.parameters()):
            p.copy_(q.float())
    twin.load_state_dict(ema.state_dict())  # BatchNorm buffers too (amp saves them as fp32)
    twin.train(ema.training)
    low = model[0].weight.dtype if level == "O2" else None
    if level == "O2":
        twin = twin.to(low)
        twin[1].float()
        expect = twin(x.to(low)).float()
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expect = twin(x)
    torch.testing.assert_close(ema(x), expect, rtol=0, atol=0)


@pytest.mark.parametrize("level", LEVELS)
def test_training_the_original_leaves_the_copy_alone_and_the_reverse(level):
    model, opt = _prepared(level)
    ema = copy.deepcopy(model)
    before = [p.detach().clone() for p in ema.parameters()]
    for _ in range(2):
        with amp.scale_loss(model(torch.randn(5, 4)).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, b) for p, b in zip(ema.parameters(), before))
    # the copy's zero_grad zeroes the copy's grads, not the original's
    ema(torch.randn(5, 4)).float().sum().backward()
    model(torch.randn(5, 4)).float().sum().backward()
    ema.zero_grad()
    assert all(p.grad is None for p in ema.parameters())
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad()  # amp's own zero_grad of the original still works
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("level", LEVELS)
def test_a_pickled_model_loads_and_runs_as_amp_prepared_it(level):
    model, _ = _prepared(level)
    x = torch.randn(5, 4)
    model.eval()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    out, got = model(x), loaded(x)
    assert got.dtype == out.dtype and torch.equal(got, out)
    loaded(x).float().sum().backward()
    loaded.zero_grad()
    assert all(p.grad is None for p in loaded.parameters())


@pytest.mark.parametrize("level", LEVELS)
def test_the_forward_signature_is_the_models_own(level):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, input_ids, attention_mask=None, labels=None):
            return self.fc(input_ids)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert list(inspect.signature(model.forward).parameters) == ["input_ids", "attention_mask", "labels"]
    assert list(inspect.signature(copy.deepcopy(model).forward).parameters) == [
        "input_ids", "attention_mask", "labels"]


def test_copies_keep_the_casts_after_the_session_ends():
    model, _ = _prepared("O2")
    ema = copy.deepcopy(model)
    amp.deinitialize()
    assert "forward" not in model.__dict__ and "zero_grad" not in model.__dict__  # the original is unpatched
    x = torch.randn(5, 4)
    assert ema(x).dtype == torch.float32  # fp32 in, low-precision params, fp32 out: the copy's casts stay
    assert "_replicate_for_data_parallel" not in model.__dict__


# -- DataParallel replicas ------------------------------------------------------------------------------------------
# torch.nn.DataParallel makes its replicas with torch.nn.parallel.replicate: a shallow copy of every module's
# __dict__ (``_replicate_for_data_parallel``) holding broadcast copies of the params. The broadcast needs an
# accelerator; these tests replace it by clones on the CPU, which keep the autograd link to the original params as
# the broadcast does, so torch's own replicate runs unchanged otherwise.


@pytest.fixture
def cpu_replicate(monkeypatch):
    import sys

    mod = sys.modules["torch.nn.parallel.replicate"]

    def broadcast(tensors, devices, detach=False):
        return [[(t.detach() if detach else t).clone() for t in tensors] for _ in devices]

    monkeypatch.setattr(mod, "_get_device_index", lambda device, optional=False: 0)
    monkeypatch.setattr(mod, "_broadcast_coalesced_reshape", broadcast)
    return lambda model, n=2: torch.nn.parallel.replicate(model, [0] * n)


@pytest.mark.parametrize("combine", [None, True], ids=["plain", "combined"])
@pytest.mark.parametrize("level", LEVELS)
def test_data_parallel_replicas_run_their_own_params_with_amps_casts(level, combine, cpu_replicate):
    model, _opt = _prepared(level, combine)
    x = torch.randn(5, 4)
    first, second = cpu_replicate(model)
    out = model(x)
    assert torch.equal(first(x), out) and first(x).dtype == out.dtype
    with torch.no_grad():
        second[0].weight.mul_(0.5)  # the replica's params are its own (on its own device, with DataParallel)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref[0].weight.mul_(0.5)
    got = second(x)
    assert got.dtype == out.dtype and torch.equal(got, ref(x)) and not torch.equal(got, out)


@pytest.mark.parametrize("level", LEVELS)
def test_data_parallel_grads_reach_the_original_params(level, cpu_replicate):
    model, opt = _prepared(level)
    x = torch.randn(6, 4)
    model.eval()  # BatchNorm's running statistics aside: the replicas and the model compute the same values
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    direct = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    replicas = cpu_replicate(model)
    # DataParallel scatters the batch, runs each replica on its share and gathers the outputs
    loss = torch.cat([r(part) for r, part in zip(replicas, x.chunk(2))]).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    for p, d in zip(model.parameters(), direct):
        torch.testing.assert_close(p.grad, d, rtol=1e-2, atol=1e-3)  # the batch summed in another order


@pytest.mark.parametrize("level", LEVELS)
def test_a_replicas_zero_grad_leaves_the_original_alone(level, cpu_replicate):
    model, _opt = _prepared(level)
    replica = cpu_replicate(model, 1)[0]
    assert replica.zero_grad.__self__ is replica  # the plain one: a replica is not a model of the session
    model(torch.randn(5, 4)).float().sum().backward()
    with pytest.warns(UserWarning, match="DataParallel"):  # torch's own zero_grad says it does nothing here
        replica.zero_grad()
    assert all(p.grad is not None for p in model.parameters())
    again = replica._replicate_for_data_parallel()  # replicas of a replica rebind to that replica
    assert again.forward.model is again


def test_replicas_of_a_copy_and_of_a_loaded_model_run_their_own_params(cpu_replicate):
    model, _ = _prepared("O2")
    model.eval()
    x = torch.randn(5, 4)
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    buf = io.BytesIO()
    torch.save(ema, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for source in (ema, loaded):
        replica = cpu_replicate(source, 1)[0]
        assert torch.equal(replica(x), ema(x)) and replica(x).dtype == torch.float32
        with torch.no_grad():
            replica[0].weight.zero_()
        assert not torch.equal(replica(x), source(x))  # its own params, not those of the model it came from


@pytest.mark.devices("cpu")  # with an accelerator (an emulated npu too) DataParallel wants the model on it
def test_data_parallel_without_devices_runs_the_prepared_model():
    model, _ = _prepared("O2")
    dp = torch.nn.DataParallel(model)  # no accelerator: DataParallel calls the module itself
    x = torch.randn(5, 4)
    assert torch.equal(dp(x), model(x)) and dp(x).dtype == torch.float32
