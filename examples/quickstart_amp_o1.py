"""Quickstart 1: mixed precision with amp O1 (upstream NVIDIA Apex's amp API), device auto-detected.

    python examples/quickstart_amp_o1.py

O1 runs the model's forward under torch.autocast for the detected device (npu > cuda > cpu; APEX_DEVICE overrides):
bf16 on CPU, fp16 on cuda/npu. scale_loss multiplies the loss by the dynamic loss scale and, on exit, unscales the
gradients and checks them for inf/nan; a step with overflowed gradients is skipped and the scale backed off.
"""

import torch

from apex import amp
from apex._device import detect_device

torch.manual_seed(0)
device = detect_device()
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = amp.initialize(model, optimizer, opt_level="O1")

x = torch.randn(64, 32, device=device)
y = torch.randint(0, 4, (64,), device=device)
losses = []
for _ in range(20):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    losses.append(loss.item())

assert losses[-1] < losses[0], losses
print(f"device {device}, amp O1: loss {losses[0]:.4f} -> {losses[-1]:.4f}; amp state {dict(amp.state_dict())}")
