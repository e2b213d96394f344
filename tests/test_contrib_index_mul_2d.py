"""apex.contrib.index_mul_2d: ``in1[idx1] * in2`` with first and second derivatives against the same expression
in float64 (the gradient of ``in1`` sums rows with repeated indices), in every dtype; bad arguments."""

from __future__ import annotations

import pytest
import torch

from apex.contrib.index_mul_2d import index_mul_2d

# the forward is one rounding of an exact product; the gradients sum up to N / M products per row
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12),
       torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def _loss(in1, in2, idx, fn):
    # upstream's test: an energy, its gradient (a force) with create_graph, and a loss holding both
    out = fn(in1, in2, idx)
    energy = (out.float() ** 2).sum() / out.numel()
    (force,) = torch.autograd.grad(energy, in1, create_graph=True)
    return out, energy + (force.float() ** 2).sum()


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("m,n,f", [(17, 300, 33), (1, 5, 1), (40, 1, 7), (6, 0, 4)])
def test_against_float64_with_second_derivative(device, dtype, m, n, f):
    torch.manual_seed(0)
    in1 = torch.randn(m, f).to(dtype).to(device).requires_grad_()
    in2 = torch.randn(n, f).to(dtype).to(device).requires_grad_()
    idx = torch.randint(0, m, (n,)).to(device)
    out, loss = _loss(in1, in2, idx, index_mul_2d)
    assert out.dtype == dtype and out.shape == (n, f)
    loss.backward()
    a = in1.detach().double().requires_grad_()
    b = in2.detach().double().requires_grad_()
    want, want_loss = _loss(a, b, idx, lambda x, y, i: x[i] * y)
    want_loss.backward()
    torch.testing.assert_close(out.double(), want.detach().to(dtype).double(), rtol=0, atol=0)  # one rounding
    torch.testing.assert_close(in1.grad.double(), a.grad, **TOL[dtype])
    torch.testing.assert_close(in2.grad.double(), b.grad, **TOL[dtype])


def test_non_contiguous_and_int32_index(device):
    torch.manual_seed(1)
    in1 = torch.randn(8, 10, device=device).t()  # (10, 8), strided
    in2 = torch.randn(8, 12, device=device)[:, ::2][:, :4].repeat(1, 2)
    idx = torch.randint(0, 10, (8,), device=device)
    assert torch.equal(index_mul_2d(in1, in2, idx.int()), in1[idx] * in2)


@pytest.mark.parametrize("args,error,words", [
    (("list", "in2", "idx"), TypeError, "in1 must be"),
    (("in1", "half", "idx"), TypeError, "one dtype"),
    (("in1", "in2", "float_idx"), TypeError, "idx1 must be"),
    (("in1_3d", "in2", "idx"), ValueError, "2-D"),
    (("in1", "in2", "idx_2d"), ValueError, "1-D"),
    (("in1", "in2", "idx_short"), ValueError, "one index per row"),
    (("in1_wide", "in2", "idx"), ValueError, "same number of columns"),
])
def test_bad_arguments(device, args, error, words):
    values = dict(in1=torch.randn(4, 3, device=device), in2=torch.randn(5, 3, device=device),
                  idx=torch.tensor([0, 1, 2, 3, 0], device=device))
    values.update(list=[[1.0]], half=values["in2"].half(), float_idx=values["idx"].float(),
                  in1_3d=values["in1"][None], idx_2d=values["idx"][None], idx_short=values["idx"][:4],
                  in1_wide=torch.randn(4, 2, device=device))
    with pytest.raises(error, match=words):
        index_mul_2d(*(values[a] for a in args))


def test_index_out_of_range_fails_on_the_cpu():
    with pytest.raises(IndexError):
        index_mul_2d(torch.randn(4, 3), torch.randn(2, 3), torch.tensor([1, 4]))


def test_devices_must_match(device):
    if device == "cpu":
        pytest.skip("needs a second device")
    with pytest.raises(ValueError, match="one device"):
        index_mul_2d(torch.randn(4, 3, device=device), torch.randn(2, 3), torch.tensor([1, 0]))
