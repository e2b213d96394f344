"""A GAN's training step as NVIDIA's DCGAN example writes it, against a plain torch.autocast loop.

Two models and two optimizers through one ``amp.initialize(..., num_losses=3)``; the discriminator's loss on real
data (``loss_id=0``) and on the generator's detached output (``loss_id=1``) accumulate into its grads before its
step; the generator's loss (``loss_id=2``) backpropagates through the discriminator into the generator, and only
the generator steps on it. Each model is cleared with ``model.zero_grad()`` (torch's default drops the grads) or
with ``set_to_none=False``.

At O1 the forward is torch's autocast, and a loss scale that is a power of two with no overflow multiplies every
grad exactly: amp's run equals the reference loop (autocast forward, unscaled backward, the same optimizer
classes) bit for bit. An overflow in the generator's loss skips the generator's step only; the reference skips
that step too.
"""

from __future__ import annotations

import pytest
import torch

from apex import amp
from apex.optimizers import FusedAdam, NpuFusedAdam

ITERS = 4
LOW = torch.bfloat16


@pytest.fixture(autouse=True)
def _env(amp_env):
    yield


def _nets():
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 8),
                              torch.nn.Tanh())
    disc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 16),
                               torch.nn.BatchNorm1d(16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1))
    return gen, disc


def _batch(it: int):
    g = torch.Generator().manual_seed(100 + it)
    return torch.randn(6, 8, generator=g), torch.randn(6, 5, generator=g)


def _optimizers(opt_cls, gen, disc):
    return (opt_cls(disc.parameters(), lr=2e-3, betas=(0.5, 0.999)),
            opt_cls(gen.parameters(), lr=2e-3, betas=(0.5, 0.999)))


def _zero(model, set_to_none: bool) -> None:
    model.zero_grad(set_to_none=set_to_none)


def _train(opt_cls, set_to_none: bool, use_amp: bool, overflow_at=None, combine=None, level="O1"):
    """The DCGAN iteration, under amp at ``level`` or (``use_amp`` False) as a plain torch.autocast loop; returns
    both models' params, the losses seen and the two optimizers. ``overflow_at``: the iteration whose generator
    loss is made inf (amp skips the generator's step; the reference leaves that step out)."""
    gen, disc = _nets()
    opt_d, opt_g = _optimizers(opt_cls, gen, disc)
    crit = torch.nn.BCEWithLogitsLoss()
    if use_amp:
        [disc, gen], [opt_d, opt_g] = amp.initialize([disc, gen], [opt_d, opt_g], opt_level=level, num_losses=3,
                                                     amp_dtype=LOW, combine_grad=combine, verbosity=0)

    def forward(model, x):
        if use_amp:
            return model(x)
        with torch.autocast("cpu", dtype=LOW):
            return model(x)

    def backward(loss, opt, loss_id):
        if use_amp:
            with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                scaled.backward()
        else:
            loss.backward()

    losses = []
    for it in range(ITERS):
        real, noise = _batch(it)
        ones, zeros = torch.ones(6), torch.zeros(6)
        _zero(disc, set_to_none)
        err_real = crit(forward(disc, real).view(-1).float(), ones)
        backward(err_real, opt_d, 0)
        fake = forward(gen, noise)
        err_fake = crit(forward(disc, fake.detach()).view(-1).float(), zeros)
        backward(err_fake, opt_d, 1)
        opt_d.step()

        _zero(gen, set_to_none)
        err_g = crit(forward(disc, fake).view(-1).float(), ones)
        if it == overflow_at:
            err_g = err_g * float("inf")
        if use_amp or it != overflow_at:
            backward(err_g, opt_g, 2)
            opt_g.step()
        losses.append((err_real.item(), err_fake.item(), err_g.item()))
    return [p.detach().clone() for p in (*disc.parameters(), *gen.parameters())], losses, (opt_d, opt_g)


@pytest.mark.parametrize("combine", [None, True], ids=["plain", "combined"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads-dropped", "grads-kept"])
@pytest.mark.parametrize("opt_cls", [FusedAdam, NpuFusedAdam, torch.optim.Adam], ids=lambda c: c.__name__)
def test_o1_gan_step_equals_the_autocast_loop(opt_cls, set_to_none, combine):
    if combine and opt_cls is torch.optim.Adam:
        pytest.skip("combine_grad rebinds the grads of apex optimizers")
    ref, ref_losses, _ = _train(opt_cls, set_to_none, use_amp=False)
    got, losses, _ = _train(opt_cls, set_to_none, use_amp=True, combine=combine)
    assert losses == ref_losses
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads-dropped", "grads-kept"])
def test_an_overflow_in_the_generators_loss_skips_only_the_generators_step(set_to_none):
    ref, _, _ = _train(FusedAdam, set_to_none, use_amp=False, overflow_at=1)
    got, _, _ = _train(FusedAdam, set_to_none, use_amp=True, overflow_at=1)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    scales = [amp.state_dict()[f"loss_scaler{i}"]["loss_scale"] for i in range(3)]
    assert scales[2] == scales[0] / 2 and scales[0] == scales[1]  # only the generator's scaler backed off


@pytest.mark.parametrize("opt_cls", [FusedAdam, NpuFusedAdam], ids=lambda c: c.__name__)
def test_o2_gan_step_is_the_same_in_every_grad_mode(opt_cls):
    """O2 (low-precision models, fp32 masters): dropping the grads or keeping them, with or without combined grads,
    the models train to the same bits."""
    runs = []
    for set_to_none in (True, False):
        for combine in (None, True):
            params, _, opts = _train(opt_cls, set_to_none, use_amp=True, combine=combine, level="O2")
            runs.append([p.detach().clone() for o in opts for p in amp.master_params(o)] + params)
            amp.deinitialize()
    assert runs[0][-1].dtype == LOW  # the generator's last bias: the model trained in the low dtype
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
