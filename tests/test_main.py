"""``python -m apex``: version, build variant, C++ core (SIMD level), torch version, devices.

Checked against the modules themselves (apex.__version__, apex_C, torch), in-process for the
JSON and text forms, once as a real ``python -m apex`` subprocess, and with the core or ``amp_C``
made unimportable (reported, never crashing the command).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import apex
from apex import __main__ as cli


def test_json_matches_the_installed_modules(capsys):
    assert cli.main(["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["apex"] == apex.__version__
    assert info["build_variant"]
    assert info["torch"] == torch.__version__
    assert info["device"] in ("cpu", "cuda", "npu")
    assert info["cuda_devices"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    core = info["core"]
    apex_c = pytest.importorskip("apex_C")
    assert core["loaded"] is True
    assert core["simd_level"] == apex_c.simd_level()
    assert core["simd_level"] in core["supported_simd_levels"]
    assert core["supported_simd_levels"] == list(apex_c.supported_simd_levels())
    assert os.path.samefile(core["path"], apex_c.__file__)
    import _apex_amp_c

    # no NVIDIA amp_C here: `import amp_C` gives ours; the hook flag is what this interpreter's start-up did
    assert info["amp_C"] == {"ours": True, "path": None, "start_up_hook": _apex_amp_c.installed_at_start_up}


def test_text_form(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"apex {apex.__version__} ")
    assert f"torch {torch.__version__}" in out
    assert "C++ core: loaded, SIMD " in out
    assert "import amp_C: apex's multi-tensor ops; start-up hook " in out


def test_amp_c_failing_to_import_is_reported(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "amp_C", None)  # import amp_C now raises ImportError
    assert cli.main(["--json"]) == 0
    error = json.loads(capsys.readouterr().out)["amp_C"]["error"]
    assert error.startswith("ModuleNotFoundError: import of amp_C halted")
    assert cli.main([]) == 0
    assert "import amp_C: fails (ModuleNotFoundError" in capsys.readouterr().out


def test_core_missing_is_reported(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "apex_C", None)  # import apex_C now raises ImportError
    assert cli.main(["--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["core"]["loaded"] is False and info["core"]["error"]
    assert cli.main([]) == 0
    assert "C++ core: NOT loaded" in capsys.readouterr().out


def test_bad_argument_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--no-such-flag"])
    assert exc.value.code == 2
    assert "usage: python -m apex" in capsys.readouterr().err


def test_python_dash_m_apex_subprocess():
    env = dict(os.environ)
    # run the same apex the tests import (the source tree under PYTHONPATH, or the installed wheel)
    root = os.path.dirname(os.path.dirname(os.path.abspath(apex.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "apex", "--json"], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["apex"] == apex.__version__ and info["torch"] == torch.__version__
    assert info["amp_C"]["ours"] is True
