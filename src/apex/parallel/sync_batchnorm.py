"""Synchronized batch normalization: statistics over the whole distributed batch (upstream apex's API).

``SyncBatchNorm`` is a batch-norm module (a ``torch.nn.modules.batchnorm._BatchNorm``,
as upstream apex's is, so code that treats batch norms alike, e.g. amp's
``keep_batchnorm_fp32``, handles it) with ``torch.nn.SyncBatchNorm``'s arguments
plus upstream apex's. It is deliberately *not* a ``torch.nn.SyncBatchNorm``:
torch's ``DistributedDataParallel`` refuses any model containing one on CPU
("SyncBatchNorm layers only work with GPU modules"), which would stop a CPU/gloo
user of ``convert_syncbn_model`` from training with torch's DDP. In training with
more than one rank it normalizes with the mean and variance of the batch over
all ranks of its process group:

* on devices torch's SyncBatchNorm supports (cuda, npu through torch_npu's
  privateuse1 backend, xpu, hpu) it runs torch's SyncBatchNorm forward;
* elsewhere (cpu with gloo, which torch's refuses) it runs `_SyncBatchNormCPU`:
  each rank computes its count, mean and variance (two-pass, in float32 or
  float64), the per-channel sums and sums of squares are all-reduced in float64
  (one collective), and the backward all-reduces the per-channel sums of
  ``dy`` and ``dy * x_hat`` (one collective).

Outside training, with one rank, or without an initialized process group it is
ordinary batch norm. Running statistics follow torch: exponential average with
``momentum`` (cumulative when ``momentum=None``) of the global mean and the
global unbiased variance. Weight and bias grads are the local sums (data
parallelism then averages them across ranks, as for any parameter).

``channel_last=True`` takes the channel from the last dim (``[N, ..., C]``);
``fuse_relu=True`` applies ReLU to the output, after adding ``z`` when given.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._checks import check_bool, check_int
from ._comm import agree_values, check_process_group, collective, group_or_world

__all__ = ["SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group"]

_LOW = (torch.float16, torch.bfloat16)


def _torch_sync_devices() -> Tuple[str, ...]:
    """Device types torch.nn.SyncBatchNorm accepts when it has to synchronize."""
    return ("cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name())


def _split_channels(x: torch.Tensor, channel_last: bool) -> Tuple[torch.Tensor, Tuple[int, ...], Tuple[int, ...]]:
    """x as (A, C, B) (channel first) or (A, C) (channel last), its reduction dims and the broadcast shape."""
    if channel_last:
        c = x.shape[-1]
        return x.reshape(-1, c), (0,), (1, c)
    c = x.shape[1]
    # the spatial size spelled out: an empty local batch (0 elements) leaves -1 undetermined
    return x.reshape(x.shape[0], c, math.prod(x.shape[2:])), (0, 2), (1, c, 1)


def _channel_axes(x: torch.Tensor, channel_last: bool) -> Tuple[int, Tuple[int, ...], Tuple[int, ...]]:
    """The channel dim of x, its reduction dims and the broadcast shape of per-channel values, in x's own rank."""
    ch = x.dim() - 1 if channel_last else 1
    dims = tuple(d for d in range(x.dim()) if d != ch)
    shape = tuple(x.shape[ch] if d == ch else 1 for d in range(x.dim()))
    return ch, dims, shape


class _SyncBatchNormCPU(torch.autograd.Function):
    """Batch norm with statistics all-reduced over a process group, for any device the backend handles."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, group, channel_last):
        # Computed in x's own shape, so the output is a fresh tensor and never a view: a view returned by a
        # custom Function may not be modified in place, and models follow batch norm with ReLU(inplace=True).
        ch, dims, shape = _channel_axes(x, channel_last)
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        xc = x.to(compute)
        c = x.shape[ch]
        n_local = xc.numel() // c if c else 0
        if n_local > 0:
            var_l, mean_l = torch.var_mean(xc, dim=dims, correction=0)
        else:
            var_l = mean_l = torch.zeros(c, dtype=compute, device=x.device)
        # Each rank's count, mean and sum of squared deviations (float64), gathered and combined as in the
        # parallel variance formula: M2 = sum(M2_r + n_r (mean_r - mean)^2). Summing x and x^2 instead loses the
        # variance to cancellation when the mean is large against the spread (float64 inputs offset by 1e8:
        # output errors near 1).
        local = torch.cat([torch.full((1,), float(n_local), dtype=torch.float64, device=x.device),
                           mean_l.double(), var_l.double() * n_local])
        pg = group_or_world(group)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(pg))]
        with collective("apex.parallel.SyncBatchNorm: all-gather of the batch statistics", group):
            dist.all_gather(parts, local, group=pg)
        stats = torch.stack(parts)
        counts, means, m2s = stats[:, :1], stats[:, 1:1 + c], stats[:, 1 + c:]
        count = counts.sum().item()
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(count)} over all ranks "
                             f"(input size {list(x.shape)})")
        mean = (counts * means).sum(0) / count
        var = ((m2s + counts * (means - mean).square()).sum(0) / count).clamp_min_(0.0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1.0 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1.0 - factor).add_((var * (count / (count - 1))).to(running_var.dtype),
                                                    alpha=factor)
        mean_c, invstd_c = mean.to(compute), invstd.to(compute)
        xhat = (xc - mean_c.view(shape)) * invstd_c.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.to(compute).view(shape)
        if bias is not None:
            y = y + bias.to(compute).view(shape)
        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.count = count
        ctx.group = group
        ctx.channel_last = channel_last
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        x3, dims, shape = _split_channels(x, ctx.channel_last)
        compute = mean.dtype
        dy3 = dy.reshape(x3.shape).to(compute)
        xhat = (x3.to(compute) - mean.view(shape)) * invstd.view(shape)
        sum_dy = dy3.sum(dim=dims)
        sum_dy_xhat = (dy3 * xhat).sum(dim=dims)
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_x = grad_w = grad_b = None
        if need_w and weight is not None:
            grad_w = sum_dy_xhat.to(weight.dtype)
        if need_b and ctx.has_bias:
            grad_b = sum_dy.to(weight.dtype if weight is not None else dy.dtype)
        if need_x:
            c = sum_dy.numel()
            packed = torch.cat([sum_dy, sum_dy_xhat]).double()
            with collective("apex.parallel.SyncBatchNorm: all-reduce of the backward sums", ctx.group):
                dist.all_reduce(packed, group=group_or_world(ctx.group))
            mean_dy = (packed[:c] / ctx.count).to(compute)
            mean_dy_xhat = (packed[c:] / ctx.count).to(compute)
            scale = invstd if weight is None else invstd * weight.to(compute)
            gx = (dy3 - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
            grad_x = gx.to(x.dtype).reshape(x.shape)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch norm synchronized over a process group (see the module docstring).

    Args: as ``torch.nn.SyncBatchNorm`` (``num_features, eps, momentum, affine,
    track_running_stats, process_group``), plus upstream apex's ``channel_last``
    and ``fuse_relu``; ``forward(input, z=None)``. Not a subclass of
    ``torch.nn.SyncBatchNorm`` (so torch's DDP accepts it on CPU); test for
    ``apex.parallel.SyncBatchNorm`` or ``torch.nn.modules.batchnorm._BatchNorm``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, channel_last: bool = False,
                 fuse_relu: bool = False, device: Any = None, dtype: Any = None) -> None:
        affine = check_bool(affine, "SyncBatchNorm: affine")
        track_running_stats = check_bool(track_running_stats, "SyncBatchNorm: track_running_stats")
        channel_last = check_bool(channel_last, "SyncBatchNorm: channel_last")
        fuse_relu = check_bool(fuse_relu, "SyncBatchNorm: fuse_relu")
        check_process_group(process_group, "SyncBatchNorm: process_group")
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu
        self._agreed: Optional[Tuple[int, Any]] = None

    def __getstate__(self) -> dict:
        # a copy (deepcopy, pickle) may meet ranks that never agreed with it: it agrees again on its first forward
        state = super().__getstate__()
        state["_agreed"] = None
        return state

    def _agree_across_ranks(self) -> None:
        """Before the first synchronized forward (and again if num_features or the group changes): every rank of
        the group must have the same num_features, or the statistics the ranks exchange differ in size, which gloo
        answers by terminating the process and nccl by a hang or garbage. One small collective, once per module;
        every rank of the group runs it at the same point, the first synchronized forward of its copy of the
        module."""
        group = self.process_group
        agreed = getattr(self, "_agreed", None)  # modules pickled before this attribute existed lack it
        if agreed is not None and agreed[0] == self.num_features and agreed[1] is group:
            return
        agree_values([("num_features", self.num_features)], "apex.parallel.SyncBatchNorm", group,
                     hint=". Every rank must build the same model: the per-channel statistics the ranks exchange "
                          "must have the same size everywhere.")
        self._agreed = (self.num_features, group)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _check_non_zero_input_channels(self, input: torch.Tensor) -> None:
        # torch.nn.SyncBatchNorm.forward (run below on the devices it supports) calls this
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    def _factor(self) -> float:
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                return 1.0 / float(self.num_batches_tracked)
            return float(self.momentum)
        return 0.0 if self.momentum is None else float(self.momentum)

    def _needs_sync(self) -> bool:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(group_or_world(self.process_group)) > 1

    def forward(self, input: torch.Tensor, z: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._check_input_dim(input)
        channels = input.shape[-1] if self.channel_last else input.shape[1]
        if channels != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got an input with {channels} channels "
                             f"(shape {list(input.shape)}, channel_last={self.channel_last})")
        sync = self._needs_sync()
        if sync:
            self._agree_across_ranks()
        if sync and input.device.type not in _torch_sync_devices():
            factor = self._factor()
            track = self.track_running_stats
            out = _SyncBatchNormCPU.apply(input, self.weight, self.bias, self.running_mean if track else None,
                                          self.running_var if track else None, self.eps, factor,
                                          self.process_group, self.channel_last)
        else:
            # torch's implementation: synchronized where it supports the device, plain batch norm otherwise
            # (outside training, one rank, no process group). Called unbound: this module has every attribute
            # it reads (process_group, momentum, running stats, _check_* methods).
            base = torch.nn.SyncBatchNorm if sync else torch.nn.modules.batchnorm._BatchNorm
            forward = base.forward
            if self.channel_last:
                out = forward(self, input.movedim(-1, 1)).movedim(1, -1)
            else:
                out = forward(self, input)
        if z is not None:
            out = out + z
        if self.fuse_relu:
            out = F.relu(out)
        return out


def convert_syncbn_model(module: torch.nn.Module, process_group: Any = None, channel_last: bool = False
                         ) -> torch.nn.Module:
    """Replace every BatchNorm*d in ``module`` (recursively) by an equivalent :class:`SyncBatchNorm`.

    Parameters, buffers, their dtype/device and ``requires_grad`` are carried over;
    the (possibly new) root module is returned. TypeError for anything but an ``nn.Module``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"convert_syncbn_model: expected an nn.Module, got {type(module).__name__}")
    # checked before the first replacement: a bad argument must not leave a half-converted model
    channel_last = check_bool(channel_last, "convert_syncbn_model: channel_last")
    check_process_group(process_group, "convert_syncbn_model: process_group")
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        ref = module.weight if module.weight is not None else module.running_mean
        kwargs = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
        sync = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                             module.track_running_stats, process_group, channel_last=channel_last, **kwargs)
        with torch.no_grad():
            if module.affine:
                sync.weight = module.weight
                sync.bias = module.bias
            if module.track_running_stats:
                sync.running_mean = module.running_mean
                sync.running_var = module.running_var
                sync.num_batches_tracked = module.num_batches_tracked
        sync.train(module.training)
        if hasattr(module, "qconfig"):
            sync.qconfig = module.qconfig
        module_out = sync
    else:
        module_out = module
    for name, child in module.named_children():
        new = convert_syncbn_model(child, process_group, channel_last)
        if new is not child:
            module_out.add_module(name, new)
    return module_out


def create_syncbn_process_group(group_size: int) -> Any:
    """Split the ranks into consecutive groups of ``group_size``; returns this rank's group (None for 0).

    Every rank must call it (creating groups is collective).
    """
    group_size = check_int(group_size, "create_syncbn_process_group: group_size", 0)
    if group_size == 0:
        return None
    world = dist.get_world_size()
    if group_size > world or world % group_size:
        raise ValueError(f"group_size {group_size} must divide the world size {world}")
    mine = dist.get_rank() // group_size
    group = None
    for g in range(world // group_size):
        pg = dist.new_group(ranks=list(range(g * group_size, (g + 1) * group_size)))
        if g == mine:
            group = pg
    return group
