"""What the torch-free kernel tests share: the extension (a build that cannot load fails loudly where
APEX_REQUIRE_EXT=1, else the importing test module is skipped) and the dtype codes and numpy storage types."""

from __future__ import annotations

import os

import numpy as np
import pytest

try:
    import apex_C
except ImportError as exc:  # a build that cannot load must fail loudly where the extension is required
    if os.environ.get("APEX_REQUIRE_EXT") == "1":
        raise
    pytest.skip(f"apex_C is not importable ({exc}); set APEX_REQUIRE_EXT=1 to make this an error",
                allow_module_level=True)

F32, F16, BF16 = 0, 1, 2
DTYPES = {"f32": F32, "f16": F16, "bf16": BF16}
STORAGE = {F32: np.float32, F16: np.float16, BF16: np.uint16}  # bf16 is stored as its raw 16 bits
LEVELS = apex_C.supported_simd_levels()
