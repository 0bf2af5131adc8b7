"""Two `lapse up` started at the same moment on one host each get an embedded nats-server
of their own: both may find the default port (4222) free and try it; the one that loses
the bind must not take the winner's server for its own (its passwords would be refused
there, or worse, its commands would talk to the other deployment). Real nats-servers,
started by `lapse up`'s own function from two threads at once."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from lapse.cli.up_run import DEFAULT_NATS_PORT, start_embedded_nats
from lapse.config import NatsConfig
from lapse.edges.nats import connect
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.nats_identities import READER, password_file
from lapse.embedded.process import port_open

pytestmark = [pytest.mark.nats]


def test_two_lapse_up_starting_at_once_each_get_their_own_nats(tmp_path: Path) -> None:
    if port_open(DEFAULT_NATS_PORT):
        pytest.skip(f"port {DEFAULT_NATS_PORT} is taken here: no race to lose")
    homes = [tmp_path / "a", tmp_path / "b"]
    together = threading.Barrier(len(homes))
    started: dict[Path, EmbeddedNats | Exception] = {}
    done = threading.Event()

    def start(home: Path) -> None:
        home.mkdir(mode=0o700)
        together.wait()
        try:
            started[home] = start_embedded_nats(home)
        except Exception as exc:
            started[home] = exc
        # A server dies with the thread that started it (lapse up's main thread): kept.
        done.wait(60)

    threads = [threading.Thread(target=start, args=(home,), daemon=True) for home in homes]
    for thread in threads:
        thread.start()
    while len(started) < len(homes) and any(t.is_alive() for t in threads):
        time.sleep(0.05)
    servers = [started.get(home) for home in homes]
    try:
        assert all(isinstance(s, EmbeddedNats) for s in servers), servers
        ports = {s.port for s in servers if isinstance(s, EmbeddedNats)}
        assert len(ports) == 2 and DEFAULT_NATS_PORT in ports, servers

        async def own_credentials_accepted() -> None:
            for home, server in zip(homes, servers, strict=True):
                assert isinstance(server, EmbeddedNats)
                config = NatsConfig(
                    url=server.url, user=READER.user, password_file=password_file(home, READER)
                )
                nc = await asyncio.wait_for(connect(server.url, config=config), 10)
                await nc.close()
                assert (home / "nats.url").read_text().strip() == server.url

        asyncio.run(own_credentials_accepted())
    finally:
        for server in servers:
            if isinstance(server, EmbeddedNats):
                server.stop()
        done.set()
