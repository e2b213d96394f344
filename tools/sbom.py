"""CycloneDX 1.5 JSON SBOM of a release directory, written by `nox -s release`.

What it records, and why:
  metadata.component  apex itself (pkg:pypi/apex@<version>)
  components
    - every wheel and the sdist, with SHA-256 (what is shipped)
    - torch, the runtime requirement (not bundled: the wheels link no libtorch), with its version range
    - the build and test images: the public manylinux image (its digest pins it) or the locally bootstrapped Debian
      images, whose digests pin nothing; for those every Debian package (pkg:deb purl with version and arch) and
      every CPython interpreter copied in is listed, from the image's recorded dpkg manifest
    - the build/test tooling from the offline wheelhouse (pkg:pypi purls with SHA-256), scope "excluded": used to
      build and test, not shipped
  dependencies        each wheel -> torch
The serial number and timestamp derive from SOURCE_DATE_EPOCH and the artifacts' hashes, so the same release
inputs give the same SBOM bytes.

    python -m tools.sbom dist/release --images IMAGE_MANIFEST.json ... [--base-image REF] -o dist/release/sbom.cdx.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path

import tomllib

from tools.util import sha256 as _sha256

ROOT = Path(__file__).resolve().parent.parent
WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<ver>[^-]+)-(?P<rest>.+)\.whl$")
GENERATOR = "apex tools/sbom.py"


def _hashes(digest: str) -> list[dict]:
    return [{"alg": "SHA-256", "content": digest}]


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def artifact_components(release: Path) -> list[dict]:
    out = []
    for path in sorted(release.iterdir()):
        if path.suffix == ".whl" or path.name.endswith(".tar.gz"):
            kind = "wheel" if path.suffix == ".whl" else "sdist"
            out.append({
                "type": "file",
                "bom-ref": f"artifact:{path.name}",
                "name": path.name,
                "hashes": _hashes(_sha256(path)),
                "properties": [{"name": "apex:artifact", "value": kind},
                               {"name": "apex:size", "value": str(path.stat().st_size)}],
            })
    return out


def image_components(manifests: list[dict], public_refs: list[str]) -> list[dict]:
    out = []
    for ref in public_refs:
        name, _, digest = ref.partition("@")
        out.append({"type": "container", "bom-ref": f"image:{ref}", "name": name, "scope": "excluded",
                    "version": digest or "unpinned",
                    "properties": [{"name": "apex:role", "value": "build/test base image (public, pinned by digest)"}]})
    for man in manifests:
        ref = f"image:{man['image']}"
        suite = man["spec"]["suite"]
        arch = man["debian_arch"]
        children = [{
            "type": "library", "bom-ref": f"{ref}#deb:{p['name']}:{p['arch']}", "name": p["name"],
            "version": p["version"],
            "purl": f"pkg:deb/debian/{p['name']}@{p['version']}?arch={p['arch']}&distro={suite}",
        } for p in man["packages"]]
        for v, py in sorted(man.get("pythons", {}).items()):
            children.append({
                "type": "application", "bom-ref": f"{ref}#cpython:{v}", "name": "cpython",
                "version": py["full_version"], "hashes": _hashes(py["sha256"]),
                "properties": [{"name": "apex:path", "value": py["path"]},
                               {"name": "apex:source", "value": f"copied from this build host ({py['source']})"}],
            })
        out.append({
            "type": "container", "bom-ref": ref, "name": man["image"].split(":")[0], "version": man["key"],
            "scope": "excluded",
            "description": f"Debian {suite} {arch} minbase bootstrapped locally with debootstrap from {man['mirror']}"
                           f" ({man['created']}); {man['note']}",
            "properties": [{"name": "apex:role", "value": f"{man['spec']['role']} image"},
                           {"name": "apex:image-id", "value": man.get("image_id", "")}],
            "components": children,
        })
    return out


def tooling_components(wheelhouse: list[dict]) -> list[dict]:
    out = []
    for w in wheelhouse:
        m = WHEEL.match(w["file"])
        if not m:
            continue
        name = m.group("name").lower().replace("_", "-")
        out.append({"type": "library", "bom-ref": f"tool:{w['file']}", "name": name, "version": m.group("ver"),
                    "purl": f"pkg:pypi/{name}@{m.group('ver')}", "scope": "excluded", "hashes": _hashes(w["sha256"]),
                    "properties": [{"name": "apex:role", "value": "build/test tooling (offline wheelhouse)"},
                                   {"name": "apex:file", "value": w["file"]}]})
    return out


def make_sbom(release: Path, manifests: list[dict], public_refs: list[str], wheelhouse: list[dict]) -> dict:
    project = _project()
    version = project["version"]
    artifacts = artifact_components(release)
    torch_req = next((d for d in project.get("dependencies", []) if d.replace(" ", "").startswith("torch")), "torch")
    torch = {"type": "library", "bom-ref": "pkg:pypi/torch", "name": "torch", "scope": "required",
             "purl": "pkg:pypi/torch", "description": f"runtime requirement {torch_req} (not bundled; no libtorch "
             "linked: the wheels serve every torch version in that range)"}
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "315532800"))
    seed = json.dumps([a["hashes"] for a in artifacts], sort_keys=True)
    serial = uuid.uuid5(uuid.NAMESPACE_URL, f"apex-{version}-{hashlib.sha256(seed.encode()).hexdigest()}")
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{serial}",
        "version": 1,
        "metadata": {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch)),
            "tools": {"components": [{"type": "application", "name": GENERATOR}]},
            "component": {"type": "library", "bom-ref": f"pkg:pypi/apex@{version}", "name": "apex",
                          "version": version, "purl": f"pkg:pypi/apex@{version}",
                          "description": project.get("description", "")},
        },
        "components": [*artifacts, torch, *image_components(manifests, public_refs), *tooling_components(wheelhouse)],
        "dependencies": [*({"ref": a["bom-ref"], "dependsOn": ["pkg:pypi/torch"]}
                           for a in artifacts if a["name"].endswith(".whl")),
                         {"ref": "pkg:pypi/torch", "dependsOn": []}],
    }


def validate(sbom: dict) -> str:
    """Validate against the official CycloneDX 1.5 JSON schema when cyclonedx-python-lib is installed."""
    try:
        from cyclonedx.schema import SchemaVersion
        from cyclonedx.validation.json import JsonStrictValidator
    except ImportError:
        return "not validated (cyclonedx-python-lib[json-validation] not installed)"
    error = JsonStrictValidator(SchemaVersion.V1_5).validate_str(json.dumps(sbom))
    if error is not None:
        raise ValueError(f"SBOM does not validate against the CycloneDX 1.5 schema: {error}")
    return "valid against the CycloneDX 1.5 JSON schema (cyclonedx-python-lib, strict)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("release", type=Path)
    ap.add_argument("--images", nargs="*", type=Path, default=[], help="local image manifests (.json)")
    ap.add_argument("--base-image", action="append", default=[], help="public image references used")
    ap.add_argument("--wheelhouse", type=Path, help="JSON listing of the offline wheelhouse")
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args(argv)
    manifests = [json.loads(p.read_text()) for p in args.images]
    tools = json.loads(args.wheelhouse.read_text()) if args.wheelhouse else []
    sbom = make_sbom(args.release, manifests, args.base_image, tools)
    status = validate(sbom)
    args.output.write_text(json.dumps(sbom, indent=1, sort_keys=True) + "\n")
    print(f"{args.output}: {len(sbom['components'])} top-level components; {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
