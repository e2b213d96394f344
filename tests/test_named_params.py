"""Named params, as torch.optim takes them since 2.6: ``Optimizer(model.named_parameters())`` and groups whose
``params`` are ``(name, tensor)`` pairs. Every optimizer here gives the same params bit for bit as with
``model.parameters()``, keeps the names in ``param_groups[i]["param_names"]`` and in ``state_dict()``, and
loads such a state dict; the mistakes torch refuses (a group naming some params and not others, named and
unnamed groups mixed) are refused before anything changes, and a malformed pair is named."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from _optim_harness import EVERY_OPTIMIZER

from apex import amp
from apex.optimizers import FusedAdam, Lamb, NpuFusedAdamW

CLASSES = sorted(EVERY_OPTIMIZER, key=lambda c: c.__name__)
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(device)


def _train(model, opt, device: str, steps: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=gen).to(device)
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_named_params_train_as_plain_ones_and_keep_their_names(device, cls):
    named, plain = _model(device), _model(device)
    opt_named = cls(named.named_parameters(), lr=1e-2)
    opt_plain = cls(plain.parameters(), lr=1e-2)
    assert opt_named.param_groups[0]["param_names"] == NAMES
    assert all(isinstance(p, torch.Tensor) for p in opt_named.param_groups[0]["params"])
    assert torch.equal(_train(named, opt_named, device), _train(plain, opt_plain, device))
    sd = opt_named.state_dict()
    assert sd["param_groups"][0]["param_names"] == NAMES

    # a fresh optimizer over the same named params resumes bit for bit
    resumed, twin = copy.deepcopy(named), copy.deepcopy(named)
    opt_resumed = cls(resumed.named_parameters(), lr=1e-2)
    opt_resumed.load_state_dict(sd)
    opt_twin = cls(twin.named_parameters(), lr=1e-2)
    opt_twin.load_state_dict(copy.deepcopy(opt_named.state_dict()))
    assert opt_resumed.param_groups[0]["param_names"] == NAMES
    assert torch.equal(_train(resumed, opt_resumed, device, 2), _train(twin, opt_twin, device, 2))


@pytest.mark.parametrize("cls", [NpuFusedAdamW, FusedAdam, Lamb], ids=lambda c: c.__name__)
def test_named_groups_with_their_own_options(cls):
    named, plain = _model("cpu"), _model("cpu")
    opt_named = cls([{"params": list(named[0].named_parameters())},
                     {"params": list(named[2].named_parameters()), "lr": 5e-2}], lr=1e-2)
    opt_plain = cls([{"params": list(plain[0].parameters())},
                     {"params": list(plain[2].parameters()), "lr": 5e-2}], lr=1e-2)
    assert [g["param_names"] for g in opt_named.param_groups] == [["weight", "bias"], ["weight", "bias"]]
    assert torch.equal(_train(named, opt_named, "cpu"), _train(plain, opt_plain, "cpu"))


@pytest.mark.parametrize("cls", [NpuFusedAdamW, FusedAdam, Lamb], ids=lambda c: c.__name__)
def test_naming_mistakes_are_refused_and_change_nothing(cls):
    model = _model("cpu")
    w, b = model[0].weight, model[0].bias
    opt = cls([("2.weight", model[2].weight)], lr=1e-2)
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises(ValueError, match="with/without names"):  # one group naming some params only
        opt.add_param_group({"params": [("0.weight", w), b]})
    unnamed = {"params": [w, b], "lr": np.float32(0.5)}
    with pytest.raises(ValueError, match="with/without names"):  # an unnamed group beside a named one
        opt.add_param_group(unnamed)
    assert type(unnamed["lr"]) is np.float32  # refused before anything in the group was rewritten
    with pytest.raises(TypeError, match=r"param 0 is a pair whose name is int"):
        opt.add_param_group({"params": [(0, w), (1, b)]})
    with pytest.raises(TypeError, match=r"param 1 is a tuple of 3"):
        opt.add_param_group({"params": [("a", w), ("b", b, "extra")]})
    with pytest.raises(TypeError, match=r"must be tensors|can only optimize Tensors"):
        opt.add_param_group({"params": [("a", w), ("b", 3.0)]})
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == [model[2].weight]
    with pytest.raises(ValueError, match="with/without names"):
        cls([("0.weight", w), b], lr=1e-2)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("combine", [None, True], ids=["plain", "combined"])
def test_amp_with_named_params(amp_env, opt_level, combine):
    """amp keeps the names of the groups it rebuilds (O2's fp32 masters) and trains as with plain params."""
    out = []
    for named in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
        opt = NpuFusedAdamW(model.named_parameters() if named else model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level=opt_level, combine_grad=combine, verbosity=0)
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            with amp.scale_loss(model(torch.randn(5, 3, generator=gen)).float().sum(), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
        if named:
            assert opt.state_dict()["param_groups"][0]["param_names"] == [
                "0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
        out.append(torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]))
        amp.deinitialize()
    assert torch.equal(out[0], out[1])


def test_every_exported_optimizer_is_covered():
    import apex.optimizers as ao

    exported = {getattr(ao, n) for n in ao.__all__ if isinstance(getattr(ao, n), type)
                and issubclass(getattr(ao, n), torch.optim.Optimizer) and getattr(ao, n) is not ao.CombinedOptimizer}
    assert exported == set(EVERY_OPTIMIZER)
