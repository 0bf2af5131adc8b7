"""An embedded SeaweedFS (`weed server -s3`): an Apache-2.0 S3-compatible object store on
loopback, for the artifacts target's tests and benchmarks, started the way the embedded
nats-server is.

The `weed` binary is built from the Go module proxy by `scripts/build-seaweedfs.sh`
(`make seaweedfs`, part of `make stack`) and cached outside the repository, keyed by
version. S3 requests must be signed: the server admits one identity, whose keys are made
here at random and written with the identities file (0600) in the state directory; they
are handed to clients through the environment (`env()`: AWS_ACCESS_KEY_ID, ...), the way
a user's S3 client gets them, never through lapse.yaml.

Its other ports listen on loopback too, where every local user reaches them, so none
answers without a credential: the volume server and filer HTTP APIs want JWTs signed with
keys made per start (in the servers' environment only), the master's HTTP API admits no
address, and the gRPC ports want a client certificate (mutual TLS, its key 0600 in the
data directory).
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
    PRIVATE_UMASK,
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


# What a request to the master, volume server or filer over HTTP must carry: a JWT signed
# with one of these keys (volume reads and writes, filer reads and writes). The S3
# gateway, the filer and the master in the same `weed server` sign their own requests; a
# client of the HTTP ports without the key (any local user: they listen on loopback) is
# refused (401). Names as `weed scaffold -config=security` documents them, as variables.
JWT_KEYS: Final = (
    "WEED_JWT_SIGNING_KEY",
    "WEED_JWT_SIGNING_READ_KEY",
    "WEED_JWT_FILER_SIGNING_KEY",
    "WEED_JWT_FILER_SIGNING_READ_KEY",
)
# No unauthenticated UI on the volume server, no directory listing by the filer.
LOCKED_DOWN: Final = {
    "WEED_ACCESS_UI": "false",
    "WEED_FILER_EXPOSE_DIRECTORY_METADATA_ENABLED": "false",
}


# The gRPC ports (each part's, and what `weed shell` and the parts dial) speak mutual TLS:
# one certificate, its own CA, made on the first start in the data directory (0600),
# presented and required by every part (security.toml's [grpc.*]).
GRPC_PARTS: Final = ("MASTER", "VOLUME", "FILER", "S3", "CLIENT")
# An allow-list entry no client's address ever equals: the master's HTTP API admits none.
NOBODY: Final = "none"


def _jwt_keys() -> dict[str, str]:
    return {name: secrets.token_hex(32) for name in JWT_KEYS}


@dataclass
class EmbeddedSeaweedFS:
    """A `weed master` and a `weed server` (volume server, filer, S3 gateway) storing under
    `data_dir`. The ports and keys are chosen once and kept across `restart()`."""

    data_dir: Path
    buckets: tuple[str, ...] = ()
    ports: dict[str, int] = field(default_factory=_ports)
    access_key: str = field(default_factory=lambda: "lapse" + secrets.token_hex(8))
    secret_key: str = field(default_factory=lambda: secrets.token_hex(20), repr=False)
    # Signing keys of the JWTs its parts hand each other (security.toml's jwt.*): made at
    # random per server, never written to a file, passed in its environment.
    jwt_keys: dict[str, str] = field(default_factory=_jwt_keys, repr=False)
    process: subprocess.Popen[bytes] | None = None
    master: subprocess.Popen[bytes] | None = None
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
        # The master in a process of its own: its HTTP API hands a volume write token to
        # whoever asks (/dir/assign) and deletes a bucket's volumes (/col/delete), guarded
        # by an IP allow-list only, which on loopback admits every local user. Its list
        # names no address, so it admits nobody; the other parts reach it over gRPC. (In
        # one `weed server` the volume server would share that list and refuse the S3
        # gateway's writes.)
        master = [
            str(weed_binary()), *self._log_flags(), "master",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-port={p['master']}", f"-port.grpc={p['master.grpc']}",
            f"-mdir={self.data_dir / 'data'}",
            "-volumeSizeLimitMB=64", "-telemetry=false", f"-whiteList={NOBODY}",
        ]  # fmt: skip
        self.master = spawn(master, self.data_dir / "weed-master.log", env=self._security_env())
        args = [
            str(weed_binary()), *self._log_flags(), "server",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-dir={self.data_dir / 'data'}",
            "-master=false", f"-master.peers=127.0.0.1:{p['master']}.{p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            "-volume.max=0",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={self._identities()}",
        ]  # fmt: skip
        self.process = spawn(args, self.log_path, env=self._security_env())
        wait_until(
            self._ready, process=self.process, what="SeaweedFS", log_path=self.log_path,
            timeout=timeout,
        )  # fmt: skip
        if not self._created:  # kept in the data directory across restarts
            for bucket in self.buckets:
                self.create_bucket(bucket)
            self._created = True
        return self

    def _security_env(self) -> dict[str, str]:
        return {**self.jwt_keys, **LOCKED_DOWN, **self._grpc_tls()}

    def _grpc_tls(self) -> dict[str, str]:
        """The [grpc.*] settings, as variables, making the certificate if there is none."""
        cert, key = self.data_dir / "grpc.crt", self.data_dir / "grpc.key"
        if not (cert.exists() and key.exists()):
            subprocess.run(
                [
                    "openssl", "req", "-x509", "-newkey", "ec",
                    "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "3650",
                    "-subj", "/CN=lapse-seaweedfs",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-addext", "extendedKeyUsage=serverAuth,clientAuth",
                ],
                check=True, capture_output=True, umask=PRIVATE_UMASK,
            )  # fmt: skip
        env = {"WEED_GRPC_CA": str(cert)}
        for part in GRPC_PARTS:
            env |= {f"WEED_GRPC_{part}_CERT": str(cert), f"WEED_GRPC_{part}_KEY": str(key)}
        return env

    def _log_flags(self) -> list[str]:
        # Its logger otherwise writes files into $TMPDIR, left behind after the server stops.
        return [f"-logdir={self.data_dir}"]

    def _ready(self) -> bool:
        if self.master is not None and self.master.poll() is not None:
            raise ServerStartError(f"SeaweedFS' master exited with code {self.master.returncode}")
        if not all(port_open(self.ports[name]) for name in ("master", "s3", "filer")):
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
            env={**os.environ, **self._security_env()},
            umask=PRIVATE_UMASK,
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
        stop(self.master)
        self.process = self.master = None

    def restart(self, timeout: float = 60.0) -> None:
        self.stop()
        self.start(timeout)
