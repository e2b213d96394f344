"""apex.amp: automatic mixed precision (upstream NVIDIA amp's API) on npu, cuda and cpu.

See docs/amp.md. The public names are upstream's: ``initialize``,
``scale_loss``, ``master_params``, ``state_dict`` / ``load_state_dict``,
``register_{half,float,promote}_function``, the ``{half,float,promote}_function``
decorators and ``disable_casts``; ``deinitialize`` undoes ``initialize``. The
older ``init()`` API (process-wide casts with a handle) is kept as well.
"""

from .. import _torch_workarounds  # noqa: F401  (imported for its effect)
from ._amp_state import _amp_state, master_params  # noqa: F401  (upstream code reads amp._amp_state)
from ._casts import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from ._init_api import init
from .frontend import deinitialize, initialize, load_state_dict, state_dict
from .handle import AmpHandle, NoOpHandle, OptimWrapper, scale_loss
from .scaler import LossScaler

__all__ = [
    "AmpHandle",
    "LossScaler",
    "NoOpHandle",
    "OptimWrapper",
    "deinitialize",
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]
