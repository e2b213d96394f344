"""A model amp prepared, compiled with ``torch.compile`` after ``amp.initialize``: its forward (amp's input and
output casts around the model's own, under autocast at O1) traces into one graph, with no graph break and no
recompilation from one call to the next, and computes what the eager model computes. The backend is dynamo's
"eager" (no code generation), which checks the tracing alone."""

from __future__ import annotations

import pytest
import torch

from apex import amp
from apex.optimizers import NpuFusedAdamW

dynamo = pytest.importorskip("torch._dynamo")


@pytest.fixture(autouse=True)
def _env(amp_env):
    dynamo.reset()
    yield
    dynamo.reset()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_compiled_amp_model_traces_once_and_matches_eager(level):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    opt = NpuFusedAdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    compiled = torch.compile(model, backend="eager")
    counters.clear()
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):  # new input tensors each call, as a training loop passes them
        x = torch.randn(5, 8, generator=gen)
        with amp.scale_loss(compiled(x).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    x = torch.randn(5, 8, generator=gen)
    assert torch.equal(compiled(x), model(x))
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] <= 2  # train and eval mode: one graph each


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("combine", [None, True])
def test_compiled_training_step_matches_eager(level, combine):
    """A whole training step under ``torch.compile`` (forward, ``scale_loss`` and its backward, ``step``,
    ``zero_grad``): amp's and the optimizer's bookkeeping run eagerly where the graph breaks, and the trained
    weights have the eager run's bits."""
    results = []
    for compiled in (False, True):
        amp.deinitialize()
        dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4))
        opt = NpuFusedAdamW(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level=level, combine_grad=combine, verbosity=0)

        def train(x, model=model, opt=opt):
            loss = model(x).float().pow(2).mean()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()

        run = torch.compile(train, backend="eager") if compiled else train
        for i in range(4):
            run(torch.randn(5, 8, generator=torch.Generator().manual_seed(i)))
        results.append([p.detach().clone() for p in model.parameters()])
    for eager, traced in zip(*results):
        assert torch.equal(eager, traced)
