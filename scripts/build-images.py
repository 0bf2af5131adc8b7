"""Build every image lapse deploys from the repository's Containerfile (`make images`).

The Containerfile is the one definition: platform engineers build it with docker, podman
or buildah (images/README.md); this script builds it the same way with buildah, without a
daemon, for the tests, the cluster and releases:

- the base: the Containerfile's default base is `python:3.11-slim-bookworm` from a
  registry, which this machine cannot reach. So an equivalent base is built here with
  `mmdebstrap` (Debian bookworm minbase, python3, python-is-python3, python3-pip,
  ca-certificates, tzdata; no docs or locales), imported into buildah's storage as
  `localhost/lapse/base:bookworm-<hash of its recipe>` and passed as `--build-arg BASE`.
  Cached by recipe. The images are built FROM it by digest (`BASE=<name>@sha256:...`):
  mmdebstrap's base is rebuilt from the Debian mirror of the day, so its name alone does
  not say which base an image has; the digest does, and it is part of the inputs' hash.
- the images: `buildah build --target lapse` and `--target function --build-arg
  FUNCTION=<folder>` for each functions/*/func.yaml and examples/*/func.yaml (an example
  is an extension: its own pyproject.toml, nothing of lapse vendored), tagged
  `dev.local/lapse/<name>:<version>` (dev.local: Knative never resolves its tags), the
  version from pyproject.toml. pip inside the build reaches the package index with this
  machine's CA bundle (mounted, passed as PIP_CERT: never part of an image).
- the outputs, in ~/.cache/lapse/images/<version>-<hash of the inputs>/: an OCI layout
  (oci/, one tag per image; `skopeo copy --preserve-digests oci:<dir>/oci:<name>
  docker://...` puts an image in a registry under the digest recorded here),
  docker-archive files (archives/<name>.tar: `ctr images import`, `docker load`) and
  images.json: per image its reference, digest, archive and sizes.

A second run with the same inputs does nothing but print images.json. `--kustomize
REGISTRY` prints a kustomize `images:` list naming REGISTRY/<name>:<version>@<digest>.
Needs root (mmdebstrap's root mode, buildah's overlay storage); Debian packages
mmdebstrap, buildah, skopeo.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONTAINERFILE = ROOT / "Containerfile"
# Bump when the way images are built changes: caches from an older recipe are rebuilt.
RECIPE = "2"
SUITE = "bookworm"  # Python 3.11, the version lapse is tested on
MIRROR = os.environ.get("LAPSE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = ("python3", "python-is-python3", "python3-pip", "ca-certificates", "tzdata")
# What the Containerfile COPYs (.dockerignore keeps the rest out of the build context).
SOURCES = ("events", "functions", "lapse", "infra", "examples", "images/func")
SKIP = {"__pycache__", "vendor", "lib", ".func", ".pytest_cache"}
REGISTRY = "dev.local/lapse"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")


def cache_root() -> Path:
    base = os.environ.get("LAPSE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lapse"
    )
    return Path(base) / "images"


def run(*cmd: str | Path, check: bool = True) -> str:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False)
    if check and out.returncode != 0:
        detail = (out.stdout + out.stderr)[-6000:]
        sys.exit(f"build-images: {' '.join(map(str, cmd))} failed:\n{detail}")
    return out.stdout


def buildah(*args: str | Path, check: bool = True) -> str:
    """buildah on a storage of its own under the cache (never the machine's default one)."""
    store = cache_root() / "buildah"
    return run(
        "buildah", "--root", store / "storage", "--runroot", store / "run",
        "--storage-driver", "overlay", *args, check=check,
    )  # fmt: skip


def project_version() -> str:
    version: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return version


def inputs_hash(base: str) -> str:
    """Everything an image is made of: the sources, the lock, the Containerfile, the base."""
    digest = hashlib.sha256(f"{RECIPE} {base}".encode())
    files = [ROOT / name for name in ("pyproject.toml", "requirements.lock", "README.md")]
    files += [CONTAINERFILE, ROOT / ".dockerignore", Path(__file__).resolve()]
    files += [ROOT / "scripts/package-functions.py", ROOT / "images/locked_requirements.py"]
    for top in SOURCES:
        files += sorted(
            p
            for p in (ROOT / top).rglob("*")
            if p.is_file() and not SKIP & set(p.relative_to(ROOT).parts) and p.suffix != ".pyc"
        )
    for path in files:
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


@contextmanager
def locked() -> Iterator[None]:
    """One build at a time (the tests, `make images` and the cluster scripts share a cache)."""
    cache_root().mkdir(parents=True, exist_ok=True)
    with (cache_root() / ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


# --- the base ------------------------------------------------------------------------------


def base_name() -> str:
    """The base's name in buildah's storage: it changes with its recipe."""
    key = hashlib.sha256(f"{RECIPE} {SUITE} {' '.join(BASE_PACKAGES)}".encode()).hexdigest()[:12]
    return f"localhost/lapse/base:{SUITE}-{key}"


def ensure_base(name: str) -> None:
    """Debian + Python + pip in buildah's storage, the stand-in for python:3.11-slim-bookworm."""
    if name in buildah("images", "--format", "{{.Name}}:{{.Tag}}").split():
        return
    print(f"build-images: base: mmdebstrap {SUITE} ({', '.join(BASE_PACKAGES)})", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="lapse-base-", dir=cache_root()) as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        run(
            "mmdebstrap", "--variant=minbase", "--mode=root", "--format=tar",
            f"--include={','.join(BASE_PACKAGES)}",
            # Documentation, manuals and translations are never read in a container.
            "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-include=/usr/share/doc/*/copyright",
            "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
            "--dpkgopt=path-exclude=/usr/share/info/*",
            # apt's package lists are not needed at run time either.
            "--customize-hook=rm -rf $1/var/lib/apt/lists/* $1/var/cache/apt/*",
            SUITE, rootfs, MIRROR,
        )  # fmt: skip
        container = buildah("from", "scratch").strip()
        try:
            mount = buildah("mount", container).strip()
            run("tar", "--numeric-owner", "-xpf", rootfs, "-C", mount)
            # What the python image's configuration says (PATH, LANG, `python` by default).
            buildah(
                "config", "--env", "PATH=/usr/local/bin:/usr/bin:/bin", "--env", "LANG=C.UTF-8",
                "--cmd", "python", container,
            )  # fmt: skip
            buildah("commit", "--quiet", "--timestamp", "0", container, name)
        finally:
            buildah("rm", container)


def pinned_base(name: str) -> str:
    """The base as the builds name it: `name@sha256:<its manifest digest>`."""
    (digest,) = buildah("images", "--digests", "--format", "{{.Digest}}", name).split()
    return f"{name}@{digest}"


# --- images --------------------------------------------------------------------------------


def targets() -> dict[str, dict[str, Any]]:
    """name -> how to build it: the Containerfile's target and build arguments."""
    found: dict[str, dict[str, Any]] = {}
    for top in ("functions", "examples"):
        for func_yaml in sorted((ROOT / top).glob("*/func.yaml")):
            spec = yaml.safe_load(func_yaml.read_text())
            folder = func_yaml.parent.relative_to(ROOT).as_posix()
            about: dict[str, Any] = {"function": spec["name"], "folder": folder}
            if top == "examples":
                about["extension"] = True
            found[spec["name"].removeprefix("lapse-")] = {
                "target": "function", "args": {"FUNCTION": folder}, "about": about,
            }  # fmt: skip
    found["lapse"] = {
        "target": "lapse", "args": {}, "about": {"entrypoint": "python -m lapse.cli"},
    }  # fmt: skip
    return found


def build_one(name: str, how: dict[str, Any], base: str, version: str) -> str:
    reference = f"{REGISTRY}/{name}:{version}"
    args = {"BASE": base, "VERSION": version, **how["args"]}
    extra: list[str] = []
    if HOST_CA.exists():  # a TLS-inspecting proxy's CA is in this machine's bundle
        extra += ["--volume", f"{HOST_CA}:/run/lapse-build/ca.crt:ro"]
        args["PIP_CERT"] = "/run/lapse-build/ca.crt"
    for key, value in args.items():
        extra += ["--build-arg", f"{key}={value}"]
    buildah(
        "build", "--quiet", "--isolation", "chroot", "--pull=never", "--layers",
        # Created at 0: the same inputs give the same image configuration.
        "--timestamp", "0", "--file", CONTAINERFILE, "--target", how["target"],
        "--tag", reference, *extra, ROOT,
    )  # fmt: skip
    return reference


def sizes(layout: Path, digest: str) -> tuple[int, int]:
    """(compressed layers, uncompressed) bytes of one image in an OCI layout."""

    def blob(digest: str) -> Path:
        algorithm, hexdigest = digest.split(":")
        return layout / "blobs" / algorithm / hexdigest

    manifest = json.loads(blob(digest).read_text())
    compressed = sum(item["size"] for item in manifest["layers"])
    uncompressed = 0
    for item in manifest["layers"]:
        with tarfile.open(blob(item["digest"]), "r:*") as tar:
            uncompressed += sum(member.size for member in tar)
    return compressed, uncompressed


def build(out: Path, version: str, base: str) -> dict[str, Any]:
    started = time.monotonic()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "archives").mkdir(parents=True)
    images: dict[str, dict[str, Any]] = {}
    try:
        for name, how in targets().items():
            step = time.monotonic()
            reference = build_one(name, how, base, version)
            digest_file = partial / f"{name}.digest"
            buildah(
                "push", "--quiet", "--format", "oci", "--digestfile", digest_file,
                reference, f"oci:{partial / 'oci'}:{name}",
            )  # fmt: skip
            archive = partial / "archives" / f"{name}.tar"
            buildah("push", "--quiet", reference, f"docker-archive:{archive}:{reference}")
            digest = digest_file.read_text().strip()
            digest_file.unlink()
            compressed, uncompressed = sizes(partial / "oci", digest)
            images[name] = {
                **how["about"],
                "containerfile_target": how["target"],
                "build_args": how["args"],
                "reference": reference,
                "digest": digest,
                "archive": (out / "archives" / f"{name}.tar").as_posix(),
                "oci": f"{out / 'oci'}:{name}",
                "compressed_bytes": compressed,
                "uncompressed_bytes": uncompressed,
                "build_seconds": round(time.monotonic() - step, 1),
            }
    finally:
        # The layout and archives hold the images; buildah's storage keeps only the base
        # (its intermediate layers, ~1 GB per build, would pile up across source changes).
        (base_id,) = buildah("images", "--format", "{{.ID}}", base.split("@")[0]).split()
        stale = set(buildah("images", "--all", "--format", "{{.ID}}").split()) - {base_id}
        if stale:
            buildah("rmi", "--force", *sorted(stale), check=False)
    summary = {
        "version": version,
        "base": base,
        "directory": out.as_posix(),
        "build_seconds": round(time.monotonic() - started, 1),
        "images": images,
    }
    (partial / "images.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    # Earlier builds (other inputs) are about 1 GB each: keep this one and the newest other
    # (two worktrees building in turn would otherwise rebuild each other's). (base-*: the
    # base as an earlier recipe kept it; it now lives in buildah's storage.)
    builds = sorted(
        (p for p in out.parent.glob(f"{version.split('.')[0]}.*-*") if p.is_dir() and p != out),
        key=lambda p: p.stat().st_mtime,
    )
    for stale in [*builds[:-1], *out.parent.glob("base-*")]:
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return summary


def kustomize_images(summary: dict[str, Any], registry: str) -> str:
    """The `images:` list of an overlay pulling from `registry` by tag and digest."""
    lines = ["images:"]
    for name, image in sorted(summary["images"].items()):
        lines.append(
            f"  - {{name: lapse/{name}, newName: {registry.rstrip('/')}/{name}, "
            f"newTag: {summary['version']}, digest: {image['digest']}}}"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rebuild", action="store_true", help="ignore a cached build")
    parser.add_argument(
        "--kustomize",
        metavar="REGISTRY",
        help="print a kustomize images: list for REGISTRY (e.g. registry.example.com/lapse)",
    )
    args = parser.parse_args()
    for tool in ("mmdebstrap", "buildah", "skopeo"):
        if shutil.which(tool) is None:
            print(f"build-images: `{tool}` is needed (Debian package {tool})", file=sys.stderr)
            return 2
    version = project_version()
    with locked():
        ensure_base(base_name())
        base = pinned_base(base_name())
        out = cache_root() / f"{version}-{inputs_hash(base)}"
        if args.rebuild or not (out / "images.json").exists():
            build(out, version, base)
    summary = json.loads((out / "images.json").read_text())
    if args.kustomize:
        print(kustomize_images(summary, args.kustomize), end="")
    else:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
