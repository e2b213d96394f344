"""apex.parallel: what upstream NVIDIA Apex's apex.parallel provides, on every device.

Each export lives in its own module; add new ones below in the same form.
Distributed pieces ride torch.distributed (backend per device:
:func:`default_backend`); docs/distributed.md describes them.
"""

from .. import _torch_workarounds  # noqa: F401  (imported for its effect)
from ._comm import CollectiveError, default_backend
from .distributed import DistributedDataParallel, flat_dist_call
from .LARC import LARC
from .reducer import Reducer
from .sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

__all__ = [
    "LARC",
    "CollectiveError",
    "DistributedDataParallel",
    "Reducer",
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
    "default_backend",
    "flat_dist_call",
]
