"""An embedded SeaweedFS (`weed server -s3`): an Apache-2.0 S3-compatible object store on
loopback, for the artifacts target's tests and benchmarks, started the way the embedded
nats-server is.

The `weed` binary is built from the Go module proxy by `scripts/build-seaweedfs.sh`
(`make seaweedfs`, part of `make stack`) and cached outside the repository, keyed by
version. S3 requests must be signed: the server admits one identity, whose keys are made
here at random and written with the identities file (0600) in the state directory; they
are handed to clients through the environment (`env()`: AWS_ACCESS_KEY_ID, ...), the way
a user's S3 client gets them, never through lapse.yaml.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from lapse.embedded.kube import cache_root
from lapse.embedded.process import (
    ServerStartError,
    free_port,
    port_open,
    private_dir,
    spawn,
    stop,
    wait_until,
    write_private,
)

SEAWEEDFS_VERSION: Final = os.environ.get(
    "LAPSE_SEAWEEDFS_VERSION", "v0.0.0-20261109003541-7506e5f91cd6"
)
REGION: Final = "us-east-1"


def weed_binary(version: str = SEAWEEDFS_VERSION) -> Path:
    path = cache_root() / "seaweedfs" / version / "weed"
    if not path.exists():
        raise ServerStartError(
            f"SeaweedFS {version} is not built yet: run `make seaweedfs` once (10-30 minutes)"
        )
    return path


def identities_path(data_dir: Path) -> Path:
    return data_dir / "s3-identities.json"


def read_keys(data_dir: Path) -> tuple[str, str] | None:
    """(access key, secret key) from the identities file a start wrote, if any."""
    try:
        config = json.loads(identities_path(data_dir).read_text(encoding="utf-8"))
        credentials = config["identities"][0]["credentials"][0]
        return str(credentials["accessKey"]), str(credentials["secretKey"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _ports() -> dict[str, int]:
    # Every port explicit: SeaweedFS derives gRPC ports as HTTP port + 10000 otherwise, past
    # 65535 for most free ports.
    names = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc")
    return {name: free_port() for name in (*names, "s3", "s3.grpc")}


@dataclass
class EmbeddedSeaweedFS:
    """One `weed server` (master, volume, filer, S3 gateway) storing under `data_dir`. The
    ports and keys are chosen once and kept across `restart()`."""

    data_dir: Path
    buckets: tuple[str, ...] = ()
    ports: dict[str, int] = field(default_factory=_ports)
    access_key: str = field(default_factory=lambda: "lapse" + secrets.token_hex(8))
    secret_key: str = field(default_factory=lambda: secrets.token_hex(20), repr=False)
    process: subprocess.Popen[bytes] | None = None
    _created: bool = field(default=False, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    def env(self) -> dict[str, str]:
        """How an S3 client of this server is given its credentials and region."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": REGION,
        }

    @classmethod
    def in_state(cls, data_dir: Path, buckets: tuple[str, ...] = ()) -> EmbeddedSeaweedFS:
        """The server `lapse up` keeps in its state directory: the keys an earlier start
        wrote there are used again (its objects were written under them, and a user's
        client configured with them keeps working); the first start makes them."""
        known = read_keys(data_dir)
        if known is None:
            return cls(data_dir, buckets=buckets)
        return cls(data_dir, buckets=buckets, access_key=known[0], secret_key=known[1])

    @property
    def identities_path(self) -> Path:
        """The 0600 file that holds the keys (the server's identities)."""
        return identities_path(self.data_dir)

    def _identities(self) -> Path:
        path = self.identities_path
        config = {
            "identities": [
                {
                    "name": "lapse",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        write_private(path, json.dumps(config))
        return path

    def start(self, timeout: float = 60.0) -> EmbeddedSeaweedFS:
        # The keys, and the objects whose contents are the runs' artifacts: 0600 in 0700.
        private_dir(self.data_dir)
        private_dir(self.data_dir / "data")
        p = self.ports
        args = [
            str(weed_binary()), *self._log_flags(), "server",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-dir={self.data_dir / 'data'}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            "-master.volumeSizeLimitMB=64", "-master.telemetry=false",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            "-volume.max=0",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={self._identities()}",
        ]  # fmt: skip
        self.process = spawn(args, self.log_path)
        wait_until(
            self._ready, process=self.process, what="SeaweedFS", log_path=self.log_path,
            timeout=timeout,
        )  # fmt: skip
        if not self._created:  # kept in the data directory across restarts
            for bucket in self.buckets:
                self.create_bucket(bucket)
            self._created = True
        return self

    def _log_flags(self) -> list[str]:
        # Its logger otherwise writes files into $TMPDIR, left behind after the server stops.
        return [f"-logdir={self.data_dir}"]

    def _ready(self) -> bool:
        if not (port_open(self.ports["s3"]) and port_open(self.ports["filer"])):
            return False
        try:  # the S3 gateway answers (403 unsigned) once it reached the filer
            urllib.request.urlopen(self.endpoint, timeout=2)
        except urllib.error.HTTPError as exc:
            return exc.code in (400, 403)
        except OSError:
            return False
        return True

    def create_bucket(self, name: str, timeout: float = 60.0) -> None:
        """Create a bucket with SeaweedFS' own shell (no S3 client here creates buckets)."""
        p = self.ports
        master = f"127.0.0.1:{p['master']}.{p['master.grpc']}"
        filer = f"127.0.0.1:{p['filer']}.{p['filer.grpc']}"
        command = [
            str(weed_binary()),
            *self._log_flags(),
            "shell",
            f"-master={master}",
            f"-filer={filer}",
        ]
        result = subprocess.run(
            command,
            input=f"s3.bucket.create -name {name}\nexit\n",
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        said = (result.stdout + result.stderr).lower()
        if (
            f"bucket {name} already exists" in said
        ):  # made by an earlier start on the same data directory
            return
        if result.returncode != 0 or "error" in said:
            raise ServerStartError(
                f"SeaweedFS: creating bucket {name} failed: {result.stdout[-2000:]}"
                f"{result.stderr[-2000:]}"
            )

    def stop(self) -> None:
        stop(self.process)
        self.process = None

    def restart(self, timeout: float = 60.0) -> None:
        self.stop()
        self.start(timeout)
