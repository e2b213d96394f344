"""apex.transformer.layers (Megatron's layer norms with sequence-parallel marks) and apex.transformer.log_util."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.nn import functional as F

from apex.contrib.layer_norm import FastLayerNorm as ContribFastLayerNorm
from apex.normalization import FusedLayerNorm as PlainFusedLayerNorm
from apex.transformer import layers, log_util
from apex.transformer.layers import FastLayerNorm, FusedLayerNorm, MixedFusedLayerNorm


@pytest.mark.parametrize("make", [
    lambda sp: FusedLayerNorm(16, sequence_parallel_enabled=sp),
    lambda sp: MixedFusedLayerNorm(16, sequence_parallel_enabled=sp),
    lambda sp: FastLayerNorm(16, sequence_parallel_enabled=sp),
], ids=["FusedLayerNorm", "MixedFusedLayerNorm", "FastLayerNorm"])
@pytest.mark.parametrize("sp", [False, True])
def test_marks_and_math(device, make, sp):
    norm = make(sp).to(device)
    assert norm.sequence_parallel_enabled is sp
    assert norm.weight.sequence_parallel_enabled is sp and norm.bias.sequence_parallel_enabled is sp
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(3, 5, 16, device=device)
    torch.testing.assert_close(norm(x), F.layer_norm(x, (16,), norm.weight, norm.bias, 1e-5))


def test_bases_and_defaults():
    assert issubclass(FastLayerNorm, ContribFastLayerNorm) and issubclass(FusedLayerNorm, PlainFusedLayerNorm)
    assert FusedLayerNorm(8).sequence_parallel_enabled is False
    plain = FusedLayerNorm(8, elementwise_affine=False, sequence_parallel_enabled=True)
    assert plain.weight is None and plain.sequence_parallel_enabled is True
    assert MixedFusedLayerNorm(8, memory_efficient=True).memory_efficient
    assert layers.__all__ == ["FastLayerNorm", "FusedLayerNorm", "MixedFusedLayerNorm"]
    with pytest.raises(TypeError, match="sequence_parallel_enabled must be a bool"):
        FastLayerNorm(8, sequence_parallel_enabled=1)
    with pytest.raises(TypeError):
        FusedLayerNorm(8, 1e-5, True, True)  # keyword only, as upstream


def test_log_util():
    logger = log_util.get_transformer_logger("apex/transformer/thing.py")
    assert logger.name == "apex/transformer/thing"
    apex_logger = logging.getLogger("apex")
    before = apex_logger.level
    try:
        log_util.set_logging_level(logging.WARNING)
        assert apex_logger.level == logging.WARNING
        log_util.set_logging_level("DEBUG")
        assert apex_logger.level == logging.DEBUG
    finally:
        apex_logger.setLevel(before)
    with pytest.raises(TypeError, match="verbosity"):
        log_util.set_logging_level(None)


def test_marks_survive_new_parameter_objects():
    # with this torch switch (and on backends whose tensors cannot stand in for the old ones) .to() makes new
    # Parameter objects; the marks are set again on them
    model = torch.nn.Sequential(FusedLayerNorm(8, sequence_parallel_enabled=True), torch.nn.Linear(8, 8))
    before = model[0].weight
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert model[0].weight is not before and model[0].weight.dtype == torch.float64
    assert model[0].weight.sequence_parallel_enabled and model[0].bias.sequence_parallel_enabled
