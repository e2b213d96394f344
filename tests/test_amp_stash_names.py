"""Upstream amp's per-optimizer internals that training code calls: the O2 resume recipe
(``_lazy_init_maybe_master_weights()``, ``_amp_stash.lazy_init_called = True``, ``load_state_dict``, then the saved
masters copied into ``amp.master_params``), the master/model lists of ``_amp_stash`` used to name the masters, and
``_master_params_to_model_params()``.

Resumed runs are compared bit for bit with the uninterrupted run; the lists are checked against the model's params.
"""

from __future__ import annotations

import io

import pytest
import torch
from _amp_harness import amp_steps

import apex.optimizers as O
from apex import amp

pytestmark = pytest.mark.usefixtures("amp_env")

MAKERS = {
    "NpuFusedAdam": lambda params: O.NpuFusedAdam(params, lr=1e-2),
    "FusedAdam": lambda params: O.FusedAdam(params, lr=1e-2),
    "torch.Adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "torch.SGD": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.ReLU(),
                               torch.nn.Linear(12, 3))


def _groups(model):
    """Two groups, as BERT-style scripts build them: no weight decay for biases and norms."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": decay}, {"params": rest}]


def _saved_run(opt_name, **kw):
    """Two steps, the checkpoint upstream's examples write, then two more steps (the uninterrupted run)."""
    model = _net()
    optimizer = MAKERS[opt_name](_groups(model))
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0, **kw)
    amp_steps(model, optimizer, 0, 2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "master params": list(amp.master_params(optimizer)), "amp": amp.state_dict()}, buf)
    amp_steps(model, optimizer, 2, 4)
    expected = [p.detach().clone() for p in model.parameters()]
    amp.deinitialize()
    buf.seek(0)
    return torch.load(buf, weights_only=True), expected


@pytest.mark.parametrize("order", ["load-lazy-load", "lazy-load"])
@pytest.mark.parametrize("source", ["ours", "upstream-shaped"])
@pytest.mark.parametrize("combine_grad", [False, True], ids=["plain", "combined"])
@pytest.mark.parametrize("opt_name", list(MAKERS))
def test_upstream_o2_resume_recipe_continues_bit_for_bit(opt_name, combine_grad, source, order):
    """The recipe NVIDIA's BERT scripts and others use to resume O2 runs. "load-lazy-load" loads the optimizer
    once before the lazy init and again after it, as some of them do. An upstream-shaped checkpoint has neither
    the masters nor the loss scalers in the optimizer's state dict: the recipe's copy of the saved masters and
    amp.load_state_dict restore them."""
    ck, expected = _saved_run(opt_name, combine_grad=combine_grad)
    if source == "upstream-shaped":
        ck["optimizer"] = {k: v for k, v in ck["optimizer"].items() if not k.startswith("apex_amp_")}
    model = _net(seed=7)
    optimizer = MAKERS[opt_name](_groups(model))
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0, combine_grad=combine_grad)
    model.load_state_dict(ck["model"])
    if order == "load-lazy-load":
        optimizer.load_state_dict(ck["optimizer"])
    optimizer._lazy_init_maybe_master_weights()
    optimizer._amp_stash.lazy_init_called = True
    optimizer.load_state_dict(ck["optimizer"])
    for param, saved in zip(amp.master_params(optimizer), ck["master params"]):
        param.data.copy_(saved.data)
    amp.load_state_dict(ck["amp"])
    amp_steps(model, optimizer, 2, 4)
    got = list(model.parameters())
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)


def test_lazy_init_takes_model_weights_loaded_after_initialize():
    """Upstream built the masters from the model at its lazy init: weights loaded into the model before that
    call are what the masters hold after it (ours are synced then, not at the next backward only)."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    other = _net(seed=3)
    model.load_state_dict(other.state_dict())
    optimizer._lazy_init_maybe_master_weights()
    stash = optimizer._amp_stash
    for model_param, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        assert torch.equal(master, model_param.float())
    assert stash.lazy_init_called
    assert optimizer._amp_lazy_init() is None


@pytest.mark.parametrize("combine_grad", [False, True], ids=["plain", "combined"])
def test_stash_lists_pair_each_model_param_with_its_master(combine_grad):
    """``all_fp16_params`` and ``all_fp32_from_fp16_params`` pair up in order (code maps the masters to the
    model's param names through them); fp32 params (the BatchNorm O2 keeps fp32) are their own masters; the
    per-group lists follow the optimizer's groups."""
    model = _net()
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = O.NpuFusedAdam(_groups(model), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0, combine_grad=combine_grad)
    amp_steps(model, optimizer, 0, 1)
    stash = optimizer._amp_stash
    low = stash.all_fp16_params
    masters = stash.all_fp32_from_fp16_params
    assert [names[id(p)] for p in low] == ["0.weight", "3.weight", "0.bias", "3.bias"]
    assert all(p.dtype in (torch.float16, torch.bfloat16) for p in low)
    for model_param, master in zip(low, masters):
        assert master.dtype == torch.float32 and master.shape == model_param.shape
        assert torch.equal(master.to(model_param.dtype), model_param)
    assert [names[id(p)] for p in stash.all_fp32_from_fp32_params] == ["1.weight", "1.bias"]
    assert [len(g) for g in stash.fp16_groups] == [2, 2]
    assert [len(g) for g in stash.fp32_from_fp16_groups] == [2, 2]
    assert [len(g) for g in stash.fp32_from_fp32_groups] == [0, 2]
    optimizer_params = [p for g in optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in masters + stash.all_fp32_from_fp32_params} == {id(p) for p in optimizer_params}


def test_stash_lists_without_master_weights():
    """O1 (no master weights): the model's fp32 params are the optimizer's, listed as ``all_fp32_params``."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    stash = optimizer._amp_stash
    assert stash.all_fp16_params == []
    assert [id(p) for p in stash.all_fp32_params] == [id(p) for p in model.parameters()]
    optimizer._lazy_init_maybe_master_weights()  # nothing to build
    assert not hasattr(optimizer, "_master_params_to_model_params")  # upstream defines it under master weights only


@pytest.mark.parametrize("opt_name", ["NpuFusedAdam", "torch.Adam"])
def test_master_params_to_model_params_copies_now_and_is_kept(opt_name):
    """Masters written by the user reach the model at the call; the next backward does not take the model's
    older weights back into the masters."""
    model = _net()
    optimizer = MAKERS[opt_name](model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    amp_steps(model, optimizer, 0, 1)
    with torch.no_grad():
        for master in amp.master_params(optimizer):
            master.add_(0.5)
    written = [m.detach().clone() for m in amp.master_params(optimizer)]
    optimizer._master_params_to_model_params()
    stash = optimizer._amp_stash
    for model_param, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        assert torch.equal(model_param, master.to(model_param.dtype))
    x = torch.randn(16, 6)
    with amp.scale_loss(model(x.to(torch.float32)).float().sum(), optimizer) as scaled:
        scaled.backward()
    assert all(torch.equal(m, w) for m, w in zip(amp.master_params(optimizer), written))


def test_names_go_with_the_session():
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    assert callable(optimizer._lazy_init_maybe_master_weights)
    amp.deinitialize()
    for name in ("_lazy_init_maybe_master_weights", "_amp_lazy_init", "_master_params_to_model_params"):
        assert not hasattr(optimizer, name)
