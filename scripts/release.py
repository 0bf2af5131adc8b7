"""Build a release of lapse into one directory (`make release`; docs/releasing.md).

For VERSION (pyproject.toml's version: the images carry it, so it must be that one), under
OUT (dist/release/<version>/):

- `lapse-<version>-py3-none-any.whl`, `lapse-<version>.tar.gz`: `uv build` (the wheel is
  built from the sdist, so the sdist is known to build); `requirements.txt` and
  `requirements-embedded.txt`: the wheel's dependencies and what its `embedded` extra
  adds, requirements.lock's lines with their hashes (`pip install --require-hashes -r`,
  then the wheel with `--no-deps`: docs/install.md);
- `images/<name>.oci.tar`: each image `make images` built (scripts/build-images.py: cached
  by its inputs, built first if this tree's build is not cached) as an OCI archive, an OCI
  image layout holding that image alone, tagged <version>; `images/<name>.digest`: its
  manifest's digest, which a registry keeps (`skopeo copy --preserve-digests
  oci-archive:<name>.oci.tar docker://REGISTRY/lapse/<name>:<version>`);
- `sbom/lapse-<version>.cdx.json` (the wheel's dependencies) and `sbom/<name>.cdx.json`
  (each image's Python packages): CycloneDX, `cyclonedx-py requirements` over the lines of
  requirements.lock the image installs (images/locked_requirements.py, the same code and
  lock the Containerfile installs them with, hash-checked and --no-deps: the list is
  exactly what pip put there, with the hashes it checked);
- `lapse-<version>.tgz`: the Helm chart (`helm package`), its values.yaml pinning every image
  by digest (`images.<name>.digest`, tag <version>) and `values-images.yaml`, the same
  pins as a values file for `helm upgrade -f` of a chart from elsewhere; pushable as an OCI
  artifact (`helm push lapse-<version>.tgz oci://REGISTRY/charts`; `--push` does it);
- `release.json`: what is where, the images' digests and base, the chart's digest;
- `RELEASE-NOTES.md`: CHANGELOG.md's section for the version;
- `SHA256SUMS`: over every file above (`sha256sum -c SHA256SUMS` in OUT).

Nothing is tagged or pushed. `--push REGISTRY` builds nothing: it pushes the release
already in OUT (its SHA256SUMS verified first) to REGISTRY.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "images"))
from locked_requirements import Locked, requirements  # noqa: E402

CHART = ROOT / "charts" / "lapse"
LOCK = ROOT / "requirements.lock"
PYPROJECT = ROOT / "pyproject.toml"
# The chart's key under `images:` for each image (the example extension is not in it).
CHART_IMAGES = {
    "lapse": "lapse",
    "ttl-planner": "ttlPlanner",
    "object-reaper": "objectReaper",
    "row-reaper": "rowReaper",
    "artifact-reaper": "artifactReaper",
}
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
T = TypeVar("T")


@dataclass(frozen=True)
class Tools:
    """The programs a release runs (the venv's, and helm from scripts/build-helm.sh)."""

    python: Path
    helm: Path

    @property
    def bin(self) -> Path:
        return self.python.parent


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    out = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, check=False, cwd=cwd
    )
    if out.returncode != 0:
        detail = (out.stdout + out.stderr)[-4000:]
        raise SystemExit(f"release: {' '.join(map(str, cmd))} failed:\n{detail}")
    return out.stdout


def project_version() -> str:
    version: str = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    return version


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# --- release notes -------------------------------------------------------------------------


def changelog_section(changelog: str, version: str) -> str:
    """The text of `## <version> — ...` up to the next `## ` heading, heading included."""
    lines = changelog.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(rf"## {re.escape(version)}\b", line)]
    if not starts:
        raise SystemExit(f"release: CHANGELOG.md has no section `## {version} — ...`")
    start = starts[0]
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), None)
    return "\n".join(lines[start:end]).strip() + "\n"


# --- the Python package --------------------------------------------------------------------


def build_package(tools: Tools, out: Path) -> tuple[Path, Path]:
    """The sdist, and the wheel built from it."""
    with tempfile.TemporaryDirectory(prefix="lapse-release-") as tmp:
        run(tools.bin / "uv", "build", "--quiet", "--out-dir", tmp, ROOT)
        built = sorted(Path(tmp).iterdir())
        (sdist,) = [p for p in built if p.name.endswith(".tar.gz")]
        (wheel,) = [p for p in built if p.name.endswith(".whl")]
        shutil.move(sdist, out / sdist.name)
        shutil.move(wheel, out / wheel.name)
    return out / sdist.name, out / wheel.name


# --- images --------------------------------------------------------------------------------


def built_images(tools: Tools) -> dict[str, Any]:
    """images.json of this tree's build (scripts/build-images.py builds it if not cached)."""
    summary: dict[str, Any] = json.loads(run(tools.python, ROOT / "scripts/build-images.py"))
    return summary


def blob_path(layout: Path, digest: str) -> Path:
    algorithm, hexdigest = digest.split(":", 1)
    return layout / "blobs" / algorithm / hexdigest


def image_blobs(layout: Path, manifest_digest: str) -> list[str]:
    """The digests of an image's manifest, its config and its layers."""
    manifest = json.loads(blob_path(layout, manifest_digest).read_bytes())
    return [
        manifest_digest,
        manifest["config"]["digest"],
        *(layer["digest"] for layer in manifest["layers"]),
    ]


def write_oci_archive(layout: Path, digest: str, tag: str, archive: Path) -> None:
    """An OCI archive (oci-archive:, a tar of an OCI image layout) of one image of `layout`.

    Its blobs are copied byte for byte, so the manifest keeps its digest; each is checked
    against its name on the way.
    """
    manifest = blob_path(layout, digest).read_bytes()
    descriptor = {
        "mediaType": json.loads(manifest)["mediaType"],
        "digest": digest,
        "size": len(manifest),
        "annotations": {"org.opencontainers.image.ref.name": tag},
    }
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [descriptor]}

    def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(archive, "w") as tar:
        add_bytes(tar, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add_bytes(tar, "index.json", json.dumps(index).encode())
        for blob in image_blobs(layout, digest):
            path = blob_path(layout, blob)
            if f"sha256:{sha256_file(path)}" != blob:
                raise SystemExit(f"release: {path} does not match its digest")
            info = tarfile.TarInfo(f"blobs/{blob.replace(':', '/')}")
            info.size, info.mode = path.stat().st_size, 0o644
            with path.open("rb") as handle:
                tar.addfile(info, handle)


def export_images(summary: dict[str, Any], out: Path) -> dict[str, dict[str, str]]:
    """Each image as images/<name>.oci.tar and images/<name>.digest."""
    (out / "images").mkdir()
    exported: dict[str, dict[str, str]] = {}
    for name, image in sorted(summary["images"].items()):
        layout = Path(image["oci"].rsplit(":", 1)[0])
        archive = out / "images" / f"{name}.oci.tar"
        write_oci_archive(layout, image["digest"], summary["version"], archive)
        (out / "images" / f"{name}.digest").write_text(image["digest"] + "\n")
        exported[name] = {
            "archive": archive.relative_to(out).as_posix(),
            "digest": image["digest"],
            "built_as": image["reference"],
            "compressed_bytes": image["compressed_bytes"],
        }
    return exported


# --- SBOMs ---------------------------------------------------------------------------------


def image_requirements(image: dict[str, Any]) -> tuple[list[Locked], Path]:
    """What the Containerfile installed into an image, and the project it installed it for."""
    if image.get("extension"):
        project = ROOT / image["folder"] / "pyproject.toml"
        return requirements(LOCK, project), project
    if image["containerfile_target"] == "lapse":
        return requirements(LOCK, PYPROJECT, ("embedded",)), PYPROJECT
    # One of lapse's functions: its own share of the lock (func.yaml's lapse-ttl-planner).
    function = image["function"].removeprefix("lapse-")
    return requirements(LOCK, PYPROJECT, function=function), PYPROJECT


def write_sbom(tools: Tools, packages: list[Locked], project: Path, sbom: Path) -> None:
    """A CycloneDX JSON SBOM of `packages`, its root component `project` (validated after,
    all at once: `validate_sboms`)."""
    with tempfile.TemporaryDirectory(prefix="lapse-sbom-") as tmp:
        listed = Path(tmp) / "requirements.txt"
        listed.write_text("\n".join(package.requirement for package in packages) + "\n")
        run(
            tools.bin / "cyclonedx-py", "requirements", "--no-validate", "--pyproject", project,
            "--output-reproducible", "--of", "JSON", "-o", sbom, listed,
        )  # fmt: skip


def validate_sboms(paths: list[Path]) -> None:
    """Each SBOM against CycloneDX 1.6's strict JSON schema, in one process.

    Formats are checked too, but for the IRIs (the components' index URLs, written by
    cyclonedx-py itself): their checker (rfc3987-syntax) takes ~0.15 s per URL, ~4 s an
    SBOM, which is most of a release's time.
    """
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator
    from jsonschema import Draft7Validator, FormatChecker  # type: ignore[import-untyped]

    checker = FormatChecker(
        [name for name in Draft7Validator.FORMAT_CHECKER.checkers if not name.startswith("iri")]
    )
    validator = JsonStrictValidator(SchemaVersion.V1_6)._validator.evolve(format_checker=checker)
    for path in paths:
        error = next(validator.iter_errors(json.loads(path.read_text())), None)
        if error is not None:
            raise SystemExit(f"release: {path.name} is not CycloneDX 1.6: {error.message}")


def write_requirements(out: Path) -> None:
    """The wheel's dependencies (and its `embedded` extra's), hash-pinned by the lock."""
    for name, packages in (
        ("requirements.txt", requirements(LOCK, PYPROJECT)),
        (
            "requirements-embedded.txt",
            requirements(LOCK, PYPROJECT, ("embedded",), without_dependencies=True),
        ),
    ):
        lines = [package.requirement for package in packages]
        (out / name).write_text("\n".join(lines) + "\n")


def write_sboms(tools: Tools, summary: dict[str, Any], wheel: Path, out: Path) -> dict[str, str]:
    """One SBOM for the wheel and one per image. Images installing the same lines for the
    same project (lapse's functions: the wheel's dependencies) get a copy of the same
    document (reproducible: no serial number, no timestamp), generated and validated once."""
    (out / "sbom").mkdir()
    wanted = {wheel.name: (requirements(LOCK, PYPROJECT), PYPROJECT)}
    wanted |= {name: image_requirements(image) for name, image in summary["images"].items()}
    sboms: dict[str, Path] = {}
    made: dict[tuple[tuple[str, ...], Path], Path] = {}
    for name, (packages, project) in sorted(wanted.items()):
        stem = f"lapse-{summary['version']}" if name == wheel.name else name
        sboms[name] = out / "sbom" / f"{stem}.cdx.json"
        key = (tuple(package.requirement for package in packages), project)
        if key in made:
            shutil.copyfile(made[key], sboms[name])
        else:
            write_sbom(tools, packages, project, sboms[name])
            made[key] = sboms[name]
    validate_sboms(list(made.values()))
    return {name: path.relative_to(out).as_posix() for name, path in sboms.items()}


# --- the chart -----------------------------------------------------------------------------


def pin_values(values: str, digests: dict[str, str], version: str) -> str:
    """values.yaml with each image's `tag: ""`/`digest: ""` set to the version and digest."""
    for name, key in CHART_IMAGES.items():
        pattern = re.compile(
            rf"^(  {key}: \{{repository: [^,]+), tag: \"\", digest: \"\"\}}$", re.M
        )
        values, found = pattern.subn(rf'\1, tag: "{version}", digest: "{digests[name]}"}}', values)
        if found != 1:
            raise SystemExit(f"release: charts/lapse/values.yaml: no unpinned images.{key}")
    return values


def images_values(digests: dict[str, str], version: str) -> str:
    lines = [
        "# lapse's images for this release, by digest (helm install|upgrade -f this file).",
        "images:",
    ]
    for name, key in CHART_IMAGES.items():
        lines.append(
            f'  {key}: {{repository: lapse/{name}, tag: "{version}", digest: "{digests[name]}"}}'
        )
    return "\n".join(lines) + "\n"


def package_chart(tools: Tools, digests: dict[str, str], version: str, out: Path) -> Path:
    """The chart with its images pinned, packaged; values-images.yaml beside it."""
    if chart_version() != version:
        raise SystemExit(f"release: charts/lapse/Chart.yaml has version {chart_version()}")
    with tempfile.TemporaryDirectory(prefix="lapse-chart-") as tmp:
        chart = Path(tmp) / "lapse"
        shutil.copytree(CHART, chart)
        values = chart / "values.yaml"
        values.write_text(pin_values(values.read_text(), digests, version))
        run(tools.helm, "lint", "--strict", "--quiet", chart)
        run(tools.helm, "package", "--destination", out, chart)
    (out / "values-images.yaml").write_text(images_values(digests, version))
    return out / f"lapse-{version}.tgz"


def chart_version() -> str:
    """Chart.yaml's `version:` (a plain scalar; no YAML parser needed for it)."""
    match = re.search(r"^version:\s*\"?([^\"\s]+)", (CHART / "Chart.yaml").read_text(), re.M)
    assert match is not None
    return match.group(1)


# --- pushing (only when asked) -------------------------------------------------------------


def push(tools: Tools, out: Path, release: dict[str, Any], registry: str, insecure: bool) -> None:
    """The images to REGISTRY/lapse/<name>:<version> keeping their digests, the chart to
    oci://REGISTRY/charts."""
    version = release["version"]
    for name, image in release["images"].items():
        run(
            "skopeo", "copy", "--quiet", "--preserve-digests",
            *(["--dest-tls-verify=false"] if insecure else []),
            f"oci-archive:{out / image['archive']}",
            f"docker://{registry}/lapse/{name}:{version}",
        )  # fmt: skip
    run(
        tools.helm, "push", out / release["chart"]["package"], f"oci://{registry}/charts",
        *(["--plain-http"] if insecure else []),
    )  # fmt: skip


# --- the release ---------------------------------------------------------------------------


def write_checksums(out: Path) -> None:
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    lines = [f"{sha256_file(p)}  {p.relative_to(out).as_posix()}" for p in files]
    (out / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def timed(step: str, work: Callable[[], T]) -> T:
    """`work()`, its time on stderr (where a release's minutes go)."""
    started = time.monotonic()
    result = work()
    print(f"release: {step}: {time.monotonic() - started:.1f} s", file=sys.stderr)
    return result


def release(tools: Tools, version: str, out: Path) -> dict[str, Any]:
    if version != project_version():
        raise SystemExit(
            f"release: VERSION={version}, but pyproject.toml says {project_version()} "
            "(the images and the wheel carry pyproject.toml's version: set it there)"
        )
    notes = changelog_section((ROOT / "CHANGELOG.md").read_text(), version)
    if out.exists() and any(out.iterdir()):
        if not (out / "release.json").exists():
            raise SystemExit(f"release: {out} is not empty and holds no release: not replacing it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    commit, dirty = source_state()
    if dirty:
        print(f"release: the tree has changes not committed on {commit}", file=sys.stderr)
    sdist, wheel = timed("wheel and sdist", lambda: build_package(tools, out))
    write_requirements(out)
    summary = timed("images (cached)", lambda: built_images(tools))
    images = timed("OCI archives", lambda: export_images(summary, out))
    digests = {name: image["digest"] for name, image in images.items()}
    sboms = timed("SBOMs", lambda: write_sboms(tools, summary, wheel, out))
    chart = timed("chart", lambda: package_chart(tools, digests, version, out))
    (out / "RELEASE-NOTES.md").write_text(notes)
    manifest: dict[str, Any] = {
        "version": version,
        "commit": commit,
        "uncommitted_changes": dirty,
        "wheel": wheel.name,
        "sdist": sdist.name,
        "requirements": ["requirements.txt", "requirements-embedded.txt"],
        "base": summary["base"],
        "images": images,
        "sboms": sboms,
        "chart": {
            "package": chart.name,
            "values": "values-images.yaml",
            "oci": f"oci://<registry>/charts/lapse:{version}",
        },
        "release_notes": "RELEASE-NOTES.md",
    }
    (out / "release.json").write_text(json.dumps(manifest, indent=2) + "\n")
    timed("SHA256SUMS", lambda: write_checksums(out))
    return manifest


def source_state() -> tuple[str, bool]:
    """The commit the tree is at, and whether it has changes not committed."""
    commit = run("git", "-C", ROOT, "rev-parse", "HEAD").strip()
    return commit, bool(run("git", "-C", ROOT, "status", "--porcelain").strip())


def verified_release(out: Path) -> dict[str, Any]:
    """release.json of the release in `out`, once every file matches SHA256SUMS."""
    if not (out / "SHA256SUMS").exists():
        raise SystemExit(f"release: no release in {out} (make release first)")
    for line in (out / "SHA256SUMS").read_text().splitlines():
        expected, name = line.split("  ", 1)
        if sha256_file(out / name) != expected:
            raise SystemExit(f"release: {out / name} does not match SHA256SUMS")
    data: dict[str, Any] = json.loads((out / "release.json").read_text())
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=project_version())
    parser.add_argument("--out", type=Path, help="default: dist/release/<version>")
    parser.add_argument("--helm", type=Path, required=True, help="helm (make helm)")
    parser.add_argument(
        "--push",
        metavar="REGISTRY",
        help="push the release in OUT (built before) there: images and chart; builds nothing",
    )
    parser.add_argument("--insecure", action="store_true", help="the registry speaks plain HTTP")
    args = parser.parse_args()
    tools = Tools(python=Path(sys.executable), helm=args.helm)
    out = args.out or ROOT / "dist" / "release" / args.version
    if args.push:
        push(tools, out, verified_release(out), args.push, args.insecure)
    else:
        release(tools, args.version, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
