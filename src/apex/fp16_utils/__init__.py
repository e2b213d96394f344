"""Manual mixed precision (the API that preceded amp): fp16 models, fp32 master weights, loss scaling.

Same names and semantics as NVIDIA Apex's ``apex.fp16_utils``; runs on CPU, CUDA and NPU, and
accepts bf16 wherever fp16 is accepted. New code should use :mod:`apex.amp`.
"""

from apex.fp16_utils.fp16_optimizer import FP16_Optimizer
from apex.fp16_utils.fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    tofp16,
)
from apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler, to_python_float

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]
