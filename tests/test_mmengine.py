"""mmengine's Runner with its ``ApexOptimWrapper`` (unchanged) over this package, on the CPU.

``ApexOptimWrapper`` calls ``amp.initialize`` lazily inside its ``optim_context`` at the first
iteration and throws the returned model away, so amp has to work on the model in place; on resume
the Runner loads the optimizer state (with ``"apex_amp"``) *before* that ``initialize``. Checked: the
run trains at O1 and O2, and 2 epochs + a resumed 3rd equal 3 epochs without a stop, bit for bit,
with apex optimizers (a torch.optim optimizer under O2 rebuilds its masters from the model's
low-precision weights: close, not bitwise; docs/amp.md, Load order).

Full tier; needs ``mmengine`` (tested with 0.10.7, ``pip install mmengine==0.10.7``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from apex.optimizers import FusedAdam, FusedSGD, NpuFusedAdamW, NpuFusedSGD

pytestmark = [pytest.mark.full, pytest.mark.usefixtures("amp_env")]

OPTIMIZERS = {
    "FusedSGD": dict(type=FusedSGD, lr=0.05, momentum=0.9),
    "NpuFusedSGD": dict(type=NpuFusedSGD, lr=0.05, momentum=0.9),
    "FusedAdam": dict(type=FusedAdam, lr=3e-3),
    "NpuFusedAdamW": dict(type=NpuFusedAdamW, lr=3e-3),
}
_names = itertools.count()


def _runner(work_dir, opt_level, optimizer, epochs, resume=False):
    mmengine = pytest.importorskip("mmengine")
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    class Net(BaseModel):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(8)
            self.fc = torch.nn.Linear(8 * 8 * 8, 4)

        def forward(self, inputs, labels=None, mode="tensor"):
            logits = self.fc(torch.relu(self.bn(self.conv(inputs))).flatten(1))
            if mode == "loss":
                return {"loss": torch.nn.functional.cross_entropy(logits.float(), labels)}
            return logits

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(48, 3, 8, 8, generator=gen)
    y = (x.flatten(1) @ torch.randn(3 * 8 * 8, 4, generator=gen)).argmax(1)  # a learnable labelling
    data = [{"inputs": a, "labels": b} for a, b in zip(x, y)]
    torch.manual_seed(0)  # the model is built before the Runner seeds
    return mmengine, Runner(
        model=Net(), work_dir=str(work_dir),
        # mmengine names its process-wide instances by the second a Runner starts: unique names per Runner
        experiment_name=f"apex-{next(_names)}",
        train_dataloader=dict(dataset=data, sampler=dict(type="DefaultSampler", shuffle=True), batch_size=8,
                              collate_fn=dict(type="default_collate")),
        optim_wrapper=dict(type="ApexOptimWrapper", opt_level=opt_level, loss_scale="dynamic", optimizer=optimizer),
        train_cfg=dict(by_epoch=True, max_epochs=epochs),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1), logger=dict(type="LoggerHook")),
        resume=resume, randomness=dict(seed=0), log_level="ERROR",
    )


def _params(runner):
    return [p.detach().float().clone() for p in runner.model.parameters()]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_apex_optim_wrapper_trains_and_resumes_bit_for_bit(tmp_path, monkeypatch, opt_level, name):
    # mmengine 0.10's checkpoints hold its own classes, which torch >= 2.6's default weights_only load refuses
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    from apex import amp

    _, straight = _runner(tmp_path / "straight", opt_level, dict(OPTIMIZERS[name]), 3)
    straight.train()
    losses = [float(v) for v in straight.message_hub.get_scalar("train/loss").data[0]]
    opt = straight.optim_wrapper.optimizer
    assert hasattr(opt, "_amp_stash") and isinstance(opt, OPTIMIZERS[name]["type"])  # initialize ran, in place
    low = {torch.float16, torch.bfloat16}
    assert (opt_level == "O2") == any(p.dtype in low for p in straight.model.parameters())
    assert all(v == v for v in losses) and sum(losses[-6:]) < 0.7 * sum(losses[:6]), losses
    amp.deinitialize()

    _, first = _runner(tmp_path / "resumed", opt_level, dict(OPTIMIZERS[name]), 2)
    first.train()
    amp.deinitialize()
    _, resumed = _runner(tmp_path / "resumed", opt_level, dict(OPTIMIZERS[name]), 3, resume=True)
    resumed.train()
    assert resumed.iter == straight.iter
    assert all(torch.equal(a, b) for a, b in zip(_params(resumed), _params(straight)))
