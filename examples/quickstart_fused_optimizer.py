"""Quickstart 3: a fused optimizer over combined buffers, with amp O2 and combine_grad.

    python examples/quickstart_fused_optimizer.py

NpuFusedAdam has torch.optim.Adam's semantics and state_dict layout. At its first step it combines params, grads and
its states (exp_avg, exp_avg_sq) into flat buffers, so each step is one pass per buffer (a C++ kernel on CPU). It
also works without amp; under O2 it updates the fp32 master weights and the model keeps low-precision weights.
"""

import torch

from apex import amp
from apex._device import detect_device
from apex.optimizers import NpuFusedAdam

torch.manual_seed(0)
device = detect_device()
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
optimizer = NpuFusedAdam(model.parameters(), lr=1e-2)
model, optimizer = amp.initialize(model, optimizer, opt_level="O2", combine_grad=True)

x = torch.randn(64, 32, device=device)
y = torch.randint(0, 4, (64,), device=device)
losses = []
for _ in range(20):
    loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    losses.append(loss.item())

assert losses[-1] < losses[0], losses
low = next(model.parameters()).dtype
master = next(iter(amp.master_params(optimizer))).dtype
print(f"device {device}, amp O2 + NpuFusedAdam: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
      f"(model weights {low}, master weights {master})")
