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
  dependencies        apex and each wheel -> torch
The document is built with cyclonedx-python-lib's object model and JSON writer (purls by packageurl-python, so a
Debian version's `+` is percent-encoded; wheel names parsed by packaging) and validated against the official
CycloneDX 1.5 schema before it is written; an invalid document is an error (exit 2). The serial number and timestamp
derive from SOURCE_DATE_EPOCH and the artifacts' hashes, and keys are sorted, so the same release inputs (and library
versions) give the same SBOM bytes.

    python -m tools.sbom dist/release --images IMAGE_MANIFEST.json ... [--base-image REF] -o dist/release/sbom.cdx.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import tomllib

from tools.util import sha256 as _sha256

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = "apex tools/sbom.py"
SPEC = "1.5"


class SbomError(RuntimeError):
    """A missing library or an SBOM that does not validate."""


def _libs():
    """The CycloneDX object model, its JSON writer and the purl type (imported when an SBOM is made, so the rest of
    the release tooling imports without them)."""
    try:
        from cyclonedx import model
        from cyclonedx.model import bom, component, tool
        from cyclonedx.output.json import JsonV1Dot5
        from packageurl import PackageURL
        from packaging.utils import parse_wheel_filename
    except ImportError as exc:
        raise SbomError(f"{exc.name} is not installed: pip install 'cyclonedx-python-lib[json-validation]>=8' "
                        "packageurl-python packaging") from None
    return SimpleNamespace(model=model, bom=bom, component=component, tool=tool, JsonV1Dot5=JsonV1Dot5,
                           PackageURL=PackageURL, parse_wheel_filename=parse_wheel_filename)



def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _hashes(digest: str) -> list:
    model = _libs().model
    return [model.HashType(alg=model.HashAlgorithm.SHA_256, content=digest)]


def _props(**values: str) -> list:
    model = _libs().model
    return [model.Property(name=f"apex:{k.replace('_', '-')}", value=v) for k, v in values.items()]


def artifact_components(release: Path) -> list:
    """One file component per wheel and sdist of the release directory, with SHA-256 and size."""
    component = _libs().component
    out = []
    for path in sorted(release.iterdir()):
        if path.suffix == ".whl" or path.name.endswith(".tar.gz"):
            kind = "wheel" if path.suffix == ".whl" else "sdist"
            out.append(component.Component(
                type=component.ComponentType.FILE, bom_ref=f"artifact:{path.name}", name=path.name,
                hashes=_hashes(_sha256(path)), properties=_props(artifact=kind, size=str(path.stat().st_size))))
    return out


def image_components(manifests: list[dict], public_refs: list[str]) -> list:
    """The base images: public ones by digest, local ones with every Debian package and copied interpreter."""
    lib = _libs()
    component, PackageURL = lib.component, lib.PackageURL
    container, scope = component.ComponentType.CONTAINER, component.ComponentScope.EXCLUDED
    out = []
    for ref in public_refs:
        name, _, digest = ref.partition("@")
        out.append(component.Component(type=container, bom_ref=f"image:{ref}", name=name, scope=scope,
                                       version=digest or "unpinned",
                                       properties=_props(role="build/test base image (public, pinned by digest)")))
    for man in manifests:
        ref = f"image:{man['image']}"
        suite = man["spec"]["suite"]
        arch = man["debian_arch"]
        children = [component.Component(
            type=component.ComponentType.LIBRARY, bom_ref=f"{ref}#deb:{p['name']}:{p['arch']}", name=p["name"],
            version=p["version"],
            purl=PackageURL(type="deb", namespace="debian", name=p["name"], version=p["version"],
                            qualifiers={"arch": p["arch"], "distro": suite}),
        ) for p in man["packages"]]
        for v, py in sorted(man.get("pythons", {}).items()):
            children.append(component.Component(
                type=component.ComponentType.APPLICATION, bom_ref=f"{ref}#cpython:{v}", name="cpython",
                version=py["full_version"], hashes=_hashes(py["sha256"]),
                properties=_props(path=py["path"], source=f"copied from this build host ({py['source']})")))
        out.append(component.Component(
            type=container, bom_ref=ref, name=man["image"].split(":")[0], version=man["key"], scope=scope,
            description=f"Debian {suite} {arch} minbase bootstrapped locally with "
                        f"{man.get('bootstrap', 'debootstrap')} from {man['mirror']} ({man['created']}); {man['note']}",
            properties=_props(role=f"{man['spec']['role']} image", image_id=man.get("image_id", "")),
            components=children))
    return out


def tooling_components(wheelhouse: list[dict]) -> list:
    """The offline wheelhouse's wheels (pkg:pypi purls, SHA-256), scope excluded: used to build and test only."""
    lib = _libs()
    component, PackageURL = lib.component, lib.PackageURL
    out = []
    for w in wheelhouse:
        try:
            name, version, _, _ = lib.parse_wheel_filename(w["file"])
        except ValueError:  # InvalidWheelFilename / InvalidVersion: not a wheel, nothing to record
            continue
        out.append(component.Component(
            type=component.ComponentType.LIBRARY, bom_ref=f"tool:{w['file']}", name=name, version=str(version),
            purl=PackageURL(type="pypi", name=name, version=str(version)), scope=component.ComponentScope.EXCLUDED,
            hashes=_hashes(w["sha256"]),
            properties=_props(role="build/test tooling (offline wheelhouse)", file=w["file"])))
    return out


def make_bom(release: Path, manifests: list[dict], public_refs: list[str], wheelhouse: list[dict]):
    """The release's CycloneDX Bom object (cyclonedx-python-lib's model)."""
    lib = _libs()
    bom, component, tool, PackageURL = lib.bom, lib.component, lib.tool, lib.PackageURL
    project = _project()
    version = project["version"]
    artifacts = artifact_components(release)
    torch_req = next((d for d in project.get("dependencies", []) if d.replace(" ", "").startswith("torch")), "torch")
    torch = component.Component(
        type=component.ComponentType.LIBRARY, bom_ref="pkg:pypi/torch", name="torch",
        scope=component.ComponentScope.REQUIRED, purl=PackageURL(type="pypi", name="torch"),
        description=f"runtime requirement {torch_req} (not bundled; no libtorch linked: the wheels serve every torch "
                    "version in that range)")
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "315532800"))
    seed = json.dumps([[h.content for h in a.hashes] for a in artifacts], sort_keys=True)
    serial = uuid.uuid5(uuid.NAMESPACE_URL, f"apex-{version}-{hashlib.sha256(seed.encode()).hexdigest()}")
    apex = component.Component(
        type=component.ComponentType.LIBRARY, bom_ref=f"pkg:pypi/apex@{version}", name="apex", version=version,
        purl=PackageURL(type="pypi", name="apex", version=version), description=project.get("description", ""))
    doc = bom.Bom(
        serial_number=serial,
        metadata=bom.BomMetaData(
            timestamp=datetime.datetime.fromtimestamp(epoch, tz=datetime.timezone.utc),
            tools=tool.ToolRepository(components=[component.Component(type=component.ComponentType.APPLICATION,
                                                                      name=GENERATOR)]),
            component=apex),
        components=[*artifacts, torch, *image_components(manifests, public_refs), *tooling_components(wheelhouse)])
    doc.register_dependency(apex, [torch])
    for a in artifacts:
        if a.name.endswith(".whl"):
            doc.register_dependency(a, [torch])
    doc.register_dependency(torch, [])
    return doc


def to_json(doc) -> str:
    """CycloneDX 1.5 JSON of a Bom (the library's writer), keys sorted so the same inputs give the same bytes."""
    writer = _libs().JsonV1Dot5(doc)
    return json.dumps(json.loads(writer.output_as_string()), indent=1, sort_keys=True) + "\n"


def make_sbom(release: Path, manifests: list[dict], public_refs: list[str], wheelhouse: list[dict]) -> dict:
    """The release SBOM as a JSON document (dict)."""
    return json.loads(to_json(make_bom(release, manifests, public_refs, wheelhouse)))


def validate(sbom: dict) -> str:
    """Validate against the official CycloneDX 1.5 JSON schema (cyclonedx-python-lib's strict validator)."""
    try:
        from cyclonedx.schema import SchemaVersion
        from cyclonedx.validation.json import JsonStrictValidator
    except ImportError:
        raise SbomError("cyclonedx-python-lib is not installed: pip install "
                        "'cyclonedx-python-lib[json-validation]>=8'") from None
    try:
        error = JsonStrictValidator(SchemaVersion.V1_5).validate_str(json.dumps(sbom))
    except Exception as exc:  # MissingOptionalDependencyException: the [json-validation] extra is absent
        raise SbomError(f"cannot validate: {exc} (pip install 'cyclonedx-python-lib[json-validation]')") from None
    if error is not None:
        raise SbomError(f"SBOM does not validate against the CycloneDX 1.5 schema: {error}")
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
    try:
        text = to_json(make_bom(args.release, manifests, args.base_image, tools))
        sbom = json.loads(text)
        status = validate(sbom)
    except SbomError as exc:
        print(f"sbom: error: {exc}", file=sys.stderr)
        return 2
    args.output.write_text(text)
    print(f"{args.output}: {len(sbom['components'])} top-level components; {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
