"""What the two attention modules share: their arguments' checks, the pre-norm residual and the forward's
masks. Each module adds its parameters and its projections."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from apex._checks import check_floating, check_fraction, check_int
from apex.contrib.multihead_attn import attention
from apex.normalization import FusedLayerNorm

IMPLS = ("fast", "default")
LN_EPS = 1e-5


class MultiheadAttnBase(nn.Module):
    def __init__(self, where: str, embed_dim, num_heads, dropout, bias, include_norm_add, impl):
        super().__init__()
        self._where = where
        embed_dim = check_int(embed_dim, f"{where}: embed_dim", 1)
        num_heads = check_int(num_heads, f"{where}: num_heads", 1)
        if embed_dim % num_heads:
            raise ValueError(f"{where}: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        p = check_fraction(dropout, f"{where}: dropout")
        for name, flag in (("bias", bias), ("include_norm_add", include_norm_add)):
            if not isinstance(flag, bool):
                raise TypeError(f"{where}: {name} must be a bool, got {type(flag).__name__}")
        if impl not in IMPLS:
            raise ValueError(f"{where}: impl must be 'fast' or 'default', got {impl!r}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = p
        self.head_dim = embed_dim // num_heads
        self.bias = bias
        self.include_norm_add = include_norm_add
        self.impl = impl
        self.scaling = self.head_dim ** -0.5

    def _norm_parameters(self) -> None:
        # where upstream's two implementations kept the layer norm's parameters: their checkpoints' keys
        self.lyr_nrm_gamma_weights = self.lyr_nrm_beta_weights = self.lyr_nrm = None
        if not self.include_norm_add:
            return
        if self.impl == "fast":
            self.lyr_nrm_gamma_weights = nn.Parameter(torch.empty(self.embed_dim))
            self.lyr_nrm_beta_weights = nn.Parameter(torch.empty(self.embed_dim))
        else:
            self.lyr_nrm = FusedLayerNorm(self.embed_dim, eps=LN_EPS)

    def _reset_norm(self) -> None:
        if self.include_norm_add:
            if self.impl == "fast":
                nn.init.ones_(self.lyr_nrm_gamma_weights)
                nn.init.zeros_(self.lyr_nrm_beta_weights)
            else:
                self.lyr_nrm.reset_parameters()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "fast":
            return F.layer_norm(x, (self.embed_dim,), self.lyr_nrm_gamma_weights, self.lyr_nrm_beta_weights, LN_EPS)
        return self.lyr_nrm(x)

    def _check_input(self, name: str, x, batch: Optional[int] = None) -> None:
        where = self._where
        check_floating(x, f"{where}: {name}")
        if x.dim() != 3 or x.shape[2] != self.embed_dim:
            raise ValueError(f"{where}: {name} must have shape (time, batch, {self.embed_dim}), got "
                             f"{tuple(x.shape)}")
        if batch is not None and x.shape[1] != batch:
            raise ValueError(f"{where}: {name} must have the query's batch size ({batch}), got {x.shape[1]}")
        weight = self.out_proj_weight
        if x.device != weight.device:
            raise ValueError(f"{where}: {name} must be on the parameters' device ({weight.device}), got {x.device}")
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(f"{where}: {name} must have the parameters' dtype ({weight.dtype}) outside autocast, "
                            f"got {x.dtype}")

    def _check_masks(self, tq: int, tk: int, batch: int, key_padding_mask, attn_mask, is_training,
                     additive: bool) -> None:
        where = self._where
        if not isinstance(is_training, bool):
            raise TypeError(f"{where}: is_training must be a bool, got {type(is_training).__name__}")
        for name, mask, shape in (("key_padding_mask", key_padding_mask, (batch, tk)),
                                  ("attn_mask", attn_mask, (tq, tk))):
            if mask is not None:
                attention._check_mask(where, name, mask, shape, additive)
                if mask.device != self.out_proj_weight.device:
                    raise ValueError(f"{where}: {name} must be on the parameters' device "
                                     f"({self.out_proj_weight.device}), got {mask.device}")

    @staticmethod
    def _same_or_none(where: str, name: str, given, expected, expected_name: str) -> None:
        if given is not None and given is not expected:
            raise ValueError(f"{where}: {name} must be {expected_name} or None: this module projects its "
                             f"{'keys and values' if name == 'value' else 'queries, keys and values'} from "
                             f"{expected_name}")

    def _residual(self, query: torch.Tensor, attended: torch.Tensor, is_training: bool) -> torch.Tensor:
        if is_training and self.dropout > 0:
            attended = F.dropout(attended, p=self.dropout, training=True)
        return query + attended

    def _output(self, context: torch.Tensor, out_bias) -> Tuple[torch.Tensor, None]:
        return F.linear(context, self.out_proj_weight, out_bias), None
