"""apex.contrib.transducer (NVIDIA Apex's RNN-T joint and loss): the joint against its expression (padded and
packed, ReLU, dropout with the probed mask), the loss against its definition (the alpha recursion node by node in
float64, gradients by autograd), an exhaustive sum over alignments for a tiny lattice, packed input, and bad
arguments."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

from apex.contrib.transducer import TransducerJoint, TransducerLoss
from apex.contrib.transducer import _transducer_ref as ref

JOINT_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
             torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def _joint_inputs(device, dtype, b=3, t=7, u=5, h=12):
    g_ = torch.Generator().manual_seed(0)
    f = torch.randn(b, t, h, generator=g_).to(device=device, dtype=dtype).requires_grad_()
    g = torch.randn(b, u, h, generator=g_).to(device=device, dtype=dtype).requires_grad_()
    f_len = torch.tensor([t, 4, 1][:b], dtype=torch.int32, device=device)
    g_len = torch.tensor([2, u, 3][:b], dtype=torch.int32, device=device)
    grad = torch.randn(b, t, u, h, generator=g_).to(device=device, dtype=dtype)
    for i in range(b):
        grad[i, int(f_len[i]):] = 0
        grad[i, :, int(g_len[i]):] = 0
    return f, g, f_len, g_len, grad


def _pack(x, f_len, g_len):
    return torch.cat([x[b, :int(f_len[b]), :int(g_len[b])].reshape(-1, x.shape[-1]) for b in range(x.shape[0])])


@pytest.mark.parametrize("dtype", list(JOINT_TOL))
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("relu,dropout", [(False, False), (True, False), (False, True), (True, True)])
def test_joint_against_its_expression(device, dtype, pack, relu, dropout):
    f, g, f_len, g_len, grad = _joint_inputs(device, dtype)
    joint = TransducerJoint(pack_output=pack, relu=relu, dropout=dropout, dropout_prob=0.3, probe_mask=True)
    if pack:
        offset = torch.cumsum(f_len * g_len, 0)
        h = joint(f, g, f_len, g_len, batch_offset=offset, packed_batch=int(offset[-1]))
        h.backward(_pack(grad, f_len, g_len))
    else:
        h = joint(f, g, f_len, g_len)
        h.backward(grad)
    mask = None
    if dropout:
        probed = joint.mask_probe[0]
        assert probed.dtype == torch.uint8 and probed.shape == h.shape
        mask = torch.zeros(grad.shape, dtype=torch.uint8, device=device)
        if pack:  # back to the padded layout for the reference
            rows = iter(probed)
            for b in range(f.shape[0]):
                for t in range(int(f_len[b])):
                    for u in range(int(g_len[b])):
                        mask[b, t, u] = next(rows)
        else:
            mask = probed
    fr, gr = f.detach().clone().requires_grad_(), g.detach().clone().requires_grad_()
    want, f_grad, g_grad = ref.transducer_joint_reference(fr, gr, grad, f_len, g_len, pack, relu, dropout, 0.3, mask)
    assert h.dtype == dtype
    torch.testing.assert_close(h, want, **JOINT_TOL[dtype])
    torch.testing.assert_close(f.grad, f_grad, **JOINT_TOL[dtype])
    torch.testing.assert_close(g.grad, g_grad, **JOINT_TOL[dtype])


def test_joint_dropout_only_in_training_and_relu_mask(device):
    f, g, f_len, g_len, _ = _joint_inputs(device, torch.float32)
    joint = TransducerJoint(dropout=True, dropout_prob=0.5)
    joint.eval()
    assert torch.equal(joint(f, g, f_len, g_len), TransducerJoint()(f, g, f_len, g_len))
    relu = TransducerJoint(relu=True, probe_mask=True)
    h = relu(f, g, f_len, g_len)
    valid = h.ne(-1)
    assert torch.equal(relu.mask_probe[0].bool(), (h > 0) & valid)


def test_joint_bad_arguments(device):
    f, g, f_len, g_len, _ = _joint_inputs(device, torch.float32)
    with pytest.raises(ValueError, match="batch_offset and packed_batch"):
        TransducerJoint(pack_output=True)(f, g, f_len, g_len)
    with pytest.raises(ValueError, match="lengths give"):
        TransducerJoint(pack_output=True)(f, g, f_len, g_len, batch_offset=f_len, packed_batch=5)
    with pytest.raises(ValueError, match="share B and H"):
        TransducerJoint()(f, g[:, :, :5], f_len, g_len)
    with pytest.raises(TypeError, match="integer tensor"):
        TransducerJoint()(f, g, f_len.float(), g_len)
    with pytest.raises(ValueError, match=r"f_len must have shape \(3,\)"):
        TransducerJoint()(f, g, f_len[:2], g_len)
    with pytest.raises(ValueError, match="dropout_prob"):
        TransducerJoint(dropout=True, dropout_prob=2.0)
    with pytest.raises(ValueError, match="opt"):
        TransducerJoint(opt=2)
    if device == "cpu":
        with pytest.raises(ValueError, match="g_len at 0 is 9"):
            TransducerJoint()(f, g, f_len, torch.tensor([9, 1, 1], dtype=torch.int32))


# ---------------------------------------------------------------- loss

LOSS_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-10),
            torch.float16: dict(rtol=1e-3, atol=1e-2), torch.bfloat16: dict(rtol=1e-2, atol=5e-2)}
GRAD_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-6), torch.float64: dict(rtol=1e-9, atol=1e-12),
            torch.float16: dict(rtol=1e-2, atol=1e-4), torch.bfloat16: dict(rtol=5e-2, atol=1e-3)}


def _loss_inputs(device, dtype, b=4, t=9, u=6, v=7, blank=3, seed=0):
    g_ = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, u, v, generator=g_).to(device=device, dtype=dtype).requires_grad_()
    label = torch.randint(0, v - 1, (b, u - 1), generator=g_)
    label[label >= blank] += 1  # labels are not the blank
    f_len = torch.tensor([t, 5, 1, 7][:b], dtype=torch.int32)
    y_len = torch.tensor([u - 1, 2, 3, 0][:b], dtype=torch.int32)
    return x, label.to(device), f_len.to(device), y_len.to(device)


@pytest.mark.parametrize("dtype", list(LOSS_TOL))
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("fuse", [True, False])
def test_loss_against_its_definition(device, dtype, packed, fuse):
    blank = 3
    x, label, f_len, y_len = _loss_inputs(device, dtype, blank=blank)
    loss_grad = torch.tensor([1.0, 0.5, -2.0, 0.25], device=device, dtype=dtype)
    xr = x.detach().clone().requires_grad_()
    alpha_ref, beta_ref, grad_ref, loss_ref = ref.transducer_loss_reference(xr, label, f_len, y_len, blank,
                                                                            loss_grad)
    module = TransducerLoss(fuse_softmax_backward=fuse, packed_input=packed)
    debug = []
    if packed:
        rows = torch.cat([x[b, :int(f_len[b]), :int(y_len[b]) + 1].reshape(-1, x.shape[-1])
                          for b in range(x.shape[0])]).detach().requires_grad_()
        offset = torch.cumsum(f_len * (y_len + 1), 0)
        loss = module(rows, label, f_len, y_len, blank, batch_offset=offset, max_f_len=int(f_len.max()),
                      debug_list=debug)
        loss.backward(loss_grad)
        grad = torch.zeros_like(x)
        i = 0
        for b in range(x.shape[0]):
            for t in range(int(f_len[b])):
                n = int(y_len[b]) + 1
                grad[b, t, :n] = rows.grad[i:i + n]
                i += n
    else:
        loss = module(x, label, f_len, y_len, blank, debug_list=debug)
        loss.backward(loss_grad)
        grad = x.grad
    assert loss.dtype == dtype and loss.shape == (4,)
    torch.testing.assert_close(loss.double(), loss_ref.double(), **LOSS_TOL[dtype])
    torch.testing.assert_close(grad.double(), grad_ref.double(), **GRAD_TOL[dtype])
    alpha, beta = debug
    # the reference keeps its lattices in float32, as upstream's
    tol = LOSS_TOL[torch.float32 if dtype == torch.float64 else dtype]
    for b in range(4):
        tl, ul = int(f_len[b]), int(y_len[b]) + 1
        torch.testing.assert_close(alpha[b, :tl, :ul].double(), alpha_ref[b, :tl, :ul].double(), **tol)
        torch.testing.assert_close(beta[b, :tl, :ul].double(), beta_ref[b, :tl, :ul].double(), **tol)


def test_loss_is_the_sum_over_alignments(device):
    # T = 3 frames, U = 2 labels: every path is a sequence of 3 blanks and 2 labels ending in a blank
    torch.manual_seed(4)
    x = torch.randn(1, 3, 3, 5, dtype=torch.float64, device=device)
    label = torch.tensor([[1, 4]], device=device)
    lp = torch.log_softmax(x, -1)[0]
    total = []
    for moves in set(itertools.permutations("bbyy")):  # the last blank is fixed
        t = u = 0
        s = 0.0
        for m in moves:
            if m == "b":
                s += float(lp[t, u, 0])
                t += 1
            else:
                s += float(lp[t, u, int(label[0, u])])
                u += 1
        if t <= 2:
            total.append(s + float(lp[2, 2, 0]))
    want = -math.log(sum(math.exp(s) for s in total))
    got = TransducerLoss()(x, label, torch.tensor([3], device=device), torch.tensor([2], device=device), 0)
    assert abs(float(got) - want) < 1e-12


def test_loss_ignores_the_padding(device):
    x, label, f_len, y_len = _loss_inputs(device, torch.float32)
    clean = TransducerLoss()(x, label, f_len, y_len, 3)
    (g_clean,) = torch.autograd.grad(clean.sum(), x)
    dirty = x.detach().clone()
    dirty[1, 5:] = float("nan")  # beyond f_len[1] = 5
    dirty[2, :, 4:] = float("inf")  # beyond y_len[2] + 1 = 4
    dirty.requires_grad_()
    loss = TransducerLoss()(dirty, label, f_len, y_len, 3)
    (grad,) = torch.autograd.grad(loss.sum(), dirty)
    assert torch.equal(loss, clean) and torch.equal(grad, g_clean)
    assert not grad[1, 5:].any() and not grad[2, :, 4:].any()


def test_loss_bad_arguments(device):
    x, label, f_len, y_len = _loss_inputs(device, torch.float32)
    loss = TransducerLoss()
    cases = [
        (lambda: loss(x.long(), label, f_len, y_len, 3), TypeError, "x must be"),
        (lambda: loss(x, label.float(), f_len, y_len, 3), TypeError, "label must be"),
        (lambda: loss(x, label, f_len, y_len, 7), ValueError, "blank_idx"),
        (lambda: loss(x, label, f_len[:3], y_len, 3), ValueError, "f_len must have shape"),
        (lambda: loss(x[:, :, :, :], label[:, :2], f_len, y_len, 3), ValueError, "U - 1"),
        (lambda: loss(x[0], label, f_len, y_len, 3), ValueError, "shape"),
        (lambda: TransducerLoss(packed_input=True)(x, label, f_len, y_len, 3), ValueError, "batch_offset"),
        (lambda: loss(x, label, f_len, y_len, 3, debug_list=()), TypeError, "debug_list"),
        (lambda: TransducerLoss(opt=3), ValueError, "opt"),
    ]
    if device == "cpu":
        cases += [
            (lambda: loss(x, label, f_len, torch.tensor([9, 1, 1, 1], dtype=torch.int32), 3), ValueError,
             "y_len at 0 is 9"),
            (lambda: loss(x, label, torch.tensor([0, 1, 1, 1], dtype=torch.int32), y_len, 3), ValueError,
             "f_len at 0 is 0"),
            (lambda: loss(x, label + 10, f_len, y_len, 3), ValueError, "label at"),
            (lambda: loss(x, torch.cat([label, label], 1)[:, ::2] + 10, f_len, y_len, 3), ValueError,
             "label at"),  # a strided view
        ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()


def _packed_inputs(device, dtype=torch.float32):
    x, label, f_len, y_len = _loss_inputs(device, dtype)
    rows = torch.cat([x[b, :int(f_len[b]), :int(y_len[b]) + 1].reshape(-1, x.shape[-1])
                      for b in range(x.shape[0])]).detach()
    return rows, label, f_len, y_len, torch.cumsum(f_len * (y_len + 1), 0)


def test_packed_loss_work_follows_the_lengths_not_max_f_len(device):
    rows, label, f_len, y_len, offset = _packed_inputs(device)
    results = []
    # 10**12 frames of lattice would not fit in any memory, nor finish: only the lengths may set the work
    for max_f_len in (int(f_len.max()), int(f_len.max()) + 3, 10**12):
        x = rows.clone().requires_grad_()
        loss = TransducerLoss(packed_input=True)(x, label, f_len, y_len, 3, offset, max_f_len)
        (grad,) = torch.autograd.grad(loss.sum(), x)
        results.append((loss, grad))
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])


def test_packed_debug_lattices_keep_the_max_f_len_layout(device):
    rows, label, f_len, y_len, offset = _packed_inputs(device)
    tight, wide = [], []
    TransducerLoss(packed_input=True)(rows, label, f_len, y_len, 3, offset, int(f_len.max()), tight)
    TransducerLoss(packed_input=True)(rows, label, f_len, y_len, 3, offset, int(f_len.max()) + 3, wide)
    t, u1 = int(f_len.max()), label.shape[1] + 1
    for small, big in zip(tight, wide):
        assert small.shape == (4, t, u1) and big.shape == (4, t + 3, u1)
        assert torch.equal(big[:, :t], small) and bool((big[:, t:] == float("-inf")).all())


def test_padded_loss_is_that_of_the_logits_cropped_to_the_longest_sequence(device):
    x, label, f_len, y_len = _loss_inputs(device, torch.float32)
    t, u1 = int(f_len.max()), int(y_len.max()) + 1
    wide = torch.cat([x.detach(), torch.randn(4, 6, x.shape[2], x.shape[3], device=device)], 1)
    wide = torch.cat([wide, torch.randn(4, wide.shape[1], 5, x.shape[3], device=device)], 2).requires_grad_()
    label_wide = torch.cat([label, torch.ones(4, 5, dtype=label.dtype, device=device)], 1)
    debug = []
    loss = TransducerLoss()(wide, label_wide, f_len, y_len, 3, debug_list=debug)
    (grad,) = torch.autograd.grad(loss.sum(), wide)
    crop = x.detach()[:, :t, :u1].clone().requires_grad_()
    want = TransducerLoss()(crop, label, f_len, y_len, 3)
    (want_grad,) = torch.autograd.grad(want.sum(), crop)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad[:, :t, :u1], want_grad, rtol=1e-6, atol=1e-7)
    assert not grad[:, t:].any() and not grad[:, :, u1:].any()
    assert [tuple(d.shape) for d in debug] == [tuple(wide.shape[:3])] * 2


@pytest.mark.parametrize("offset,match", [
    ([2, 69, 73, 80], r"batch_offset\[0\] is 2, but the lengths give 54"),
    ([-5, 69, 73, 80], r"batch_offset\[0\] is -5, but the lengths give 54"),  # not read from the end
    ([54, 69, 75, 80], r"batch_offset\[2\] is 75, but the lengths give 73"),
    ([54, 69, 73, 81], r"batch_offset\[3\] is 81, but the lengths give 80"),
])
def test_packed_loss_refuses_offsets_the_lengths_do_not_give(device, offset, match):
    rows, label, f_len, y_len, good = _packed_inputs(device)
    assert good.tolist() == [54, 69, 73, 80]  # cumsum(f_len * (y_len + 1))
    debug = []
    with pytest.raises(ValueError, match=match + r" \(batch_offset must be the cumsum of f_len \* \(y_len \+ 1\)\)"):
        TransducerLoss(packed_input=True)(rows, label, f_len, y_len, 3, torch.tensor(offset, device=device),
                                          int(f_len.max()), debug)
    assert debug == []


def test_packed_loss_refuses_a_max_f_len_below_the_longest_f_len(device):
    rows, label, f_len, y_len, offset = _packed_inputs(device)
    debug = []
    with pytest.raises(ValueError, match=r"max_f_len is 8, less than the longest f_len \(9\)"):
        TransducerLoss(packed_input=True)(rows, label, f_len, y_len, 3, offset, 8, debug)
    assert debug == []


def test_packed_joint_refuses_offsets_the_lengths_do_not_give(device):
    f, g, f_len, g_len, _ = _joint_inputs(device, torch.float32)
    joint = TransducerJoint(pack_output=True, relu=True, probe_mask=True)
    good = torch.cumsum(f_len * g_len, 0)
    assert good.tolist() == [14, 34, 37]
    with pytest.raises(ValueError, match=r"batch_offset\[1\] is 30, but the lengths give 34 \(batch_offset must be "
                                         r"the cumsum of f_len \* g_len\)"):
        joint(f, g, f_len, g_len, torch.tensor([14, 30, 37], device=device), 37)
    with pytest.raises(TypeError, match=r"batch_offset must be an integer tensor, got torch\.float32"):
        joint(f, g, f_len, g_len, good.float(), 37)
    assert joint.mask_probe == []
    assert joint(f, g, f_len, g_len, good, 37).shape == (37, f.shape[2])


def _nested(*shapes):
    with warnings.catch_warnings():  # torch's "prototype stage" notice for the strided nested layout
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([torch.randn(s) for s in shapes])


@pytest.mark.parametrize("name,call", [
    ("x", lambda x, label, fl, yl: TransducerLoss()(x.to_sparse(), label, fl, yl, 3)),
    ("label", lambda x, label, fl, yl: TransducerLoss()(x, label.to_sparse(), fl, yl, 3)),
    ("f_len", lambda x, label, fl, yl: TransducerLoss()(x, label, fl.to_sparse(), yl, 3)),
    ("batch_offset", lambda x, label, fl, yl: TransducerLoss(packed_input=True)(
        x.reshape(-1, x.shape[-1]), label, fl, yl, 3, torch.cumsum(fl * (yl + 1), 0).to_sparse(), 9)),
    ("x", lambda x, label, fl, yl: TransducerLoss()(_nested((9, 6, 7), (8, 6, 7)), label, fl, yl, 3)),
])
def test_loss_refuses_sparse_and_nested_tensors_by_name(name, call):
    x, label, f_len, y_len = _loss_inputs("cpu", torch.float32)
    before = x.detach().clone()
    with pytest.raises(TypeError, match=rf"TransducerLoss: {name} must be a dense \(strided\) tensor"):
        call(x.detach(), label, f_len, y_len)
    assert torch.equal(x, before)


@pytest.mark.parametrize("name,call", [
    ("f", lambda j, f, g, fl, gl: j(f.to_sparse(), g, fl, gl)),
    ("g", lambda j, f, g, fl, gl: j(f, _nested((5, 12), (4, 12), (5, 12)), fl, gl)),
    ("g_len", lambda j, f, g, fl, gl: j(f, g, fl, gl.to_sparse())),
])
def test_joint_refuses_sparse_and_nested_tensors_by_name(name, call):
    f, g, f_len, g_len, _ = _joint_inputs("cpu", torch.float32)
    joint = TransducerJoint(relu=True, probe_mask=True)
    with pytest.raises(TypeError, match=rf"TransducerJoint: {name} must be a dense \(strided\) tensor"):
        call(joint, f.detach(), g.detach(), f_len, g_len)
    assert joint.mask_probe == []
