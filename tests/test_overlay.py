"""patch/overlay.py: one wheel from an upstream NVIDIA Apex checkout plus ours, ours winning on conflicts.

Nothing from upstream is committed or downloaded: each test writes a small tree shaped like
upstream (setup.py, apex/__init__.py with helpers and a CUDA-only import, apex/optimizers/ with
a module we replace and one we do not have, apex/normalization/, apex/parallel/ with a LARC of
its own, optionally an old-style apex/amp/, a prebuilt top-level extension) and checks the
merged wheel's contents, its RECORD, the manifest and patch, what imports from where in a fresh
interpreter that sees only the unpacked wheel, and the errors for paths that are not an Apex tree.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OVERLAY_PY = ROOT / "patch" / "overlay.py"

if not OVERLAY_PY.is_file():  # the suite also runs from a copy of tests/ against an installed wheel
    pytest.skip("patch/overlay.py is not next to these tests (run from the source tree)", allow_module_level=True)


def _load_overlay():
    spec = importlib.util.spec_from_file_location("apex_overlay_tool", OVERLAY_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


ov = _load_overlay()

UPSTREAM_FILES = {
    "setup.py": 'from setuptools import setup, find_packages\nsetup(name="apex", version="0.1", '
                'packages=find_packages())\n',
    "LICENSE": "upstream license text\n",
    "apex/__init__.py": """\
        import logging
        import warnings

        import torch

        from . import optimizers
        from . import normalization

        __all__ = ["optimizers", "normalization"]

        import fused_layer_norm_cuda  # a CUDA-only extension: missing here, the overlay skips this statement

        import amp_C  # NVIDIA's multi-tensor ops: not in this wheel, so apex's fallback finder serves them

        UPSTREAM_MARK = "upstream init ran"


        def check_cudnn_version_and_warn(global_option: str, required_cudnn_version: int) -> bool:
            return torch.backends.cudnn.is_available()


        class DeprecatedFeatureWarning(FutureWarning):
            pass
        """,
    "apex/optimizers/__init__.py": """\
        from .fused_adam import FusedAdam
        from .upstream_lars import UpstreamLARS

        __all__ = ["FusedAdam", "UpstreamLARS"]
        """,
    "apex/optimizers/fused_adam.py": "UPSTREAM_FUSED_ADAM = True\n\nclass FusedAdam:\n    pass\n",
    "apex/optimizers/upstream_lars.py": """\
        import torch


        class UpstreamLARS(torch.optim.SGD):
            upstream_only = True
        """,
    "apex/normalization/__init__.py": "from .upstream_layer_norm import UpstreamLayerNorm\n",
    "apex/normalization/upstream_layer_norm.py": """\
        import torch


        class UpstreamLayerNorm(torch.nn.LayerNorm):
            upstream_only = True
        """,
    "apex/parallel/__init__.py": """\
        from .LARC import LARC
        from .upstream_helper import UpstreamHelper
        """,
    "apex/parallel/LARC.py": "class LARC:\n    upstream = True\n",
    "apex/parallel/upstream_helper.py": "class UpstreamHelper:\n    upstream_only = True\n",
    "apex/contrib/__init__.py": "",
    "apex/contrib/upstream_only_feature/__init__.py": "UPSTREAM_CONTRIB = True\n",
    # a contrib package both sides have, whose upstream init reports its missing CUDA extension with a print
    "apex/contrib/focal_loss/__init__.py": """\
        try:
            import focal_loss_cuda
            from .focal_loss import focal_loss
            del focal_loss_cuda
        except ImportError as err:
            print("focal_loss: the CUDA extension is not installed")
        """,
}

OLD_AMP_FILES = {  # releases up to 25.05 still shipped amp
    "apex/amp/__init__.py": "from .frontend import initialize\nfrom .upstream_opt import UpstreamAmpHelper\n",
    "apex/amp/frontend.py": "def initialize(*args, **kwargs):\n    return 'upstream amp'\n",
    "apex/amp/upstream_opt.py": "class UpstreamAmpHelper:\n    upstream_only = True\n",
}


def write_upstream(root: Path, with_amp: bool = False) -> Path:
    files = dict(UPSTREAM_FILES, **(OLD_AMP_FILES if with_amp else {}))
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    # a prebuilt top-level extension of upstream (bytes only: never loaded)
    import importlib.machinery

    (root / f"amp_C{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"\x7fELF not really")
    return root


@pytest.fixture(scope="module")
def our_ext() -> str:
    spec = importlib.util.find_spec("apex_C")
    if spec is None or not spec.origin:
        pytest.skip("apex_C is not built")
    return spec.origin


def snapshot_ours(tmp_path: Path) -> Path:
    """A copy of our package, so the comparisons below see exactly what was merged."""
    dst = tmp_path / "ours" / "apex"
    if not dst.exists():
        shutil.copytree(ROOT / "src" / "apex", dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in ov.HOOK_FILES:  # the `import amp_C` start-up hook sits beside the package
            shutil.copy(ROOT / "src" / name, dst.parent / name)
    return dst


def build(tmp_path: Path, our_ext: str, with_amp: bool = False):
    upstream = write_upstream(tmp_path / "upstream", with_amp=with_amp)
    result = ov.overlay(str(upstream), str(tmp_path / "out"), ext=our_ext, ours=str(snapshot_ours(tmp_path)))
    return upstream, result


def unpack(wheel: str, where: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(where)
    return where


def run_python(code: str, path: Path, tmp_path: Path) -> str:
    """Runs `code` in a fresh interpreter that sees only `path` (plus the interpreter's own site-packages)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(path)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout


# ------------------------------------------------------------------ contents and conflict rules
@pytest.mark.parametrize("with_amp", [False, True], ids=["no-amp-release", "amp-release"])
def test_wheel_contents_and_conflicts(tmp_path, our_ext, with_amp):
    _, result = build(tmp_path, our_ext, with_amp=with_amp)
    wheel = result["outputs"]["wheel"]
    version = result["version"]
    ours_src = snapshot_ours(tmp_path)
    assert version == f"{ov.our_version(ours_src)}+upstream.0.1"
    assert Path(wheel).name == f"apex-{version}-{ov.wheel_tag()}.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        data = {n: zf.read(n) for n in names}
    # upstream-only files are kept, as they are
    for rel in ("apex/optimizers/upstream_lars.py", "apex/normalization/upstream_layer_norm.py",
                "apex/parallel/upstream_helper.py", "apex/contrib/upstream_only_feature/__init__.py"):
        assert data[rel] == (tmp_path / "upstream" / rel).read_bytes()
    # ours win on conflicting modules, and all of ours is there
    for path in ours_src.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        rel = "apex/" + path.relative_to(ours_src).as_posix()
        assert rel in names, rel
        if rel.endswith("__init__.py") and rel[: -len("__init__.py")] + "_upstream_init.py" in names:
            continue  # a merged init: checked below
        assert data[rel] == path.read_bytes(), rel
    assert data["apex/optimizers/fused_adam.py"] == (ours_src / "optimizers" / "fused_adam.py").read_bytes()
    assert data["apex/parallel/LARC.py"] == (ours_src / "parallel" / "LARC.py").read_bytes()
    # package inits both sides have: ours + the runner; upstream's kept beside; others as they are
    for up_init in sorted((tmp_path / "upstream").rglob("__init__.py")):
        rel = up_init.relative_to(tmp_path / "upstream").as_posix()
        kept = rel[: -len("__init__.py")] + "_upstream_init.py"
        ours_init = ours_src.parent / rel
        if not ours_init.is_file():
            assert data[rel] == up_init.read_bytes() and kept not in names, rel
            continue
        merged = data[rel].decode()
        assert merged.startswith(ours_init.read_text().rstrip("\n")), rel
        assert "_run_upstream_init(globals())" in merged
        assert data[kept] == up_init.read_bytes()
    assert data["apex/_overlay.py"] == (ROOT / "patch" / "overlay_runtime.py").read_bytes()
    # the `import amp_C` start-up hook, top-level as in our own wheel
    for name in ov.HOOK_FILES:
        assert data[name] == (ROOT / "src" / name).read_bytes(), name
    assert data[f"apex-{version}.dist-info/top_level.txt"] == b"_apex_amp_c\napex\napex_C\n"
    # our core; upstream binaries are left out by default
    assert Path(our_ext).name in names and data[Path(our_ext).name] == Path(our_ext).read_bytes()
    assert not any(n.startswith("amp_C") for n in names)
    # RECORD: every file with its hash and size
    dist_info = f"apex-{version}.dist-info"
    record = data[f"{dist_info}/RECORD"].decode().splitlines()
    recorded = {line.split(",")[0]: line.split(",")[1:] for line in record}
    assert set(recorded) == names
    for name, (digest, size) in recorded.items():
        if name.endswith("RECORD"):
            continue
        want = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data[name]).digest()).rstrip(b"=").decode()
        assert digest == want and int(size) == len(data[name]), name
    metadata = data[f"{dist_info}/METADATA"].decode()
    assert "Name: apex\n" in metadata and f"Version: {version}\n" in metadata and "Requires-Dist: torch" in metadata
    assert data[f"{dist_info}/UPSTREAM_LICENSE"] == b"upstream license text\n"
    assert f"Tag: {ov.wheel_tag()}" in data[f"{dist_info}/WHEEL"].decode()

    # manifest: next to the wheel and inside it, one entry per file with its origin
    manifest = json.loads(Path(result["outputs"]["manifest"]).read_text())
    assert manifest == json.loads(data["apex/_overlay_manifest.json"])
    files = manifest["files"]
    assert files["apex/optimizers/fused_adam.py"]["origin"] == "ours"
    assert files["apex/optimizers/fused_adam.py"]["replaces_upstream"] is True
    assert files["apex/optimizers/upstream_lars.py"]["origin"] == "upstream"
    assert files["apex/__init__.py"]["origin"] == "merged"
    assert files["apex/amp/frontend.py"]["origin"] == "ours"
    assert files["apex/amp/frontend.py"]["replaces_upstream"] is with_amp
    assert files["apex/_overlay.py"]["origin"] == "overlay"
    assert files["apex-amp_C.pth"]["origin"] == files["_apex_amp_c.py"]["origin"] == "ours"
    assert set(manifest["replaced"]) >= {"apex/optimizers/fused_adam.py", "apex/parallel/LARC.py", "apex/__init__.py"}
    assert any(n.startswith("amp_C") for n in manifest["left_out"])
    assert manifest["upstream"]["version"] == "0.1"
    for rel, entry in files.items():
        assert entry["sha256"] == hashlib.sha256(data[rel]).hexdigest(), rel
    if with_amp:
        assert data["apex/amp/upstream_opt.py"] == (tmp_path / "upstream" / "apex/amp/upstream_opt.py").read_bytes()


def test_patch_reproduces_the_merged_sources(tmp_path, our_ext):
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    upstream, result = build(tmp_path, our_ext)
    patch = Path(result["outputs"]["patch"]).read_text()
    assert "diff --git a/apex/optimizers/fused_adam.py b/apex/optimizers/fused_adam.py" in patch
    assert "new file mode 100644" in patch
    assert f"Binary files in the wheel, not in this patch:\n  {Path(our_ext).name}\n" in patch
    work = tmp_path / "applied"
    shutil.copytree(upstream, work)
    done = subprocess.run([git, "apply", "--whitespace=nowarn", str(Path(result["outputs"]["patch"]))], cwd=work,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    with zipfile.ZipFile(result["outputs"]["wheel"]) as zf:
        for name in zf.namelist():
            if name.startswith("apex/") and name.endswith(".py"):
                assert (work / name).read_bytes() == zf.read(name), name


# ------------------------------------------------------------------ what imports from where
@pytest.mark.parametrize("with_amp", [False, pytest.param(True, marks=pytest.mark.full)],
                         ids=["no-amp-release", "amp-release"])
def test_merged_wheel_imports(tmp_path, our_ext, with_amp):
    _, result = build(tmp_path, our_ext, with_amp=with_amp)
    site = unpack(result["outputs"]["wheel"], tmp_path / "site")
    out = run_python(f"""
        import json, apex, torch
        from apex import _overlay
        from apex.optimizers import FusedAdam, UpstreamLARS, CombinedOptimizer
        from apex.normalization import UpstreamLayerNorm
        from apex.parallel import LARC, UpstreamHelper
        from apex.contrib.combine_tensors import combine_tensors
        from apex.contrib.focal_loss import focal_loss, FocalLoss   # ours; upstream's init printed into the log
        from apex.contrib.upstream_only_feature import UPSTREAM_CONTRIB  # upstream-only contrib package
        from apex import amp
        import apex_C
        assert apex.__file__.startswith({str(site)!r}), apex.__file__
        assert apex_C.__file__.startswith({str(site)!r}), apex_C.__file__
        assert apex.__version__ == {result["version"]!r}
        assert apex.__build_variant__ == "overlay on NVIDIA Apex 0.1"
        assert issubclass(FusedAdam, CombinedOptimizer)          # ours won
        assert UpstreamLARS.upstream_only and UpstreamLayerNorm.upstream_only and UpstreamHelper.upstream_only
        assert not hasattr(LARC, "upstream") and issubclass(LARC, torch.optim.Optimizer)            # ours won
        assert apex.UPSTREAM_MARK == "upstream init ran"           # upstream's init ran after the failing import
        assert apex.check_cudnn_version_and_warn("x", 1) in (True, False)
        assert "UpstreamLARS" in apex.optimizers.__all__ and "FusedAdam" in apex.optimizers.__all__
        assert amp.initialize.__module__ == "apex.amp.frontend" and "upstream" not in repr(amp.initialize)
        assert hasattr(amp, "UpstreamAmpHelper") == {with_amp!r}    # upstream-only amp names still there
        failed = [r for r in _overlay.REPORT if r["status"] == "failed"]
        assert [r["package"] for r in failed] == ["apex"] and "fused_layer_norm_cuda" in failed[0]["error"], failed
        assert apex.amp_C.__apex_fallback__                         # upstream's `import amp_C` got our ops
        assert focal_loss.FocalLoss is FocalLoss and UPSTREAM_CONTRIB
        printed = [r for r in _overlay.REPORT if r.get("printed")]
        assert [(r["package"], r["printed"]) for r in printed] == [
            ("apex.contrib.focal_loss", "focal_loss: the CUDA extension is not installed\\n")], printed
        skipped = [r for r in _overlay.REPORT if r["status"] == "skipped" and r["package"] == "apex.optimizers"]
        assert len(skipped) == 1                                    # `from .fused_adam import FusedAdam`: ours
        p = torch.nn.Parameter(torch.ones(3))
        opt = FusedAdam([p], lr=0.1)
        p.grad = torch.ones(3)
        opt.step()
        assert opt.last_executor == "apex_C"
        from apex.__main__ import collect  # what `python -m apex` reports
        print(json.dumps(collect()))
    """, site, tmp_path)
    assert "CUDA extension is not installed" not in out
    info = json.loads(out.strip().splitlines()[-1])
    assert info["apex"] == result["version"] and info["core"]["loaded"] is True
    assert info["core"]["path"].startswith(str(site))


def test_cli_writes_outputs(tmp_path, our_ext, capsys):
    upstream = write_upstream(tmp_path / "upstream")
    assert ov.main([str(upstream), "--out", str(tmp_path / "dist"), "--ext", our_ext]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    wheel = Path(out[-1])
    assert wheel.is_file() and wheel.suffix == ".whl"
    assert Path(str(wheel) + ".manifest.json").is_file() and Path(str(wheel) + ".patch").is_file()


def test_upstream_extensions_on_request(tmp_path, our_ext):
    upstream = write_upstream(tmp_path / "upstream")
    result = ov.overlay(str(upstream), str(tmp_path / "out"), ext=our_ext, upstream_ext=True)
    with zipfile.ZipFile(result["outputs"]["wheel"]) as zf:
        assert any(n.startswith("amp_C") for n in zf.namelist())
    assert result["files"][next(n for n in result["files"] if n.startswith("amp_C"))]["origin"] == "upstream"


# ------------------------------------------------------------------ errors
def test_not_an_apex_tree(tmp_path, our_ext):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ov.overlay(str(tmp_path / "missing"), str(tmp_path / "out"), ext=our_ext)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="expected a directory"):
        ov.overlay(str(tmp_path / "file"), str(tmp_path / "out"), ext=our_ext)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "setup.py").write_text("")
    with pytest.raises(ov.OverlayError, match=r"expected an NVIDIA Apex checkout.*has no apex/__init__\.py"):
        ov.overlay(str(empty), str(tmp_path / "out"), ext=our_ext)
    no_setup = tmp_path / "no_setup"
    (no_setup / "apex").mkdir(parents=True)
    (no_setup / "apex" / "__init__.py").write_text("")
    with pytest.raises(ov.OverlayError, match=r"neither setup\.py nor pyproject\.toml"):
        ov.overlay(str(no_setup), str(tmp_path / "out"), ext=our_ext)
    with pytest.raises(ov.OverlayError, match="own source tree"):
        ov.overlay(str(ROOT), str(tmp_path / "out"), ext=our_ext)
    assert not (tmp_path / "out").exists()  # nothing written for a rejected input


def test_bad_extension_and_name_collision(tmp_path, our_ext):
    upstream = write_upstream(tmp_path / "upstream")
    bogus = tmp_path / "libsomething.so"
    bogus.write_bytes(b"")
    with pytest.raises(ov.OverlayError, match="expected our apex_C extension"):
        ov.overlay(str(upstream), str(tmp_path / "out"), ext=str(bogus))
    (upstream / "apex" / "optimizers" / "_upstream_init.py").write_text("")
    with pytest.raises(ov.OverlayError, match=r"cannot keep upstream's apex/optimizers/__init__\.py"):
        ov.overlay(str(upstream), str(tmp_path / "out"), ext=our_ext)


def test_missing_start_up_hook(tmp_path, our_ext):
    upstream = write_upstream(tmp_path / "upstream")
    ours = snapshot_ours(tmp_path)
    (ours.parent / "apex-amp_C.pth").unlink()
    with pytest.raises(ov.OverlayError, match=r"apex-amp_C\.pth' does not exist: the `import amp_C` start-up hook"):
        ov.overlay(str(upstream), str(tmp_path / "out"), ext=our_ext, ours=str(ours))
    assert not (tmp_path / "out").exists()


def test_cli_error_exit_code(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        ov.main([str(tmp_path / "nope"), "--out", str(tmp_path / "dist"), "--ext", "x"])
    assert exc.value.code == 2
    assert "does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------ pyproject reading
def test_requirements_keep_extras_and_markers(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\nversion = "1"\ndependencies = [\n    "torch>=2.1",\n'
                         '    "accelerate[testing,deepspeed] >= 1.0 ; python_version < \'3.12\'",\n]\n')
    assert ov.our_requirements(pyproject) == ["torch>=2.1",
                                              'accelerate[deepspeed,testing]>=1.0; python_version < "3.12"']
    assert ov.our_requirements(tmp_path / "missing.toml") == []
    assert ov.our_requirements() == ["torch>=2.7"]  # this project's own pyproject


def test_bad_requirements_are_errors(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["torch >= = 2"]\n')
    with pytest.raises(ov.OverlayError, match="invalid requirement 'torch >= = 2'"):
        ov.our_requirements(pyproject)
    pyproject.write_text('[project]\ndependencies = "torch"\n')
    with pytest.raises(ov.OverlayError, match="must be a list of requirement strings"):
        ov.our_requirements(pyproject)
    pyproject.write_text('[project\n')
    with pytest.raises(ov.OverlayError, match="not valid TOML"):
        ov.our_requirements(pyproject)


def test_upstream_version_from_setup_or_pyproject(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\n[project]\nname = "apex"\n'
                                             'version = "0.2.dev0"\n[tool.x]\nversion = "9"\n')
    assert ov.upstream_version(tmp_path) == "0.2.dev0"
    (tmp_path / "setup.py").write_text('setup(name="apex", version="0.1")\n')
    assert ov.upstream_version(tmp_path) == "0.1"
    (tmp_path / "setup.py").write_text("setup(name='apex')\n")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "apex"\ndynamic = ["version"]\n')
    assert ov.upstream_version(tmp_path) == "unknown"
