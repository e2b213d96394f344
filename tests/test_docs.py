"""The documentation is executable: runnable code blocks run, links resolve, docs/api.md matches the code.

Convention: a fenced ```python block whose preceding non-blank line is exactly `<!-- runnable -->` is runnable.
Each runnable block is a self-contained program; it runs in its own interpreter on CPU (APEX_DEVICE=cpu), started
together with the others so torch's import is paid in parallel. A failing block is reported with its file and line.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if not ((ROOT / "docs").is_dir() and (ROOT / "README.md").is_file()):
    # `nox -s test-wheel` runs a copy of tests/ alone, away from the checkout; the `tests` session covers these
    pytest.skip(f"README.md and docs/ not found beside tests/ (under {ROOT})", allow_module_level=True)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = "<!-- runnable -->"
TIMEOUT_S = 300  # only guards against a hang: each block takes seconds


def runnable_blocks(path: Path):
    """(line number, code) of every runnable block; a marker not followed by a python fence is an error."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j >= len(lines) or lines[j].strip() != "```python":
            raise AssertionError(f"{path.name}:{i + 1}: {MARKER} must be followed by a ```python block, "
                                 f"got {lines[j].strip() if j < len(lines) else 'end of file'!r}")
        end = j + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end >= len(lines):
            raise AssertionError(f"{path.name}:{j + 1}: unterminated code block")
        blocks.append((j + 2, "\n".join(lines[j + 1:end]) + "\n"))
    return blocks


BLOCKS = [(p, line, code) for p in DOCS if p.exists() for line, code in runnable_blocks(p)]
IDS = [f"{p.relative_to(ROOT)}:{line}" for p, line, _ in BLOCKS]


def _env() -> dict:
    # one thread each: the runs overlap, and on a small machine 2-thread runs side by side only contend
    env = dict(os.environ, APEX_DEVICE="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    src = str(ROOT / "src")
    if (ROOT / "src" / "apex").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), src]))
    return env


@pytest.fixture(scope="module")
def block_runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("doc_blocks")  # blocks may write files: keep them out of the checkout
    procs = {}
    for ident, (_, _, code) in zip(IDS, BLOCKS):
        procs[ident] = subprocess.Popen([sys.executable, "-c", code], cwd=str(workdir), env=_env(),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_there_are_runnable_blocks():
    names = {p.name for p, _, _ in BLOCKS}
    assert "README.md" in names and "migration.md" in names, f"runnable blocks found only in {sorted(names)}"


@pytest.mark.parametrize("ident", IDS)
def test_runnable_block(ident, block_runs):
    proc = block_runs[ident]
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"block at {ident} still running after {TIMEOUT_S} s\n{err[-4000:]}")
    assert proc.returncode == 0, f"block at {ident} failed ({proc.returncode})\n--- stdout\n{out}\n--- stderr\n{err}"


def test_marker_must_precede_a_python_block(tmp_path):
    bad = tmp_path / "bad.md"
    bad.write_text(f"text\n{MARKER}\n\n```bash\necho hi\n```\n", encoding="utf-8")
    with pytest.raises(AssertionError, match=r"bad.md:2: .* must be followed by a ```python block, got '```bash'"):
        runnable_blocks(bad)
    good = tmp_path / "good.md"
    good.write_text(f"{MARKER}\n```python\nx = 1\n```\n```python\nnot run\n```\n", encoding="utf-8")
    assert runnable_blocks(good) == [(3, "x = 1\n")]


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", [p for p in DOCS if p.exists()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)  # links inside code are code
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # URLs and in-page anchors
        if not (doc.parent / target.split("#", 1)[0]).exists():
            missing.append(target)
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


def _load_gen_api():
    spec = importlib.util.spec_from_file_location("_gen_api", ROOT / "docs" / "_gen_api.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_api_reference_matches_the_code():
    gen = _load_gen_api()
    expected = gen.generate()
    current = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert current == expected, "docs/api.md is out of date: run `PYTHONPATH=src python docs/_gen_api.py`"


def test_api_reference_covers_every_public_name():
    gen = _load_gen_api()
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    for modname, _, names in gen.MODULES:
        mod = importlib.import_module(modname)
        for name in names if names is not None else mod.__all__:
            assert f"### `{modname}.{name}`" in text, f"{modname}.{name} is public but not in docs/api.md"
    # every note is attached to a name that exists (a renamed function must not leave a stale note behind)
    for qual in gen.NOTES:
        modname, name = qual.rsplit(".", 1)
        assert hasattr(importlib.import_module(modname), name), f"NOTES names {qual}, which does not exist"


def test_every_public_name_has_a_differences_note():
    """Each name's entry in docs/api.md says how it differs from the NPU patch and NVIDIA Apex (NOTES)."""
    gen = _load_gen_api()
    missing = [f"{modname}.{name}" for modname, _, names in gen.MODULES
               for name in (names if names is not None else importlib.import_module(modname).__all__)
               if f"{modname}.{name}" not in gen.NOTES]
    assert not missing, f"docs/_gen_api.py NOTES has no Differences note for {missing}"
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    sections = re.split(r"^### ", text, flags=re.M)[1:]  # one per documented name, up to the next heading
    assert sections, "docs/api.md has no ### entries"
    bare = [s.splitlines()[0] for s in sections if "\n*Differences:* " not in s.split("\n## ", 1)[0]]
    assert not bare, f"docs/api.md entries without a *Differences:* note: {bare}"
