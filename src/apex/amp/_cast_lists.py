"""Which functions ``amp.init()`` casts, and how (upstream amp's function lists, as data).

Each entry names an attribute of a namespace (``torch``, ``torch.Tensor``,
``torch.nn.functional``, torch's RNN backend ``torch._VF``) and a policy:

* ``HALF``: floating fp32 tensor arguments are cast to the low-precision dtype;
* ``FLOAT``: low-precision tensor arguments are cast to float32;
* ``PROMOTE``: every floating tensor argument is cast to the widest floating
  dtype among them (``SEQUENCE`` functions look inside their list argument too);
* ``BANNED``: raise ``NotImplementedError`` (float32 when ``allow_banned=True``);
* ``INPLACE_FLOAT``: the in-place form of a float function; raises
  ``NotImplementedError`` on a low-precision ``self``, which cannot hold a
  float32 result in place.

Names missing in the running torch are skipped. docs/amp.md has the tables and
the places where these lists differ from upstream's.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

HALF, FLOAT, PROMOTE, SEQUENCE, BANNED, INPLACE_FLOAT = "half", "float", "promote", "sequence", "banned", "inplace"

# torch.* ---------------------------------------------------------------------------------------------------------

TORCH_HALF = [
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "prelu",
    "addmm", "addmv", "addr", "matmul", "mm", "mv",
    # Batched matmuls: upstream lists them half when its CUDA has fast fp16 batched kernels; every backend we run
    # on has them, so they are always half here.
    "addbmm", "baddbmm", "bmm",
]

TORCH_FLOAT = [
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal", "rsqrt", "sinh", "tan",
    "pow",
    "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var",
    "renorm",
]

TORCH_PROMOTE = [
    "addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot",
    "add", "div", "mul",
    "eq", "equal", "ge", "gt", "le", "lt", "ne",
]

TORCH_SEQUENCE = ["cat", "stack"]

# torch.nn.functional.* --------------------------------------------------------------------------------------------

FUNCTIONAL_HALF = [
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "linear",
]

FUNCTIONAL_FLOAT = [
    "interpolate",
    "softplus", "softmin", "log_softmax", "softmax",
    "layer_norm", "group_norm", "local_response_norm", "normalize", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss", "kl_div", "l1_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss",
    "nll_loss", "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss", "triplet_margin_loss",
]

#: the losses among them
FUNCTIONAL_LOSSES = [n for n in FUNCTIONAL_FLOAT
                     if n.endswith("_loss") or n in ("cross_entropy", "kl_div", "binary_cross_entropy_with_logits")]

#: what amp.initialize's O1 casts to float32 wherever it is called (its forward is autocast): the losses and the
#: softmax family, which loss code applies to the forward's low-precision output (transformers' label smoothing
#: takes log_softmax of the logits); torch's CUDA autocast runs the softmax family in float32 as well
FUNCTIONAL_SESSION_FLOAT = [*FUNCTIONAL_LOSSES, "softmin", "log_softmax", "softmax"]

BCE_MESSAGE = (
    "amp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss`: it needs the output of "
    "the previous function to be float32 already. Most models have a sigmoid right before BCELoss; "
    "torch.nn.BCEWithLogitsLoss combines the two and works with amp. Another option is "
    "amp.register_float_function(torch, 'sigmoid') before amp.init(). To run binary_cross_entropy in float32 "
    "anyway, pass allow_banned=True to amp.init()."
)

FUNCTIONAL_BANNED = {"binary_cross_entropy": BCE_MESSAGE}

# torch.Tensor methods --------------------------------------------------------------------------------------------

TENSOR_HALF = ["__matmul__", *TORCH_HALF]
TENSOR_FLOAT = ["__pow__", "__rpow__", "cpu", *TORCH_FLOAT]
TENSOR_PROMOTE = list(TORCH_PROMOTE)
# ``x **= y`` on a low-precision x cannot become float32 in place.
TENSOR_INPLACE_FLOAT = ["__ipow__"] + [name + "_" for name in TORCH_FLOAT]

# RNN backend (what nn.RNN / LSTM / GRU and their cells call) ------------------------------------------------------

RNN_HALF = ["rnn_tanh", "rnn_relu", "lstm", "gru", "rnn_tanh_cell", "rnn_relu_cell", "lstm_cell", "gru_cell"]


def policy_table() -> List[Tuple[str, Dict[str, str]]]:
    """``[(namespace, {name: policy})]`` for the namespaces amp.init patches, in patch order."""
    torch_ns: Dict[str, str] = {}
    for names, policy in ((TORCH_HALF, HALF), (TORCH_FLOAT, FLOAT), (TORCH_PROMOTE, PROMOTE),
                          (TORCH_SEQUENCE, SEQUENCE)):
        torch_ns.update(dict.fromkeys(names, policy))
    tensor_ns: Dict[str, str] = {}
    for names, policy in ((TENSOR_HALF, HALF), (TENSOR_FLOAT, FLOAT), (TENSOR_PROMOTE, PROMOTE),
                          (TENSOR_INPLACE_FLOAT, INPLACE_FLOAT)):
        tensor_ns.update(dict.fromkeys(names, policy))
    functional_ns: Dict[str, str] = {}
    for names, policy in ((FUNCTIONAL_HALF, HALF), (FUNCTIONAL_FLOAT, FLOAT), (list(FUNCTIONAL_BANNED), BANNED)):
        functional_ns.update(dict.fromkeys(names, policy))
    return [
        ("torch", torch_ns),
        ("torch.nn.functional", functional_ns),
        ("torch.Tensor", tensor_ns),
        ("torch._VF", dict.fromkeys(RNN_HALF, HALF)),
    ]
