"""Quickstart 2: amp with combine_grad: every gradient lives in one flat buffer per dtype.

    python examples/quickstart_combine_grad.py

With zero_grad(set_to_none=False), after the first backward the gradients are rebound as views into one flat
buffer, so the unscale + inf/nan check at scale_loss exit is a single pass over that buffer (C++ on CPU) instead of
one per parameter. With torch's default set_to_none=True the fresh gradients are unscaled where they are (one C++
call over their addresses, no copy). Nothing else in the training loop changes; any torch.optim optimizer works.
"""

import torch

from apex import amp
from apex._device import detect_device

torch.manual_seed(0)
device = detect_device()
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer = amp.initialize(model, optimizer, opt_level="O1", combine_grad=True)

x = torch.randn(64, 32, device=device)
y = torch.randint(0, 4, (64,), device=device)
losses = []
for _ in range(20):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=False)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    losses.append(loss.item())

# The grads now share one storage: each is a view into the combined buffer.
storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
assert len(storages) == 1, f"expected one combined grad buffer, got {len(storages)} storages"
assert losses[-1] < losses[0], losses
print(f"device {device}, amp O1 + combine_grad: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
      f"{sum(p.numel() for p in model.parameters())} grads in one buffer")
