"""Every optimizer class of apex.optimizers with small working hyperparameters, and helpers to drive them
(shared by tests/test_state_validation.py and tests/test_api_properties.py)."""

from __future__ import annotations

import copy

import torch

import apex.optimizers as O

#: (class, constructor keywords): momentum / centered where the class has them, so every state kind exists
OPTIMIZERS = [
    (O.NpuFusedAdam, dict(lr=1e-2)),
    (O.NpuFusedAdamW, dict(lr=1e-2)),
    (O.NpuFusedAdadelta, dict(lr=1.0)),
    (O.NpuFusedAdamP, dict(lr=1e-2)),
    (O.NpuFusedBertAdam, dict(lr=1e-2)),
    (O.NpuFusedLamb, dict(lr=1e-2)),
    (O.NpuFusedRMSprop, dict(lr=1e-2, momentum=0.9, centered=True)),
    (O.NpuFusedRMSpropTF, dict(lr=1e-2, momentum=0.9)),
    (O.NpuFusedSGD, dict(lr=0.1, momentum=0.9)),
    (O.Lamb, dict(lr=1e-2)),
    (O.FusedAdagrad, dict(lr=1e-2)),
    (O.FusedAdam, dict(lr=1e-2)),
    (O.FusedLAMB, dict(lr=1e-2)),
    (O.FusedMixedPrecisionLamb, dict(lr=1e-2)),
    (O.FusedNovoGrad, dict(lr=1e-2)),
    (O.FusedSGD, dict(lr=0.1, momentum=0.9)),
]
IDS = [cls.__name__ for cls, _ in OPTIMIZERS]


def make_params(shapes=((3, 4), (5,)), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float32).to(dtype)) for s in shapes]


def feed(params, seed):
    """Deterministic grads (a function of the seed and the shapes only)."""
    g = torch.Generator().manual_seed(1000 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype)


def run(opt, params, steps, start=0):
    for i in range(start, start + steps):
        feed(params, i)
        opt.step()


def snapshot(opt):
    """A deep copy of the optimizer's state_dict (what must be unchanged after a rejected load)."""
    return copy.deepcopy(opt.state_dict())


def same_state(a, b) -> bool:
    """Two optimizer state_dicts hold equal values (tensors compared exactly, NaN-free)."""
    if type(a) is not type(b) and not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b

