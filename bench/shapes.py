"""Tensor shapes of the benchmark regimes, and helpers to build tensors/params of those shapes.

Regimes (the memory-bound one, the per-tensor-overhead one, and one in between):
  model-145        145 fp32 tensors, 108,094,464 params: one 30000x768 embedding + 12 GPT-2-small-like layers
                   (per layer: ln_1 w/b, attn qkv 2304x768 + b, attn proj 768x768 + b, ln_2 w/b, mlp fc 3072x768 + b,
                   mlp proj 768x3072 + b = 12 tensors, 7,087,872 params). Large tensors: memory-bound regime.
  small-5000x200   5000 tensors of 200 elements (1M params): per-tensor overhead dominates.
  small-2000x2000  2000 tensors of 2000 elements (4M params): in between.
With ``quick`` the same tensor counts shrink (model: d_model 256, vocab 3000, ~10M params; small: fewer tensors)
so a CI smoke run exercises the same code paths in seconds.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

__all__ = [
    "MODEL_PARAMS",
    "MODEL_TENSORS",
    "REGIMES",
    "gpt_like_shapes",
    "make_flat",
    "make_params",
    "make_tensors",
    "numel_of",
    "regime_shapes",
]

Shape = Tuple[int, ...]

MODEL_TENSORS = 145
MODEL_PARAMS = 108_094_464
REGIMES = ("model-145", "small-5000x200", "small-2000x2000")


def gpt_like_shapes(layers: int = 12, vocab: int = 30000, d_model: int = 768, d_ff: int = 0) -> List[Shape]:
    """Embedding plus `layers` transformer blocks (torch Linear weight layout: out x in)."""
    d = d_model
    f = d_ff or 4 * d
    block = [
        (d,), (d,),  # ln_1 weight, bias
        (3 * d, d), (3 * d,),  # attention qkv projection
        (d, d), (d,),  # attention output projection
        (d,), (d,),  # ln_2 weight, bias
        (f, d), (f,),  # mlp up
        (d, f), (d,),  # mlp down
    ]
    return [(vocab, d)] + block * layers


def regime_shapes(regime: str, quick: bool = False) -> List[Shape]:
    if regime == "model-145":
        return gpt_like_shapes(vocab=3000, d_model=256) if quick else gpt_like_shapes()
    if regime == "small-5000x200":
        return [(200,)] * (1000 if quick else 5000)
    if regime == "small-2000x2000":
        return [(2000,)] * (500 if quick else 2000)
    raise ValueError(f"unknown regime {regime!r}; expected one of {', '.join(REGIMES)}")


def _count(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def numel_of(items) -> int:
    """Total elements of a list of shapes or tensors."""
    return sum(t.numel() if isinstance(t, torch.Tensor) else _count(t) for t in items)


def _fill(t: torch.Tensor, gen: torch.Generator, scale: float) -> torch.Tensor:
    # values of order `scale`, never denormal: randn on CPU, then moved (the same numbers on every device)
    return t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).mul_(scale))


def make_tensors(shapes: Sequence[Shape], dtype=torch.float32, device="cpu", seed: int = 0,
                 scale: float = 1.0) -> List[torch.Tensor]:
    """One separate allocation per shape (what a model's parameters look like before combining)."""
    gen = torch.Generator().manual_seed(seed)
    return [_fill(torch.empty(s, dtype=dtype, device=device), gen, scale) for s in shapes]


def make_flat(shapes: Sequence[Shape], dtype=torch.float32, device="cpu", seed: int = 0,
              scale: float = 1.0) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """One flat buffer and views of the given shapes into it, back to back (what combining produces)."""
    total = numel_of(shapes)
    flat = torch.empty(total, dtype=dtype, device=device)
    views, off = [], 0
    for s in shapes:
        n = _count(s)
        views.append(flat[off:off + n].view(s))
        off += n
    gen = torch.Generator().manual_seed(seed)
    for v in views:
        _fill(v, gen, scale)
    return flat, views


def make_params(shapes: Sequence[Shape], dtype=torch.float32, device="cpu", seed: int = 0,
                grad_scale: float = 1e-3) -> List[torch.nn.Parameter]:
    """Parameters with `.grad` set (values ~N(0, 1), grads ~N(0, grad_scale)); same seed -> same numbers."""
    params = [torch.nn.Parameter(t) for t in make_tensors(shapes, dtype, device, seed)]
    for p, g in zip(params, make_tensors(shapes, dtype, device, seed + 1, grad_scale)):
        p.grad = g
    return params
