"""Convergence (full tier): a small CNN and a small transformer trained 200 steps on CPU.

Criterion: the fp32 run's loss drops to at most half its initial value, and each
mixed-precision run ends within 5% (relative L1) of the fp32 run's final loss. Losses are measured on
a fixed evaluation set in fp32 through the model's (amp-patched) forward. Runs: O1 and O2, bf16 and
fp16; torch's Adam without and with combine_grad, apex's NpuFusedAdam (which always combines) with it.
"""

from __future__ import annotations

import pytest
import torch

from apex import amp

pytestmark = [pytest.mark.full, pytest.mark.usefixtures("amp_env")]

STEPS = 200


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.features(x))


class SmallTransformer(torch.nn.Module):
    def __init__(self, vocab=32, d=64, seq=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.pos))


def noisy_labels(y, classes, g):
    """A quarter of the labels random: the loss settles on a floor instead of racing to zero,
    so "within 5%" compares converged losses rather than rounding noise."""
    flip = torch.rand(y.shape, generator=g) < 0.25
    return torch.where(flip, torch.randint(0, classes, y.shape, generator=g), y)


def cnn_task():
    """Noisy copies of ten prototype images; the label is the prototype."""
    g = torch.Generator().manual_seed(0)
    prototypes = torch.randn(10, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (512,), generator=g)
    x = prototypes[y] + 1.5 * torch.randn(512, 3, 8, 8, generator=g)
    return SmallCNN, x, noisy_labels(y, 10, g)


def transformer_task():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (512, 16), generator=g)
    y = (tokens * 3 + 1) % 32  # a per-token map: attention must learn to keep each position to itself
    return SmallTransformer, tokens, noisy_labels(y, 32, g)


def criterion(out, y):
    return torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def evaluate(model, x, y):
    model.train(False)
    with torch.no_grad():
        loss = criterion(model(x[:256]), y[:256]).item()
    model.train(True)
    return loss


def make_opt(params, kind):
    if kind == "apex":
        from apex.optimizers import NpuFusedAdam

        return NpuFusedAdam(params, lr=2e-3)
    return torch.optim.Adam(params, lr=2e-3)


def train(task, amp_kw=None, kind="torch"):
    make_model, x, y = task()
    torch.manual_seed(1)
    model = make_model()
    opt = make_opt(model.parameters(), kind)
    if amp_kw is not None:
        model, opt = amp.initialize(model, opt, verbosity=0, **amp_kw)
    start = evaluate(model, x, y)
    for step in range(STEPS):
        i = (step * 32) % 512
        opt.zero_grad()
        loss = criterion(model(x[i:i + 32]), y[i:i + 32])
        if amp_kw is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
    end = evaluate(model, x, y)
    if amp_kw is not None:
        amp.deinitialize()
    return start, end


_fp32_cache = {}


def fp32_final(task):
    if task not in _fp32_cache:
        start, end = train(task)
        assert end <= 0.5 * start, f"fp32 run did not converge: {start:.4f} -> {end:.4f}"
        _fp32_cache[task] = end
    return _fp32_cache[task]


@pytest.mark.parametrize("combine,kind", [(False, "torch"), (True, "torch"), (True, "apex")],
                         ids=["torch", "torch-combined", "apex-combined"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("task", [cnn_task, transformer_task], ids=["cnn", "transformer"])
def test_mixed_precision_matches_fp32(task, level, dtype, combine, kind):
    if kind == "apex":
        pytest.importorskip("apex.optimizers")
    reference = fp32_final(task)
    _, end = train(task, dict(opt_level=level, amp_dtype=dtype, combine_grad=combine or None), kind)
    assert abs(end - reference) <= 0.05 * reference, f"{level} {dtype}: {end:.4f} vs fp32 {reference:.4f}"
