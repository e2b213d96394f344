"""Structured sparsity masks: in every group of ``m`` weights keep the ``n`` of largest magnitude (2:4 for
NVIDIA's sparse tensor cores), on any device.

``create_mask(tensor, pattern="m4n2_1d", density=0.5)`` returns a mask of ``tensor``'s shape and dtype (ones kept,
zeros pruned). Groups run along the input-channel dimension, dimension 1 of a weight (the rows of a Linear weight;
for a convolution, the input channels at each output channel and kernel position), so a matrix is read as rows of
input channels: a 1-D tensor as one row, ``(K, C)`` as is, ``(K, C, R)`` as ``K * R`` rows (kernel position
fastest), ``(K, C, *spatial)`` as ``spatial * K`` rows (output channel fastest), as upstream read them.

Patterns (``density`` is accepted and, as upstream's, unused: each pattern fixes its density):

* ``m4n2_1d``: each group of 4 consecutive elements of a row keeps its 2 of largest magnitude. A row whose length
  is not a multiple of 4 ends in a shorter group, which keeps its 2 largest (all when fewer).
* ``m4n2_2d_best``: each 4 x 4 block keeps the 2:4 pattern along both rows and columns (90 candidates) that keeps
  the largest total magnitude, so the transposed weight (the backward's data gradient) is 2:4 too.
* ``m4n2_2d_greedy``: each 4 x 4 block takes its elements by decreasing magnitude, keeping one while its row and
  its column hold fewer than 2 kept elements; it can keep fewer than 8.

Rows or columns left over when a matrix's sides are not multiples of 4 stay unpruned under the 2-D patterns.
Equal magnitudes are broken towards the lower position (row-major within a group or block), so a mask is the same
on every device. The generic forms ``mn_1d_best(matrix, m, n)``, ``mn_2d_best`` and ``mn_2d_greedy`` take any
``m > n >= 1``.
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict

import torch

from apex._checks import check_floating

__all__ = [
    "compute_valid_1d_patterns",
    "compute_valid_2d_patterns",
    "create_mask",
    "fill",
    "m4n2_1d",
    "m4n2_2d_best",
    "m4n2_2d_greedy",
    "mn_1d_best",
    "mn_2d_best",
    "mn_2d_greedy",
]


def fill(x: torch.Tensor) -> float:
    """The fraction of nonzero elements of ``x``."""
    return float(torch.count_nonzero(x)) / max(1, x.numel())


def _check_mn(m, n, where: str) -> None:
    for name, v in (("m", m), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{where}: {name} must be an int, got {type(v).__name__}")
    if not 1 <= n < m:
        raise ValueError(f"{where}: expected 1 <= n < m, got m={m}, n={n}")


def compute_valid_1d_patterns(m: int, n: int) -> torch.Tensor:
    """All 0/1 vectors of length ``m`` with ``n`` ones, (C(m, n), m) float32, in lexicographic order of the kept
    positions."""
    _check_mn(m, n, "compute_valid_1d_patterns")
    rows = []
    for kept in itertools.combinations(range(m), n):
        row = [0.0] * m
        for i in kept:
            row[i] = 1.0
        rows.append(row)
    return torch.tensor(rows)


_PATTERNS_2D: Dict[tuple, torch.Tensor] = {}


def compute_valid_2d_patterns(m: int, n: int) -> torch.Tensor:
    """All m x m 0/1 blocks with ``n`` ones in every row and every column, (count, m, m) float32 (90 for 4 and
    2)."""
    _check_mn(m, n, "compute_valid_2d_patterns")
    if (m, n) not in _PATTERNS_2D:
        rows = compute_valid_1d_patterns(m, n)
        found = []
        for pick in itertools.product(range(rows.shape[0]), repeat=m):
            block = rows[list(pick)]
            if bool((block.sum(0) == n).all()):
                found.append(block)
        _PATTERNS_2D[(m, n)] = torch.stack(found)
    return _PATTERNS_2D[(m, n)]


def _as_matrix(matrix: torch.Tensor, where: str) -> torch.Tensor:
    if not isinstance(matrix, torch.Tensor) or not (matrix.is_floating_point() or matrix.dtype == torch.bool):
        got = matrix.dtype if isinstance(matrix, torch.Tensor) else type(matrix).__name__
        raise TypeError(f"{where}: expected a floating-point tensor, got {got}")
    if matrix.dim() != 2:
        raise ValueError(f"{where}: expected a 2-D tensor (rows of input channels), got shape {tuple(matrix.shape)}")
    return matrix.detach().float().abs()


def _keep_largest(groups: torch.Tensor, n: int) -> torch.Tensor:
    """1 at the ``n`` largest of each row of ``groups`` (ties to the lower position), 0 elsewhere."""
    order = torch.sort(groups, dim=1, descending=True, stable=True).indices[:, :n]
    return torch.zeros_like(groups).scatter_(1, order, 1.0)


def mn_1d_best(matrix: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The ``n`` of ``m`` mask along the rows of a 2-D ``matrix`` (float32, the matrix's shape)."""
    _check_mn(m, n, "mn_1d_best")
    a = _as_matrix(matrix, "mn_1d_best")
    rows, cols = a.shape
    full = cols - cols % m
    mask = torch.ones_like(a)
    if full:
        mask[:, :full] = _keep_largest(a[:, :full].reshape(-1, m), n).view(rows, full)
    if full < cols:  # the shorter last group: its n largest
        tail = a[:, full:]
        mask[:, full:] = _keep_largest(tail, n) if tail.shape[1] > n else 1.0
    return mask


def _blocks(a: torch.Tensor, m: int):
    """The full m x m blocks of ``a`` as (count, m * m), and where they sit."""
    rows, cols = a.shape
    r, c = rows - rows % m, cols - cols % m
    blocks = a[:r, :c].reshape(r // m, m, c // m, m).permute(0, 2, 1, 3).reshape(-1, m * m)
    return blocks, r, c


def _place(mask: torch.Tensor, blocks: torch.Tensor, m: int, r: int, c: int) -> torch.Tensor:
    if r and c:
        mask[:r, :c] = blocks.view(r // m, c // m, m, m).permute(0, 2, 1, 3).reshape(r, c)
    return mask


def mn_2d_best(matrix: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The best ``n``-of-``m`` pattern along rows and columns of each m x m block (float32, the matrix's shape)."""
    _check_mn(m, n, "mn_2d_best")
    a = _as_matrix(matrix, "mn_2d_best")
    blocks, r, c = _blocks(a, m)
    patterns = compute_valid_2d_patterns(m, n).to(a.device).view(-1, m * m)
    if blocks.numel():
        # argmax returns the first of equal scores: the earlier pattern in compute_valid_2d_patterns' order
        best = torch.argmax(blocks @ patterns.t(), dim=1)
        blocks = patterns[best]
    return _place(torch.ones_like(a), blocks, m, r, c)


def mn_2d_greedy(matrix: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Each m x m block's elements by decreasing magnitude, kept while their row and column hold fewer than
    ``n`` (float32, the matrix's shape). Every block at once: m * m vectorised steps."""
    _check_mn(m, n, "mn_2d_greedy")
    a = _as_matrix(matrix, "mn_2d_greedy")
    blocks, r, c = _blocks(a, m)
    count = blocks.shape[0]
    kept = torch.zeros_like(blocks)
    if count:
        order = torch.sort(blocks, dim=1, descending=True, stable=True).indices
        row_n = torch.zeros(count, m, device=a.device)
        col_n = torch.zeros(count, m, device=a.device)
        every = torch.arange(count, device=a.device)
        for step in range(m * m):
            pos = order[:, step]
            i, j = pos // m, pos % m
            take = (row_n[every, i] < n) & (col_n[every, j] < n)
            kept[every, pos] = take.float()
            row_n[every, i] += take
            col_n[every, j] += take
    return _place(torch.ones_like(a), kept, m, r, c)


def m4n2_1d(mat: torch.Tensor, density: float = 0.5) -> torch.Tensor:
    return mn_1d_best(mat, 4, 2)


def m4n2_2d_best(mat: torch.Tensor, density: float = 0.5) -> torch.Tensor:
    return mn_2d_best(mat, 4, 2)


def m4n2_2d_greedy(mat: torch.Tensor, density: float = 0.5) -> torch.Tensor:
    return mn_2d_greedy(mat, 4, 2)


PATTERNS: Dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "m4n2_1d": m4n2_1d, "m4n2_2d_best": m4n2_2d_best, "m4n2_2d_greedy": m4n2_2d_greedy}


def create_mask(tensor: torch.Tensor, pattern: str = "m4n2_1d", density: float = 0.5) -> torch.Tensor:
    """The ``pattern`` mask of ``tensor`` (1 kept, 0 pruned) in ``tensor``'s shape and dtype; see the module
    docstring for how a weight is read as rows."""
    check_floating(tensor, "create_mask: tensor")
    if pattern not in PATTERNS:
        raise ValueError(f"create_mask: unknown pattern {pattern!r}; known: {', '.join(PATTERNS)}")
    if tensor.dim() == 0:
        raise ValueError("create_mask: tensor must have at least one dimension, got a 0-d tensor")
    calc = PATTERNS[pattern]
    shape = tensor.shape
    t = tensor.detach()
    if t.dim() == 1:
        mask = calc(t.view(1, -1), density).view(shape)
    elif t.dim() == 2:
        mask = calc(t, density)
    elif t.dim() == 3:  # (K, C, R) as rows (k, r)
        rows = t.permute(0, 2, 1).reshape(-1, shape[1])
        mask = calc(rows, density).view(shape[0], shape[2], shape[1]).permute(0, 2, 1)
    else:  # (K, C, *spatial) as rows (spatial..., k)
        spatial = tuple(range(2, t.dim()))
        rows = t.permute(*spatial, 0, 1).reshape(-1, shape[1])
        back = [t.dim() - 2, t.dim() - 1, *range(t.dim() - 2)]
        mask = calc(rows, density).view(*shape[2:], shape[0], shape[1]).permute(*back)
    return mask.contiguous().to(tensor.dtype)
