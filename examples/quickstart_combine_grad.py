"""Quickstart 2: amp with combine_grad: the unscale + inf/nan check at scale_loss exit is one pass.

    python examples/quickstart_combine_grad.py

With torch's default zero_grad() (grads set to None) autograd's fresh gradients are unscaled where they are: one C++
call over their addresses on CPU, no copy. With zero_grad(set_to_none=False) the gradients are rebound as views into
one flat buffer after the first backward and the pass runs over that buffer. The loop runs both patterns. Nothing
else in the training loop changes; any torch.optim optimizer works.
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
for step in range(20):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=step >= 10)  # kept grads first, then torch's default (fresh grads)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    losses.append(loss.item())

assert losses[9] < losses[0] and losses[-1] < losses[9], losses
print(f"device {device}, amp O1 + combine_grad: loss {losses[0]:.4f} -> {losses[9]:.4f} (kept grads, one buffer) "
      f"-> {losses[-1]:.4f} (fresh grads, unscaled in place)")
