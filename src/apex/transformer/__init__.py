"""``apex.transformer``: the parts of NVIDIA Apex's Megatron-style package that model code uses outside model
parallelism: the enums (``AttnMaskType``, ``AttnType``, ``LayerType``, ``ModelType``), ``functional``'s fused
scale-mask softmax and rotary position embeddings, ``layers``' layer norms (which mark their parameters for
sequence parallelism) and ``log_util``, on every device.

Upstream's model-parallel machinery (``parallel_state``, ``tensor_parallel``, ``pipeline_parallel``, its ``amp``
grad scaler, ``testing``) is not part of this package: ``from apex.transformer import parallel_state``
raises ImportError, as it does where apex is absent, so code that guards that import keeps its own path.
"""

from apex.transformer import enums, functional, layers, log_util
from apex.transformer.enums import AttnMaskType, AttnType, LayerType, ModelType

__all__ = ["AttnMaskType", "AttnType", "LayerType", "ModelType", "enums", "functional", "layers", "log_util"]
