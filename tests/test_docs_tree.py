"""The front door stays true to the tree: what README.md and docs/*.md name must exist and be what they say.

tests/test_docs.py runs the runnable blocks, resolves relative links and keeps docs/api.md generated; this file
checks the rest of what a reader acts on, without importing torch:

* every document is reachable: docs/index.md links every docs/*.md, README.md every user document;
* every `nox -s NAME` names a session that exists (noxfile.py and tools/release.py, which it imports);
* every repository path written in the text (examples/..., tests/..., tools/..., ...) exists;
* every `--flag` passed to an example script in the docs (or in the script's own docstring) is one the script
  parses;
* README's fresh-machine section is two commands;
* the topics the docs promise are there: three migration guides, each with a runnable block; troubleshooting for
  torch_npu without CANN, the ABI, devices; security notes on the hardened .so, non-root builds, umask and the
  wheel's contents;
* security.md's hardening flags are the ones setup.py passes, and the environment-variable tables list exactly
  the `APEX_*` variables the runtime reads.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if not ((ROOT / "docs").is_dir() and (ROOT / "README.md").is_file()):
    pytest.skip(f"README.md and docs/ not found beside tests/ (under {ROOT})", allow_module_level=True)

DOCS_DIR = ROOT / "docs"
README = ROOT / "README.md"
USER_DOCS = sorted(p for p in DOCS_DIR.glob("*.md") if p.name != "DESIGN-NOTES.md")
ALL_TEXT = [README, *sorted(DOCS_DIR.glob("*.md"))]
EXAMPLES = ROOT / "examples"


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _links(path: Path) -> set:
    return {t.split("#", 1)[0] for t in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", _text(path))}


def _section(text: str, heading: str) -> str:
    """The body of the markdown section whose heading starts with ``heading`` (up to the next heading of its level)."""
    m = re.search(rf"^(#+) {re.escape(heading)}.*$", text, flags=re.M)
    assert m, f"no section {heading!r}"
    level = len(m.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[m.end():], flags=re.M)
    return text[m.end():m.end() + end.start()] if end else text[m.end():]


# ---------------------------------------------------------------- reachability and names


def test_index_links_every_doc_and_readme_every_user_doc():
    index = _links(DOCS_DIR / "index.md")
    missing = [p.name for p in DOCS_DIR.glob("*.md") if p.name != "index.md" and p.name not in index]
    assert not missing, f"docs/index.md does not link {missing}"
    readme = _links(README)
    missing = [p.name for p in USER_DOCS if f"docs/{p.name}" not in readme]
    assert not missing, f"README.md does not link docs/{missing}"


def _nox_sessions() -> set:
    names = set()
    for path in [ROOT / "noxfile.py", ROOT / "tools" / "release.py"]:
        for deco, func in re.findall(r"^@nox\.session\(([^\n]*)\)\s*\ndef (\w+)", _text(path), flags=re.M):
            named = re.search(r"name=\"([\w-]+)\"", deco)
            names.add(named.group(1) if named else func)
    return names


def test_nox_sessions_named_in_the_docs_exist():
    sessions = _nox_sessions()
    assert {"tests", "build", "demo", "bench", "lint"} <= sessions, sessions
    bad = []
    for doc in ALL_TEXT:
        for name in re.findall(r"nox -s ([\w.-]+)", _text(doc)):
            base = re.sub(r"-\d+\.\d+$", "", name)  # python-parametrized sessions: kernels-3.9
            if base not in sessions:
                bad.append(f"{doc.name}: nox -s {name}")
    assert not bad, f"unknown nox sessions (have {sorted(sessions)}): {bad}"


PATH = re.compile(r"(?<![\w/.-])((?:examples|tests|docs|bench|tools|docker|csrc|src)/[\w./-]*[\w/])")


def test_repository_paths_named_in_the_docs_exist():
    bad = []
    for doc in ALL_TEXT:
        text = _text(doc)
        for m in PATH.finditer(text):
            path = m.group(1)
            if text[m.end():m.end() + 1] in ("*", "<", "{"):
                continue  # a glob or a template (examples/quickstart*.py), not one path
            if not (ROOT / path).exists():
                bad.append(f"{doc.name}: {path}")
    assert not bad, f"paths that do not exist: {sorted(bad)}"


def _example_invocations():
    """(where, script, flags) of every `python examples/X.py ...` / `torchrun ... examples/X.py ...` line."""
    sources = [*ALL_TEXT, *sorted(EXAMPLES.glob("*.py"))]
    for src in sources:
        for line in _text(src).splitlines():
            m = re.search(r"(?:python|torchrun)\b[^`\n]*?\bexamples/(\w+\.py)([^`\n#]*)", line)
            if m:
                yield src.name, m.group(1), re.findall(r"(?<!\S)(--[\w-]+)", m.group(2))


def test_example_flags_in_the_docs_are_parsed_by_the_scripts():
    seen = 0
    bad = []
    for where, script, flags in _example_invocations():
        path = EXAMPLES / script
        if not path.exists():
            bad.append(f"{where}: {script} does not exist")
            continue
        source = _text(path)
        bad += [f"{where}: {script} {flag}" for flag in flags if f'"{flag}"' not in source]
        seen += 1
    assert seen >= 4, "expected example invocations in README, docs/ and the scripts' docstrings"
    assert not bad, f"flags the scripts do not accept: {bad}"


def test_readme_fresh_machine_is_two_commands():
    body = _section(_text(README), "A fresh machine")
    block = re.search(r"```bash\n(.*?)```", body, flags=re.S)
    assert block, "no bash block in README's fresh-machine section"
    commands = [ln for ln in block.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(commands) == 2, commands


# ---------------------------------------------------------------- the promised topics


def _runnable_count(text: str) -> int:
    return len(re.findall(r"^<!-- runnable -->\s*\n```python", text, flags=re.M))


@pytest.mark.parametrize("heading", ["From NVIDIA Apex `apex.amp`", "From `torch_npu.optim`", "From `torch.amp`"])
def test_migration_guides_each_have_a_runnable_example(heading):
    body = _section(_text(DOCS_DIR / "migration.md"), heading)
    assert _runnable_count(body) >= 1, f"migration.md section {heading!r} has no runnable block"


def test_troubleshooting_topics():
    text = _text(DOCS_DIR / "troubleshooting.md")
    npu = _section(text, "`import torch` fails after installing torch_npu")
    assert "CANN" in npu and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in npu
    assert "ABI" in text and "libtorch" in text
    devices = _section(text, "Devices")
    assert "npu > cuda > cpu" in devices and "APEX_DEVICE" in devices


def test_security_topics():
    text = _text(DOCS_DIR / "security.md")
    for heading in ("What the wheel contains", "Hardened shared object", "Builds"):
        assert _section(text, heading).strip()
    builds = _section(text, "Builds")
    assert "umask 0027" in builds and "never as root" in builds


def test_security_flags_are_the_build_flags():
    table = _section(_text(DOCS_DIR / "security.md"), "Hardened shared object")
    rows = [ln.split("|") for ln in table.splitlines() if ln.startswith("| ") and "`" in ln]
    setup = _text(ROOT / "setup.py")
    flags = [f for row in rows for cell in re.findall(r"`([^`]+)`", row[2]) for f in cell.split()]
    assert len(flags) >= 6, rows
    missing = [f for f in flags if f not in setup]
    assert not missing, f"security.md lists flags setup.py does not pass: {missing}"
    for rule in ("umask 0027",):
        assert rule in _text(ROOT / "docker" / "Dockerfile.wheel")
    assert re.search(r"umask\(0o027\)", _text(ROOT / "noxfile.py"))


def _runtime_env_vars() -> set:
    found = set()
    for path in sorted((ROOT / "src" / "apex").rglob("*.py")):
        found |= set(re.findall(r"environ\.get\(\"(APEX_\w+)\"", _text(path)))
    for path in sorted((ROOT / "csrc").rglob("*.cpp")):
        found |= set(re.findall(r"getenv\(\"(APEX_\w+)\"\)", _text(path)))
    return found


@pytest.mark.parametrize("doc,heading", [("docs/troubleshooting.md", "Environment variables"),
                                         ("README.md", "How the torch-free core works")])
def test_environment_variable_tables_match_the_code(doc, heading):
    body = _section(_text(ROOT / doc), heading)
    documented = set(re.findall(r"^\| `(APEX_\w+)", body, flags=re.M))
    read = _runtime_env_vars()
    assert {"APEX_DEVICE", "APEX_SIMD", "APEX_REQUIRE_EXT"} <= read, read
    assert documented <= read, f"{doc} documents variables nothing reads: {sorted(documented - read)}"
    if doc.startswith("docs/"):  # the full table; README shows the core's and the device override
        assert documented == read, f"{doc} misses {sorted(read - documented)}"
