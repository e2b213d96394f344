"""Core entries: gradient unscale + non-finite check (what amp does every step).

Ours: one ``apex._core.scale_`` call over a flat (combined) fp32 buffer: multiplies in place and reports
whether any value was inf/nan, in one memory pass. Reference: ``torch._amp_foreach_non_finite_check_and_unscale_``,
what ``torch.amp.GradScaler.unscale_`` runs, on the same flat tensor and on the per-parameter tensors of each
regime. Both sides alternate the scale between 1/2 and 2 (exact), so values stay bounded over any number of
rounds. In-place fp32 unscale moves 8 bytes per element (read + write).
"""

from __future__ import annotations

import torch

from bench import env, shapes
from bench.registry import Context, Entry, Registry

FLAT_NUMEL = 100_000_000
FLAT_NUMEL_QUICK = 10_000_000


class _Alternating:
    """Yields 0.5, 2.0, 0.5, ... as Python floats and as the matching 1-element tensors."""

    def __init__(self, device):
        self.i = 0
        self.tensors = [torch.full((1,), v, device=device) for v in (0.5, 2.0)]

    def next(self):
        self.i ^= 1
        return (0.5, 2.0)[self.i], self.tensors[self.i]


def _ours(st):
    value, _ = st["ours_scale"].next()
    return st["core"].scale_(st["flat"], value)


def _ref(st):
    _, inv = st["ref_scale"].next()
    torch._amp_foreach_non_finite_check_and_unscale_(st["ref_tensors"], st["found_inf"], inv)
    return st["found_inf"]


def _verify(st):
    """Same values and the same verdict as torch, on a small buffer with and without an inf."""
    core = st["core"]
    device = st["flat"].device
    x = torch.randn(4099, device=device)
    for bad in (None, 0, 2048, 4098):
        a = x.clone()
        if bad is not None:
            a[bad] = float("inf")
        b = a.clone()
        found_ours = core.scale_(a, 0.5)
        found = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_([b], found, torch.full((1,), 0.5, device=device))
        assert found_ours == bool(found.item()), f"non-finite verdict differs (inf at {bad})"
        assert torch.equal(a, b), f"unscaled values differ from torch (inf at {bad})"


def _setup(ctx: Context, regime: str):
    core = env.import_apex()
    if regime == "flat":
        n = FLAT_NUMEL_QUICK if ctx.quick else FLAT_NUMEL
        flat = torch.empty(n, device=ctx.device).uniform_(-1.0, 1.0)
        ref_tensors = [flat]  # the very same tensor: layout is identical, only the kernel differs
    else:
        shp = shapes.regime_shapes(regime, ctx.quick)
        flat, _ = shapes.make_flat(shp, device=ctx.device, seed=ctx.seed)
        ref_tensors = shapes.make_tensors(shp, device=ctx.device, seed=ctx.seed)  # one allocation each
    return {
        "numel": flat.numel(),
        "tensors": len(ref_tensors),
        "core": core,
        "flat": flat,
        "ref_tensors": ref_tensors,
        "found_inf": torch.zeros(1, device=ctx.device),
        "ours_scale": _Alternating(ctx.device),
        "ref_scale": _Alternating(ctx.device),
    }


def register(reg: Registry) -> None:
    # ratio <= 1.0 on the flat buffer; on the other regimes we must not be slower either
    regimes = [
        ("flat", "one flat tensor", "the same flat tensor"),
        ("model-145", "model-145 (GPT-like)", "per-param tensors"),
        ("small-5000x200", "small-5000x200", "per-param tensors"),
        ("small-2000x2000", "small-2000x2000", "per-param tensors"),
    ]
    for key, label, ref_on in regimes:
        reg.add(Entry(
            name="unscale + non-finite check",
            regime=label,
            setup=lambda ctx, key=key: _setup(ctx, key),
            ours=_ours,
            torch_ref=_ref,
            bytes_per_param=8,
            executor=lambda st: env.apex_executor(st["flat"]),
            ref_label=f"torch._amp_foreach_non_finite_check_and_unscale_ on {ref_on}",
            target_ratio=1.0,
            verify=_verify,
            group="amp",
            notes="ours: one call on the combined buffer" if key != "flat" else "",
        ))
