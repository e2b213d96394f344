"""DeepSpeed's ``"amp"`` config section over this package (full tier; needs DeepSpeed < 0.18, tested with
0.17.6: ``DS_ACCELERATOR=cpu pip install deepspeed==0.17.6``).

DeepSpeed's engine calls ``amp.initialize(module, optimizer, **amp_params)``, ``amp.scale_loss(loss,
optimizer, delay_unscale=...)`` (gradient accumulation) and clips ``amp.master_params(optimizer)``. One rank on
the CPU accelerator, in a child process (tests/_deepspeed_amp.py): at O1 and O2, with a torch.optim optimizer
and ours, with and without accumulation + clipping, the loss falls and a run resumed from a DeepSpeed
checkpoint equals the uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.full

SCRIPT = Path(__file__).with_name("_deepspeed_amp.py")


def _deepspeed_version():
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        return Version(version("deepspeed"))
    except PackageNotFoundError:
        pytest.skip("DeepSpeed is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.devices("cpu")
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_deepspeed_amp_trains_and_resumes_bit_for_bit(opt_level):
    if _deepspeed_version().release >= (0, 18):
        pytest.skip("DeepSpeed 0.18 asserts that amp is disabled in its own backward hook (any apex)")
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_PORT=str(_free_port()))
    proc = subprocess.run([sys.executable, str(SCRIPT), opt_level], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 8, proc.stdout[-2000:]
    for row in rows:
        what = f"{row['name']} accumulation={row['accumulation']} clip={row['clip']}"
        losses = row["losses"]
        assert row["amp_initialized"], what
        assert (opt_level == "O2") == any(d in ("torch.bfloat16", "torch.float16") for d in row["dtypes"]), what
        assert sum(losses[-8:]) < 0.9 * sum(losses[:8]), (what, losses)
        assert row["resume_diff"] == 0.0, what
