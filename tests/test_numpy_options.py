"""Numpy scalars as options: what indexing a numpy array gives (``lrs[i]``, ``np.float32(x)``, ``np.int64(n)``)
is taken wherever a Python number is, as torch.optim takes it, and computes exactly as the Python number it
holds: the same params bit for bit, in every optimizer and executor. A numpy float32 left in a group would make
our own host arithmetic (``1 - beta``, bias corrections) run in float32, so a step that passed its checks rewrites
such options as Python numbers; a step that fails its checks leaves them as they were. Numpy arrays (even of one
element) and numpy bools are refused with the option's name, as torch's ops refuse them."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from _optim_harness import EVERY_OPTIMIZER

from apex import amp
from apex._checks import plain_numbers, real_number
from apex.fp16_utils import DynamicLossScaler, LossScaler
from apex.optimizers import FusedAdam, Lamb, NpuFusedAdam, NpuFusedSGD
from apex.parallel.LARC import LARC

OPTIONS = EVERY_OPTIMIZER
CLASSES = sorted(OPTIONS, key=lambda c: c.__name__)
EXECUTORS = ("auto", "torch", "torch_ops")


def _as(kind, options: dict) -> dict:
    """``options`` with every number as ``kind`` makes it: "numpy" (float32 / int64 scalars) or "python" (the
    Python number each numpy scalar holds)."""
    def one(v):
        if isinstance(v, bool):
            return v
        if isinstance(v, int):
            return np.int64(v) if kind == "numpy" else v
        return np.float32(v) if kind == "numpy" else float(np.float32(v))
    return {k: tuple(map(one, v)) if isinstance(v, tuple) else one(v) for k, v in options.items()}


def _run(cls, options: dict, executor: str, device: str, steps: int = 3):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in ((5, 3), (7,), (33,), (2, 40))]
    opt = cls([{"params": params[:2]}, {"params": params[2:]}], **options)
    if hasattr(opt, "executor"):
        opt.executor = executor
    for t in range(steps):
        g = torch.Generator().manual_seed(10 + t)
        for k, p in enumerate(params):
            # param 1 gets no grad in the middle step; torch's default zero_grad between steps
            p.grad = None if (t == 1 and k == 1) else torch.randn(p.shape, generator=g).to(device)
        opt.step()
        opt.zero_grad()
    return opt, torch.cat([p.detach().reshape(-1).cpu() for p in params])


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_numpy_options_compute_as_the_numbers_they_hold(device, cls, executor):
    if executor != "auto" and cls is Lamb:
        pytest.skip("Lamb has one executor (torch ops)")
    opt, ours = _run(cls, _as("numpy", OPTIONS[cls]), executor, device)
    _, ref = _run(cls, _as("python", OPTIONS[cls]), executor, device)
    assert torch.equal(ours, ref)
    for group in opt.param_groups:  # rewritten as Python numbers by the first step that passed its checks
        for key, value in group.items():
            if key != "params":
                assert not isinstance(value, np.generic), (key, type(value))
                assert not any(isinstance(v, np.generic) for v in value) if isinstance(value, tuple) else True


@pytest.mark.parametrize("cls", [NpuFusedAdam, FusedAdam, Lamb], ids=lambda c: c.__name__)
def test_a_scheduler_writing_numpy_values_between_steps(device, cls):
    """A schedule held in a numpy array: ``group["lr"] = lrs[t]`` before each step, as the Python values."""
    lrs = np.linspace(1e-2, 1e-3, 4, dtype=np.float32)
    out = []
    for wrap in (lambda x: x, float):
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(17, generator=gen).to(device))
        opt = cls([p], lr=1e-2)
        for t in range(4):
            opt.param_groups[0]["lr"] = wrap(lrs[t])
            p.grad = torch.randn(17, generator=gen).to(device)
            opt.step()
        out.append(p.detach().cpu())
    assert torch.equal(out[0], out[1])


def test_a_step_that_fails_its_checks_leaves_numpy_options_as_they_were():
    ps = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))]
    opt = NpuFusedAdam([{"params": ps[:1]}, {"params": ps[1:]}], lr=1e-3)
    opt.param_groups[0]["lr"] = lr = np.float32(2e-3)
    opt.param_groups[0]["betas"] = betas = (np.float32(0.8), 0.9)
    ps[0].grad = torch.ones(3)
    ps[1].grad = torch.ones(4).to_sparse()  # the second group's grad fails the step's checks
    before = [p.detach().clone() for p in ps]
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert opt.param_groups[0]["lr"] is lr and opt.param_groups[0]["betas"] is betas
    assert all(torch.equal(p, b) for p, b in zip(ps, before))


@pytest.mark.parametrize("value", [np.array(1e-3), np.array([1e-3]), np.bool_(True), True, "1e-3"],
                         ids=["0-d array", "1-element array", "numpy bool", "bool", "str"])
def test_arrays_and_bools_are_refused_with_the_option_name(value):
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(TypeError, match=r"Invalid learning rate: expected a number, got "):
        NpuFusedAdam([p], lr=value)
    opt = FusedAdam([p], lr=1e-3)
    opt.param_groups[0]["lr"] = value
    p.grad = torch.ones(3)
    with pytest.raises(TypeError, match=r"Invalid learning rate: expected a number, got "):
        opt.step()
    assert opt.param_groups[0]["lr"] is value  # refused, not rewritten


def test_out_of_range_numpy_values_get_the_interval_message():
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 0: expected a value in \[0.0, 1.0\)"):
        NpuFusedAdam([torch.nn.Parameter(torch.randn(3))], betas=(np.float32(1.5), 0.9))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        NpuFusedSGD([torch.nn.Parameter(torch.randn(3))], lr=np.float64(-1.0))


@pytest.mark.parametrize("value, expected", [
    (3, 3), (2.5, 2.5), (np.int64(4), 4), (np.uint8(5), 5), (np.float32(0.5), 0.5), (np.float64(0.25), 0.25),
    (np.float16(2.0), 2.0), (Fraction(1, 4), 0.25),
])
def test_real_number_reads_real_scalars(value, expected):
    out = real_number(value)
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize("value", [True, np.bool_(False), np.array(1.0), np.array([1]), "1", None, 1j,
                                   np.complex64(1), torch.tensor(1.0)])
def test_real_number_refuses_the_rest(value):
    assert real_number(value) is None


def test_plain_numbers_rewrites_numpy_values_of_the_given_keys_only():
    params = [torch.zeros(1)]
    betas_list = [np.float32(0.5), 0.9]
    note = np.float32(3.0)
    options = {"params": params, "lr": np.float32(0.5), "betas": (np.float64(0.25), 0.75), "m": betas_list,
               "nesterov": np.bool_(True), "name": "x", "eps": 1e-8, "t": None, "user_note": note}
    plain_numbers(options, {"lr", "betas", "m", "nesterov", "name", "eps", "t"})
    assert options["params"] is params
    assert type(options["lr"]) is float and options["lr"] == 0.5
    assert options["betas"] == (0.25, 0.75) and type(options["betas"][0]) is float
    assert options["m"] == [0.5, 0.9] and isinstance(options["m"], list) and type(options["m"][0]) is float
    assert isinstance(options["nesterov"], np.bool_)  # not a number: the flag checks read its truth value
    assert options["name"] == "x" and options["eps"] == 1e-8 and options["t"] is None
    assert options["user_note"] is note  # not an option of the optimizer: left as the user set it


def test_entries_a_user_adds_to_a_group_are_left_alone():
    p = torch.nn.Parameter(torch.randn(3))
    note = np.float32(0.5)
    opt = NpuFusedAdam([{"params": [p], "lr": np.float32(1e-3), "user_note": note}])
    p.grad = torch.ones(3)
    opt.step()
    group = opt.param_groups[0]
    assert type(group["lr"]) is float and group["user_note"] is note


# ------------------------------------------------------------------ amp, LARC, fp16_utils
def test_amp_and_the_loss_scalers_take_numpy_scales(amp_env):
    model = torch.nn.Linear(4, 2)
    opt = NpuFusedSGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale=np.float32(128.0),
                                min_loss_scale=np.float64(1.0), max_loss_scale=np.int64(2**20), verbosity=0)
    with amp.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 128.0
    assert DynamicLossScaler(init_scale=np.float32(2.0**10)).loss_scale == 2.0**10
    assert LossScaler(np.int64(64)).loss_scale == 64


def test_larc_takes_numpy_options():
    out = []
    for wrap in (np.float32, lambda v: float(np.float32(v))):
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(9, generator=gen))
        base = torch.optim.SGD([p], lr=0.1, weight_decay=1e-4)
        opt = LARC(base, trust_coefficient=wrap(0.02), eps=wrap(1e-8))
        for _ in range(2):
            p.grad = torch.randn(9, generator=gen)
            opt.step()
        out.append(p.detach().clone())
    assert torch.equal(out[0], out[1])


def test_amp_init_takes_a_numpy_loss_scale(amp_env):
    handle = amp.init(loss_scale=np.float32(128.0))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with handle.scale_loss(model(torch.randn(3, 4)).float().sum(), opt) as scaled:
        assert type(handle.loss_scale()) is float and handle.loss_scale() == 128.0
        scaled.backward()
    handle._deactivate()
    with pytest.raises(ValueError, match="loss_scale must be 'dynamic' or a finite positive number"):
        amp.init(loss_scale=np.array([1.0, 2.0]))


def test_ddp_takes_a_numpy_predivide_factor(tmp_path):
    import torch.distributed as dist

    from apex.parallel import DistributedDataParallel

    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(2, 2), gradient_predivide_factor=np.float32(2.0))
        assert type(ddp.gradient_predivide_factor) is float and ddp.gradient_predivide_factor == 2.0
        with pytest.raises(TypeError, match="gradient_predivide_factor must be a positive number"):
            DistributedDataParallel(torch.nn.Linear(2, 2), gradient_predivide_factor=np.bool_(True))
    finally:
        dist.destroy_process_group()
