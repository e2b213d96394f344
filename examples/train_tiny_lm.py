"""Train a small character-level transformer language model with apex amp (O1 or O2) and a fused Adam.

    python examples/train_tiny_lm.py --opt-level O1 --steps 200
    python examples/train_tiny_lm.py --opt-level O2 --steps 200 --batch-size 32 --seq-len 64

The training text is generated here from a small fixed grammar (no downloads), so the run is reproducible anywhere.
The device is auto-detected (npu > cuda > cpu, APEX_DEVICE overrides). Progress goes to a tqdm bar when tqdm is
installed, to logging otherwise. The last line is machine-readable:

    RESULT opt_level=O1 steps=200 first_loss=... last_loss=... tokens_per_s=...

where first/last loss are means over the first and last tenth of the steps (at least one step each).
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from apex import amp
from apex._device import detect_device
from apex.optimizers import NpuFusedAdam

log = logging.getLogger("train_tiny_lm")

SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher"]
VERBS = ["sees", "likes", "follows", "draws", "finds", "carries", "builds"]
OBJECTS = ["the ball", "a red box", "the river", "an apple", "the long road", "a green tree", "the moon"]
ENDINGS = [" today", " again", " slowly", " at night", "", " with care"]


def make_corpus(n_sentences: int, seed: int) -> str:
    """A deterministic toy corpus: enough structure for a small model to learn quickly, no external data."""
    rng = random.Random(seed)
    parts = []
    for _ in range(n_sentences):
        parts.append(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(ENDINGS)}.")
    return " ".join(parts)


class TinyLM(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm transformer blocks with a causal mask."""

    def __init__(self, vocab: int, seq_len: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = self.mask[:t, :t].to(h.dtype)  # under O2 the activations are low precision; the mask must match
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def batches(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
        x = torch.stack([data[s:s + seq_len] for s in starts.tolist()])
        y = torch.stack([data[s + 1:s + seq_len + 1] for s in starts.tolist()])
        yield x, y


def progress(total: int, disable: bool):
    """tqdm when available; otherwise None and the loop logs every tenth of the run."""
    if disable:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="step", dynamic_ncols=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--no-combine-grad", action="store_true", help="keep per-parameter gradients (no flat buffer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="log instead of drawing a progress bar")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.manual_seed(args.seed)
    device = detect_device()
    text = make_corpus(4000, args.seed)
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    model = TinyLM(len(vocab), args.seq_len, args.dim, args.layers, args.heads).to(device)
    optimizer = NpuFusedAdam(model.parameters(), lr=args.lr)
    combine = args.opt_level in ("O1", "O2") and not args.no_combine_grad  # combine_grad is an O1/O2 feature
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0,
                                      combine_grad=combine or None)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("device %s, opt_level %s, combine_grad %s, %d params, %d chars of text, vocab %d",
             device, args.opt_level, combine, n_params, len(text), len(vocab))

    gen = torch.Generator().manual_seed(args.seed)
    stream = batches(data, args.batch_size, args.seq_len, gen)
    bar = progress(args.steps, args.no_progress)
    losses = []
    tokens = 0
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = next(stream)
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
        tokens += x.numel()
        rate = tokens / (time.perf_counter() - start)
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:.0f}")
            bar.update(1)
        elif (step + 1) % max(1, args.steps // 10) == 0 or step + 1 == args.steps:
            log.info("step %d/%d loss %.4f tokens/s %.0f", step + 1, args.steps, losses[-1], rate)
    if bar is not None:
        bar.close()
    elapsed = time.perf_counter() - start

    k = max(1, args.steps // 10)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    if not all(math.isfinite(v) for v in losses[-k:]):
        raise RuntimeError(f"training diverged: last losses {losses[-k:]}")
    result = {"opt_level": args.opt_level, "steps": args.steps, "first_loss": first, "last_loss": last,
              "tokens_per_s": tokens / elapsed}
    log.info("loss %.4f -> %.4f (uniform guess: %.4f), %.0f tokens/s", first, last, math.log(len(vocab)),
             result["tokens_per_s"])
    print("RESULT " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main()
