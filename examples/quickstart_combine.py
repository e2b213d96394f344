"""Quickstart: combine a model's parameters into one flat buffer, then run the torch-free core on it (CPU).

    python examples/quickstart_combine.py

Every parameter stays the same Python object (modules, optimizers and autograd keep working); its data now lives
in one buffer, so one elementwise pass over the buffer touches every parameter. `apex_C` is that pass: a
torch-free C++ module working on host arrays and tensors (anything with `__dlpack__` or the buffer protocol),
whose dtype, size, device and layout it reads from the object and checks before touching memory.
"""

import array
import math

import apex_C
import torch

from apex.contrib import combine_tensors, get_part_combined_tensor, is_combined_tensor_valid

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
params = list(model.parameters())
before = [p.detach().clone() for p in params]

flat = combine_tensors(params)  # values kept; every param is now a view into `flat`
assert is_combined_tensor_valid(flat, params)
assert all(torch.equal(p, b) for p, b in zip(params, before))
print(f"{len(params)} parameters, {sum(p.numel() for p in params)} elements -> one buffer of {flat.numel()}")

# Training is unchanged: backward fills each parameter's .grad as usual.
model(torch.randn(16, 64)).square().mean().backward()
assert all(p.grad is not None for p in params)

# One pass over the buffer updates every parameter at once (here: scale by 0.5 in place with the C++ core,
# which also reports whether it saw an inf/nan -- the loss-scaler's overflow check).
found_nonfinite = apex_C.scale_(flat, flat, 0.5)
assert not found_nonfinite
assert all(torch.equal(p, b * 0.5) for p, b in zip(params, before))

# A slice of the buffer is a view too: zero the first parameter's slot through it.
first = get_part_combined_tensor(flat, 0, params[0].numel())
first.zero_()
assert not params[0].any()

# The core needs no torch at all: the same kernels on any host buffer, here a stdlib float32 array
# (sum of squares, accumulated in float64).
a = array.array("f", [(i - 500) / 500 for i in range(1001)])
assert math.isclose(apex_C.sum_sq(a), math.fsum(x * x for x in a), rel_tol=1e-12)

# What does not describe itself is refused before any memory is touched: raw addresses, strided views.
for bad in (flat.data_ptr(), flat[::2]):
    try:
        apex_C.fill_(bad, 0.0)
    except (TypeError, ValueError) as exc:
        print(f"refused: {exc}")
    else:
        raise AssertionError("apex_C accepted a buffer it cannot check")
print(f"apex_C simd level {apex_C.simd_level()} of {apex_C.supported_simd_levels()}, "
      f"{apex_C.get_num_threads()} threads; quickstart OK")
