"""Reference forms of the transducer joint and loss for tests: the plain expressions, one lattice node at a time,
with torch's autograd for the gradients (the loss in float64). Slow; for small sizes only. The names and
returns are those upstream's tests use."""

from __future__ import annotations

import torch

__all__ = ["transducer_joint_reference", "transducer_loss_reference"]


def _lattice_log_probs(x, label, b, blank_idx):
    lp = torch.log_softmax(x[b].double(), dim=-1)  # (T, U, V)
    blank = lp[..., blank_idx]
    u1 = lp.shape[1]
    idx = label[b, :u1 - 1].long()
    emit = lp[:, :u1 - 1].gather(2, idx[None, :, None].expand(lp.shape[0], -1, 1)).squeeze(2)
    return blank, emit


def _alpha(blank, emit, t_len, y_len):
    rows = [[None] * (y_len + 1) for _ in range(t_len)]
    rows[0][0] = blank.new_zeros(())
    for t in range(t_len):
        for u in range(y_len + 1):
            if t == 0 and u == 0:
                continue
            terms = []
            if t > 0:
                terms.append(rows[t - 1][u] + blank[t - 1, u])
            if u > 0:
                terms.append(rows[t][u - 1] + emit[t, u - 1])
            rows[t][u] = torch.logsumexp(torch.stack(terms), 0)
    return rows


def _beta(blank, emit, t_len, y_len):
    beta = blank.new_full((t_len, y_len + 1), float("-inf"))
    for t in range(t_len - 1, -1, -1):
        for u in range(y_len, -1, -1):
            if t == t_len - 1 and u == y_len:
                beta[t, u] = blank[t, u]
                continue
            terms = []
            if t + 1 < t_len:
                terms.append(beta[t + 1, u] + blank[t, u])
            if u + 1 <= y_len:
                terms.append(beta[t, u + 1] + emit[t, u])
            beta[t, u] = torch.logsumexp(torch.stack(terms), 0)
    return beta


def transducer_loss_reference(x, label, f_len, y_len, blank_idx, loss_grad):
    """(alpha, beta, x.grad, loss): the RNN-T loss of each sequence by its definition, alpha and beta float32
    (B, T, U) (-inf outside each lattice for beta, 0 outside for alpha), the gradient from autograd with
    ``loss_grad`` per sequence, the loss in x's dtype. ``x`` must require grad."""
    batch, t_max, u_max, _ = x.shape
    alpha_out = torch.zeros(batch, t_max, u_max, dtype=torch.float32, device=x.device)
    beta_out = torch.full((batch, t_max, u_max), float("-inf"), dtype=torch.float32, device=x.device)
    losses = []
    for b in range(batch):
        t_len, u_len = int(f_len[b]), int(y_len[b])
        blank, emit = _lattice_log_probs(x, label, b, blank_idx)
        rows = _alpha(blank, emit, t_len, u_len)
        losses.append(-(rows[t_len - 1][u_len] + blank[t_len - 1, u_len]))
        with torch.no_grad():
            for t in range(t_len):
                for u in range(u_len + 1):
                    alpha_out[b, t, u] = rows[t][u]
            beta_out[b, :t_len, :u_len + 1] = _beta(blank.detach(), emit.detach(), t_len, u_len)
    loss = torch.stack(losses)
    (loss * loss_grad.double()).sum().backward()
    return alpha_out, beta_out, x.grad, loss.detach().to(x.dtype)


def transducer_joint_reference(f, g, h_grad, f_len, g_len, pack_output, relu, dropout, dropout_prob=0,
                               mask=None):
    """(h, f.grad, g.grad) of ``h = f[:, :, None] + g[:, None]`` (ReLU, then dropout with the given keep
    ``mask``), backward with ``h_grad``; h padded with -1 outside each sequence's lengths, or packed. ``f`` and
    ``g`` must require grad."""
    if dropout and mask is None:
        raise ValueError("transducer_joint_reference: dropout needs the keep mask")
    h = f[:, :, None, :] + g[:, None, :, :]
    if relu:
        h = torch.relu(h)
    if dropout:
        h = h * mask * (1.0 / (1.0 - dropout_prob))
    h.backward(h_grad)
    h = h.detach()
    batch = f.shape[0]
    if not pack_output:
        h = h.clone()
        for b in range(batch):
            h[b, int(f_len[b]):] = -1
            h[b, :, int(g_len[b]):] = -1
        return h, f.grad, g.grad
    rows = [h[b, :int(f_len[b]), :int(g_len[b])].reshape(-1, h.shape[-1]) for b in range(batch)]
    return torch.cat(rows), f.grad, g.grad
