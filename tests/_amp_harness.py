"""Shared pieces of the amp tests (imported by tests/test_amp_*.py).

Every amp test module also uses the `amp_env` fixture of conftest.py (one intra-op thread, amp torn
down after each test).
"""

from __future__ import annotations

import torch


def bn_mlp(n_in: int, hidden: int, n_out: int) -> torch.nn.Sequential:
    """Linear -> BatchNorm1d -> ReLU -> Linear: the tiny model of the amp tests (BatchNorm: the layer
    keep_batchnorm_fp32 keeps in fp32)."""
    return torch.nn.Sequential(torch.nn.Linear(n_in, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, n_out))


def amp_steps(model: torch.nn.Module, optimizer, start: int, stop: int) -> None:
    """Seeded amp training steps ``start`` to ``stop`` (input seed = step index) on a model taking 6 features:
    zero_grad, a scaled backward of a squared-error loss, step. A resumed run replays the same inputs."""
    from apex import amp

    dtype = next(model.parameters()).dtype
    for i in range(start, stop):
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(i))
        optimizer.zero_grad()
        with amp.scale_loss((model(x.to(dtype)).float() - 1).pow(2).mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
