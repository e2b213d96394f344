"""apex.contrib.sparsity (NVIDIA Apex's ASP and its mask library): masks against brute-force searches over every
pattern, the convolution layouts, ties, and the ASP workflow (buffers, masked training with torch's and our
optimizers, recomputing and restoring, checkpoints, call order, bad arguments leaving nothing changed)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from apex.contrib.sparsity import ASP, create_mask
from apex.contrib.sparsity import sparse_masklib as lib
from apex.optimizers import FusedAdam


@pytest.fixture(autouse=True)
def fresh_asp():
    ASP._reset()
    yield
    ASP._reset()


def _distinct(shape, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(int(torch.tensor(shape).prod()), generator=g).float().sub_(1000).view(shape).to(device)


def test_1d_keeps_the_two_largest_of_every_four(device):
    w = _distinct((16, 32), device)
    mask = create_mask(w, "m4n2_1d")
    assert mask.dtype == w.dtype and mask.shape == w.shape
    # brute force: of the six 2-of-4 patterns, the one keeping most magnitude
    patterns = lib.compute_valid_1d_patterns(4, 2).to(device)
    groups = w.abs().view(-1, 4)
    best = patterns[torch.argmax(groups @ patterns.t(), dim=1)]
    assert torch.equal(mask.view(-1, 4), best)


def test_2d_best_is_the_best_of_the_90_patterns(device):
    w = _distinct((12, 16), device, seed=1)
    mask = create_mask(w, "m4n2_2d_best")
    patterns = lib.compute_valid_2d_patterns(4, 2)
    assert patterns.shape == (90, 4, 4)
    assert (patterns.sum(1) == 2).all() and (patterns.sum(2) == 2).all()
    a = w.abs().cpu()
    for bi, bj in itertools.product(range(3), range(4)):
        block = a[4 * bi:4 * bi + 4, 4 * bj:4 * bj + 4]
        got = mask.cpu()[4 * bi:4 * bi + 4, 4 * bj:4 * bj + 4]
        best = max(float((block * p).sum()) for p in patterns)
        assert float((block * got).sum()) == best
        assert (got.sum(0) == 2).all() and (got.sum(1) == 2).all()


def _greedy_block(block, n=2):
    kept = torch.zeros_like(block)
    rows, cols = [0] * 4, [0] * 4
    for pos in sorted(range(16), key=lambda k: (-float(block.reshape(-1)[k]), k)):
        i, j = divmod(pos, 4)
        if rows[i] < n and cols[j] < n:
            kept[i, j] = 1
            rows[i] += 1
            cols[j] += 1
    return kept


def test_2d_greedy_against_a_plain_loop(device):
    w = torch.randn(8, 12, generator=torch.Generator().manual_seed(2)).to(device)
    mask = create_mask(w, "m4n2_2d_greedy").cpu()
    a = w.abs().cpu()
    for bi, bj in itertools.product(range(2), range(3)):
        sl = (slice(4 * bi, 4 * bi + 4), slice(4 * bj, 4 * bj + 4))
        assert torch.equal(mask[sl], _greedy_block(a[sl]))


def test_leftovers_and_ties(device):
    # ties go to the lower position, the same on every device
    assert create_mask(torch.ones(1, 8, device=device)).tolist() == [[1, 1, 0, 0, 1, 1, 0, 0]]
    # a row of 10: two groups of 4 and a group of 2, kept whole
    row = torch.tensor([[4.0, 1, 3, 2, 1, 2, 3, 4, 5, 6]], device=device)
    assert create_mask(row).tolist() == [[1, 0, 1, 0, 0, 0, 1, 1, 1, 1]]
    # 2-D patterns leave rows / columns beyond the multiples of 4 unpruned
    w = torch.randn(6, 6, device=device)
    for pattern in ("m4n2_2d_best", "m4n2_2d_greedy"):
        mask = create_mask(w, pattern)
        assert mask[4:].all() and mask[:, 4:].all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_convolution_layouts(device, dtype):
    # groups run along input channels (dim 1) at every output channel and kernel position
    for shape in [(16, 32, 3), (16, 32, 3, 3), (8, 16, 2, 3, 3)]:
        w = torch.randn(shape, device=device).to(dtype)
        mask = create_mask(w)
        assert mask.dtype == dtype and mask.shape == w.shape
        rows = w.movedim(1, -1).reshape(-1, shape[1])
        assert torch.equal(mask.movedim(1, -1).reshape(-1, shape[1]), create_mask(rows))
    # the 2-D patterns see 4 consecutive output channels at one kernel position (the transposed weight)
    w = torch.randn(8, 16, 3, 3, device=device)
    mask = create_mask(w, "m4n2_2d_best")
    at = mask[:, :, 1, 2]
    assert (at.view(2, 4, 4, 4).sum(1) == 2).all()


def test_masklib_bad_arguments():
    with pytest.raises(ValueError, match="unknown pattern"):
        create_mask(torch.randn(4, 4), "m8n1")
    with pytest.raises(TypeError, match="floating-point"):
        create_mask(torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="1 <= n < m"):
        lib.mn_1d_best(torch.randn(4, 4), 4, 4)
    with pytest.raises(ValueError, match="2-D"):
        lib.mn_2d_best(torch.randn(4), 4, 2)
    assert lib.fill(torch.tensor([0.0, 1.0, 2.0, 0.0])) == 0.5


# ---------------------------------------------------------------- the workflow


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.small = nn.Linear(64, 12)  # 12 rows: not a multiple of 8, skipped
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.attn = nn.MultiheadAttention(32, 4)
        self.norm = nn.LayerNorm(12)

    def forward(self, x, img):
        a = self.attn(x, x, x, need_weights=False)[0]
        return self.norm(self.small(self.fc1(a))).sum() + self.conv(img).sum()


def _batch(device):
    return torch.randn(5, 2, 32, device=device), torch.randn(2, 16, 6, 6, device=device)


def _is_2to4(w):
    return bool((w.detach().reshape(-1, 4).ne(0).sum(1) <= 2).all())


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, FusedAdam])
def test_masked_training(device, opt_cls, capsys):
    torch.manual_seed(0)
    model = Net().to(device)
    opt = opt_cls(model.parameters(), lr=1e-2)
    ASP.init_model_for_pruning(model, "m4n2_1d", verbosity=3, allow_recompute_mask=True)
    out = capsys.readouterr().out
    assert "Auto skipping pruning small::weight" in out and "Sparsifying fc1::weight" in out
    names = {(m, p) for m, p, _ in ASP._parameters()}
    assert names == {("fc1", "weight"), ("conv", "weight"), ("attn", "in_proj_weight"),
                     ("attn.out_proj", "weight")}
    assert "fc1.__weight_mma_mask" in model.state_dict() and "fc1.__weight_mma_pruned_p" in model.state_dict()
    assert not ASP.is_sparsity_enabled() and ASP.already_init_asp_model()
    ASP.init_optimizer_for_pruning(opt)
    dense = model.fc1.weight.detach().clone()
    ASP.compute_sparse_masks()
    assert ASP.is_sparsity_enabled()
    w = model.fc1.weight
    assert torch.equal(w.detach() != 0, create_mask(dense).bool()) and _is_2to4(w)
    assert torch.equal(model.fc1.__dict__["_buffers"]["__weight_mma_pruned_p"].to(device) + w.detach(), dense)
    for _ in range(3):
        opt.zero_grad()
        model(*_batch(device)).backward()
        opt.step()
        for _, _, p in ASP._parameters():
            assert _is_2to4(p.movedim(1, -1) if p.dim() == 4 else p)
    assert not model.small.weight.eq(0).any()
    # recompute from the dense weights (pruned values restored first), then restore dense weights
    ASP.compute_sparse_masks()
    assert ASP.is_sparsity_enabled()
    ASP.restore_pruned_weights()
    assert not ASP.is_sparsity_enabled() and model.fc1.weight.ne(0).all()


def test_checkpoint_carries_the_masks(device, tmp_path):
    torch.manual_seed(1)
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ASP.prune_trained_model(model, opt)
    state = model.state_dict()
    ASP._reset()
    fresh = Net().to(device)
    ASP.init_model_for_pruning(fresh, verbosity=0)
    assert not ASP.is_sparsity_enabled()
    fresh.load_state_dict(state)
    assert ASP.is_sparsity_enabled()
    fopt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    ASP.init_optimizer_for_pruning(fopt)
    fresh(*_batch(device)).backward()
    fopt.step()
    assert torch.equal(fresh.fc1.weight.ne(0), state["fc1.__weight_mma_mask"])


def test_entries_follow_the_model_when_it_moves(device):
    model = Net()
    ASP.init_model_for_pruning(model, verbosity=0, allow_recompute_mask=True)
    model.to(device=device, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ASP.init_optimizer_for_pruning(opt)
    ASP.compute_sparse_masks()
    assert model.fc1.weight.dtype == torch.float64 and _is_2to4(model.fc1.weight)


def test_custom_layers_subclasses_and_names(device):
    class MyLinear(nn.Linear):
        pass

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Parameter(torch.randn(16, 32))

    model = nn.Sequential(MyLinear(32, 16), Gate(), nn.Linear(32, 16)).to(device)
    ASP.init_model_for_pruning(model, verbosity=0, custom_layer_dict={Gate: ["gate"]}, disallowed_layer_names=["2"])
    assert {(m, p) for m, p, _ in ASP._parameters()} == {("0", "weight"), ("1", "gate")}
    ASP._reset()
    ASP.init_model_for_pruning(model, verbosity=0, allowed_layer_names=["2"], mask_calculator=lambda p: p.abs() > 0)
    ASP.compute_sparse_masks()
    assert [m for m, _, _ in ASP._parameters()] == ["2"]


def test_call_order_and_bad_arguments_change_nothing(device):
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="init_model_for_pruning first"):
        ASP.init_optimizer_for_pruning(opt)
    bad = [
        (dict(mask_calculator="m3n1"), ValueError, "unknown mask pattern"),
        (dict(mask_calculator=3), TypeError, "mask_calculator"),
        (dict(whitelist=[nn.LayerNorm]), ValueError, "custom_layer_dict"),
        (dict(whitelist=["Linear"]), TypeError, "whitelist"),
        (dict(allowed_layer_names="fc1"), TypeError, "allowed_layer_names"),
        (dict(allow_recompute_mask=1), TypeError, "allow_recompute_mask"),
        (dict(custom_layer_dict={nn.LayerNorm: "weight"}), TypeError, "custom_layer_dict"),
    ]
    for kwargs, error, words in bad:
        with pytest.raises(error, match=words):
            ASP.init_model_for_pruning(model, verbosity=0, **kwargs)
        assert not ASP.already_init_asp_model()
        assert not any("mma" in k for k in model.state_dict())
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        ASP.init_model_for_pruning(opt)
    ASP.init_model_for_pruning(model, verbosity=0)
    with pytest.raises(RuntimeError, match="initialized already"):
        ASP.init_model_for_pruning(model)
    with pytest.raises(TypeError, match="step"):
        ASP.init_optimizer_for_pruning(object())
    ASP.init_optimizer_for_pruning(opt)
    with pytest.raises(RuntimeError, match="optimizer already"):
        ASP.init_optimizer_for_pruning(opt)
    ASP.compute_sparse_masks()
    before = model.fc1.weight.detach().clone()
    with pytest.raises(RuntimeError, match="allow_recompute_mask=False"):
        ASP.compute_sparse_masks()
    with pytest.raises(RuntimeError, match="allow_recompute_mask=False"):
        ASP.restore_pruned_weights()
    assert torch.equal(model.fc1.weight, before)


def test_a_wrong_mask_calculator_is_reported(device):
    model = nn.Linear(32, 16).to(device)
    ASP.init_model_for_pruning(model, verbosity=0, mask_calculator=lambda p: p.flatten())
    with pytest.raises(ValueError, match="weight's shape"):
        ASP.compute_sparse_masks()
