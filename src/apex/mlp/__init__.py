"""``apex.mlp``: NVIDIA Apex's ``MLP`` module (see :mod:`apex.mlp.mlp`)."""

from apex.mlp.mlp import MLP, MlpFunction, mlp_function

__all__ = ["MLP", "MlpFunction", "mlp_function"]
