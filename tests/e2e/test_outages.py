"""Outages are waited out, never dead-lettered: `lapse up` (a subprocess) against a
kube-apiserver whose etcd is killed with SIGKILL while deletions come due (the API server
then neither answers nor refuses), and a `lapse up` started while its database is
unreachable. The API server, NATS, the databases and S3 refused and black-holed for 60 s
are the fault matrix's (tests/e2e/test_fault_matrix.py), which uses `Blackhole` below.
Each test reports what it measured on stdout (`pytest -s` shows it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from lapse.edges.database import create_engine
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port
from tests.conftest import KubeStack, kube_stack
from tests.e2e.apiserver_audit import (
    audited_kube_stack,
    check_one_delete_each,
    deletes,
    unanswered,
)
from tests.e2e.test_lapse_up import LapseUp, finished_workflow, lapse_json
from tests.kfp_schema import create_kfp_tables
from tests.stack import Database, scratch_database, wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats, pytest.mark.db]

ETCD_OUTAGE_SECONDS = 45.0


@pytest.fixture
def own_kube(tmp_path: Path) -> Iterator[KubeStack]:
    # Its own API server: this test kills it.
    with kube_stack(tmp_path / "kube") as stack:
        yield stack


class Blackhole:
    """A TCP relay between lapse and a real server that can cut the line, injected here
    because the shared database server must keep serving the other tests. Two faults:

    - `sever()`: refused. Open connections are reset and new ones refused, as when the
      server's host is up and the server is not (the client hears of it at once).
    - `sever(drop=True)`: black-holed. Packets are dropped, nothing is refused: open
      connections go silent and stay silent (a firewall or NAT that dropped its state drops
      their packets for good, so they never answer again), and new connections are accepted
      and never answered. The client hears nothing; only its own timeouts end the wait.

    `mend()` lets new connections through again."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.cut = False
        self.dropping = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        # Black-holed connections: data read from them is discarded until they close.
        self._silenced: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def stop(self) -> None:
        self.sever()
        for writer in list(self._silenced):
            writer.transport.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def sever(self, *, drop: bool = False) -> None:
        self.cut, self.dropping = True, drop
        if drop:
            self._silenced.update(self._writers)
        else:
            for writer in list(self._writers):
                writer.transport.abort()
        self._writers.clear()

    def mend(self) -> None:
        self.cut = self.dropping = False

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut and self.dropping:
            self._silenced.add(writer)
            await self._swallow(reader, writer)
            return
        if self.cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    if dst in self._silenced or writer in self._silenced:
                        continue  # dropped on the floor, in both directions
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.discard(writer)
        self._writers.discard(up_writer)
        self._silenced.discard(writer)

    async def _swallow(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while await reader.read(65536):
                pass
        self._silenced.discard(writer)
        writer.transport.abort()


def config_file(path: Path, nats_url: str, kubeconfig: Path, database_url: str | None) -> Path:
    database = (
        f"database: {{url: '{database_url}', targets: {{kfp: {{enabled: true}}}}}}\n"
        if database_url
        else ""
    )
    path.write_text(
        f"nats: {{url: '{nats_url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kubeconfig}'}}\n" + database + "policies:\n"
        "  - name: kfp-runs\n"
        "    match: {has_labels: [pipeline/runid]}\n"
        "    kubernetes: {ttl: 1h}\n"
        "    database: {ttl: 6s}\n"
        "safety: {max_deletions_per_second: 500, namespaces: {include: ['*']}}\n"
    )
    return path


def outcomes_by_name(history: list[dict[str, Any]], target: str) -> Counter[tuple[str, str]]:
    return Counter((row["name"], row["outcome"]) for row in history if row["target"] == target)


@pytest.fixture
def audited_kube(tmp_path: Path) -> Iterator[tuple[KubeStack, Path]]:
    # Its own API server and etcd, which these tests kill; every DELETE in its audit log.
    with audited_kube_stack(tmp_path / "kube") as (stack, log):
        yield stack, log


# etcd's outage outlasts the reaper's 30 s request timeout: without etcd the API server
# neither answers nor refuses, so the reads in flight wait, then time out and are retried.
# (The API server itself refused or black-holed for 60 s is the fault matrix's:
# tests/e2e/test_fault_matrix.py.)
@pytest.mark.parametrize(("killed", "outage"), [("etcd", ETCD_OUTAGE_SECONDS)])
async def test_a_killed_control_plane_is_waited_out_and_every_deletion_happens_once(
    tmp_path: Path,
    own_nats: EmbeddedNats,
    audited_kube: tuple[KubeStack, Path],
    killed: str,
    outage: float,
) -> None:
    own_kube, audit_log = audited_kube
    server = own_kube.server
    kill, restart = {
        "kube-apiserver": (server.kill_apiserver, server.restart_apiserver),
        "etcd": (server.kill_etcd, server.restart_etcd),
    }[killed]
    config = config_file(tmp_path / "lapse.yaml", own_nats.url, own_kube.kubeconfig, None)
    ns = own_kube.namespace("outage-api")
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    count = 20
    try:
        for i in range(count):
            ttl = 6 + (i % 10)  # due 6..15 s from now: all inside the outage below
            body = finished_workflow(f"wf-{i}", annotations={"lapse.dev/ttl": f"{ttl}s"})
            await own_kube.workflows.create(ns, body)
        await asyncio.sleep(3)  # planned (schedules in NATS) before the outage
        kill()
        down_at = datetime.now(UTC)

        async def reaper_waiting() -> dict[str, Any] | None:
            status: dict[str, Any] = lapse_json("status", config=config)
            waiting = [w for w in status["waiting"] if w["function"] == "object-reaper"]
            return status if waiting else None

        # Meanwhile `lapse status` says what is being waited out, and that nothing is lost.
        during = await wait_for(reaper_waiting, timeout=outage - 2, interval=1.0)
        (waiting,) = [w for w in during["waiting"] if w["function"] == "object-reaper"]
        assert waiting["events"] > 0 and waiting["seconds"] > 0, during["waiting"]
        assert during["deadLetters"] == 0
        left = down_at + timedelta(seconds=outage) - datetime.now(UTC)
        await asyncio.sleep(left.total_seconds())
        await asyncio.to_thread(restart)
        up_at = datetime.now(UTC)

        async def all_gone() -> bool:
            return not (await own_kube.workflows.list(ns))["items"]

        await wait_for(all_gone, timeout=120, interval=0.5)
        recovered = (datetime.now(UTC) - up_at).total_seconds()
        await asyncio.sleep(1)  # the last DELETE's audit line follows its commit
        history = lapse_json("history", "-n", ns, "--target", "kubernetes", config=config)
        status = lapse_json("status", config=config)
        outcomes = outcomes_by_name(history, "kubernetes")
        names = {f"wf-{i}" for i in range(count)}
        assert {name for name, _ in outcomes} == names, outcomes
        assert all(n == 1 for n in outcomes.values()), "one outcome per due event"
        # `already_gone` only for a DELETE that committed although its answer was an error
        # (etcd went away under it): the API server's audit log shows which.
        per_object = deletes(audit_log, ns)
        check_one_delete_each(per_object, names)
        assert {name for name, outcome in outcomes if outcome != "deleted"} <= {
            name for name, rs in per_object.items() if unanswered(rs)
        }, outcomes
        assert {outcome for _, outcome in outcomes} <= {"deleted", "already_gone"}
        assert all(row["latencySeconds"] >= 0 for row in history), "none deleted early"
        assert status["deadLetters"] == 0
        attempts = sum(len(rs) for rs in per_object.values())
        cut = sum(len(unanswered(rs)) for rs in per_object.values())
        print(
            f"\n{killed} killed for {(up_at - down_at).total_seconds():.0f}s, {count} due in it, "
            f"lost 0, all deleted {recovered:.1f}s after the restart; {attempts} DELETEs "
            f"({cut} answered 5xx), at most one successful per object, one outcome each"
        )
    finally:
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]


@pytest.fixture
async def kfp_database() -> AsyncIterator[Database]:
    async with scratch_database("postgresql") as db:
        engine = create_engine(db.url)
        await create_kfp_tables(engine)
        await engine.dispose()
        yield db


def _contains(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text()


def logged(path: Path, text: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return _contains(path, text)

    return check


async def test_started_while_the_database_is_unreachable_it_waits_then_runs(
    tmp_path: Path, own_nats: EmbeddedNats, own_kube: KubeStack, kfp_database: Database
) -> None:
    real = make_url(kfp_database.url)
    line = Blackhole(real.host or "127.0.0.1", real.port or 5432)
    await line.start()
    line.sever()
    via_line = real.set(host="127.0.0.1", port=line.port).render_as_string(hide_password=False)
    config = config_file(tmp_path / "lapse.yaml", own_nats.url, own_kube.kubeconfig, via_line)
    try:
        # Stopped while it waits: it exits at once, with 0 (nothing was in flight).
        waiting = LapseUp(config, tmp_path / "state", tmp_path / "waiting.log")
        start = asyncio.create_task(waiting.start())
        await wait_for(logged(waiting.log, "database unreachable"), timeout=60, interval=0.5)
        assert not start.done(), "it waits instead of exiting or running"
        start.cancel()
        assert waiting.stop() == 0, waiting.log.read_text()[-3000:]

        # Started again, the database comes back while it waits: it starts running.
        up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
        start = asyncio.create_task(up.start())
        await wait_for(logged(up.log, "database unreachable"), timeout=60, interval=0.5)
        line.mend()
        await start
        assert up.stop() == 0, up.log.read_text()[-3000:]
    finally:
        await line.stop()
