"""The fault matrix for the row and artifact targets, through `lapse up` (a subprocess):
PostgreSQL, MariaDB and SeaweedFS S3 each (1) refusing, then (2) black-holed, while runs
fall due. The rule (issue 37): an outage is waited out, never dead-lettered, and never
ends the process; each due event ends in exactly one outcome, after the outage; 0 lost,
0 early.

Each test runs two `lapse up`s side by side, one per database kind, each with its own
NATS, the row-reaper on its real database (KFP tables) and the artifact-reaper on the real
SeaweedFS: the targets are independent, so the outages of one fault share one window.

Every dependency is reached through `Blackhole` (tests/e2e/test_outages.py), a loopback
TCP relay the test switches between passing, refusing and black-holing, with the real
server behind it. It stands in for the network, not for the server, and it is the only
way to provoke a black hole here: no real server can be made to accept a connection and
then never answer, and the shared servers must keep serving the other tests.

The window is measured in the clients' own timeouts, which the test sets short (lapse.yaml
`database.*_timeout`, `artifacts.*timeout`: seconds instead of the production minute): the
lines are cut before the runs finish, so every deadline falls inside the outage, and they
stay cut for at least `AFTER_DUE` (several timeouts) past the last deadline, and until
`lapse status` has shown both reapers waiting (it reports every 5 s, and a CLI process
takes seconds on the loaded machine: the window stretches to it, never the other way), so
a black-holed call gives up, is waited out and meets the outage again long before the
line is mended. No timer races another. Each test prints what it measured (`pytest -s`
shows it).
"""

from __future__ import annotations

import asyncio
import functools
import signal
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import pytest
from obstore.store import S3Store
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from lapse.config import Streams
from lapse.edges.database import create_engine
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.seaweedfs import REGION, EmbeddedSeaweedFS
from lapse.events.timeutil import parse_rfc3339
from lapse.operations.audit import OUTCOME_TYPES, audit_events, history_row
from lapse.operations.dlq import dead_letters
from tests.conftest import ARTIFACT_BUCKET, KubeStack
from tests.e2e.test_artifacts_up import workflow_with_outputs
from tests.e2e.test_lapse_up import LapseUp, finished_workflow, lapse_json
from tests.e2e.test_outages import Blackhole, outcomes_by_name
from tests.integration.test_artifact_reaper import client, plant, present
from tests.kfp_schema import create_kfp_tables, insert_kfp_runs, kfp_counts
from tests.stack import Database, scratch_database, wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats, pytest.mark.db]

# The clients' timeouts in this test (production: 10 s / 60 s / 30 s, 60 s / 3 s).
TIMEOUTS = {
    "database": {"connect_timeout": "2s", "statement_timeout": "3s", "pool_timeout": "2s"},
    "artifacts": {"timeout": "3s", "connect_timeout": "1s"},
}
LONGEST_TIMEOUT = 3.0
# The rows and artifacts fall due this long after the runs finish (their clocks below).
ROWS_TTL, ARTIFACTS_TTL = 3, 4
# How long the lines stay cut after the last deadline, at least: four of the longest
# timeout. A due event reaches its reaper up to ~4 s late on the loaded machine (measured),
# a black-holed try then waits out one timeout, and the back-off's next try (1 s, then 2 s)
# meets the outage too.
AFTER_DUE = 4 * LONGEST_TIMEOUT
KFP_RUNS = 6
ARTIFACT_RUNS = 3
KINDS = {"postgresql": "PostgreSQL", "mysql": "MariaDB"}


@dataclass
class Rig:
    """One `lapse up` with its own NATS, its database and the S3 store behind two lines."""

    kind: str
    db: Database
    nats: EmbeddedNats
    db_line: Blackhole
    s3_line: Blackhole
    tmp: Path
    ns: str
    engine: AsyncEngine = field(init=False)
    up: LapseUp = field(init=False)
    config: Path = field(init=False)
    run_ids: list[str] = field(default_factory=list)
    rows: int = 0  # the runs' rows, all tables
    outputs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine = create_engine(self.db.url)
        self.config = self.tmp / "lapse.yaml"
        self.up = LapseUp(self.config, self.tmp / "state", self.tmp / "up.log")

    def write_config(self, kube: KubeStack, seaweedfs: EmbeddedSeaweedFS) -> None:
        db_url = make_url(self.db.url).set(host="127.0.0.1", port=self.db_line.port)
        endpoint = urlsplit(seaweedfs.endpoint)
        s3_endpoint = f"{endpoint.scheme}://127.0.0.1:{self.s3_line.port}"
        db_timeouts = "".join(f"  {k}: {v}\n" for k, v in TIMEOUTS["database"].items())
        s3_timeouts = "".join(f"  {k}: {v}\n" for k, v in TIMEOUTS["artifacts"].items())
        self.config.write_text(
            f"nats: {{url: '{self.nats.url}'}}\n"
            f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
            "database:\n"
            f"  url: '{db_url.render_as_string(hide_password=False)}'\n"
            "  targets: {kfp: {enabled: true}}\n"
            f"{db_timeouts}"
            "policies:\n"
            "  - name: kfp-rows\n"
            f"    match: {{namespaces: ['{self.ns}'], has_labels: [pipeline/runid]}}\n"
            "    kubernetes: {ttl: 1h}\n"
            f"    database: {{ttl: {ROWS_TTL}s}}\n"
            "  - name: outputs\n"
            f"    match: {{namespaces: ['{self.ns}'], has_labels: [fault/outputs]}}\n"
            "    kubernetes: {ttl: 1h}\n"
            f"    artifacts: {{ttl: {ARTIFACTS_TTL}s}}\n"
            f"safety: {{max_deletions_per_second: 500, namespaces: {{include: ['{self.ns}']}}}}\n"
            "artifacts:\n"
            f"{s3_timeouts}"
            "  stores:\n"
            f"    - {{name: argo, url: 's3://{ARTIFACT_BUCKET}/fault/', endpoint: "
            f"'{s3_endpoint}', region: {REGION}, min_prefix_depth: 3}}\n"
        )

    def fault(self, drop: bool) -> str:
        return f"{KINDS[self.kind]} and S3 {'black-holed' if drop else 'refusing'}"

    def sever(self, drop: bool) -> None:
        self.db_line.sever(drop=drop)
        self.s3_line.sever(drop=drop)

    def mend(self) -> None:
        self.db_line.mend()
        self.s3_line.mend()

    async def rows_left(self) -> int:
        async with self.engine.connect() as conn:
            return sum([sum((await kfp_counts(conn, r)).values()) for r in self.run_ids])


@pytest.fixture
async def rigs(
    tmp_path: Path,
    own_nats: EmbeddedNats,
    kube: KubeStack,
    seaweedfs: EmbeddedSeaweedFS,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[list[Rig]]:
    for key, value in seaweedfs.env().items():  # `lapse up` finds them where S3 users keep them
        monkeypatch.setenv(key, value)
    s3_real = urlsplit(seaweedfs.endpoint)
    async with AsyncExitStack() as stack:
        built: list[Rig] = []
        for kind in KINDS:
            db = await stack.enter_async_context(scratch_database(kind))
            engine = create_engine(db.url)
            await create_kfp_tables(engine)
            await engine.dispose()
            nats = own_nats if not built else EmbeddedNats(tmp_path / f"nats-{kind}").start()
            if nats is not own_nats:
                stack.callback(nats.stop)
            real = make_url(db.url)
            lines = (
                Blackhole(real.host or "127.0.0.1", real.port or 0),
                Blackhole(s3_real.hostname or "127.0.0.1", s3_real.port or 0),
            )
            for line in lines:
                await line.start()
                stack.push_async_callback(line.stop)
            ns = kube.namespace(f"fault-{kind[:5]}-{uuid.uuid4().hex[:6]}")
            (tmp_path / kind).mkdir()
            rig = Rig(kind, db, nats, *lines, tmp_path / kind, ns)
            stack.push_async_callback(rig.engine.dispose)
            rig.write_config(kube, seaweedfs)
            built.append(rig)
        yield built


async def prepare(rig: Rig, s3: S3Store) -> None:
    """The runs' rows and objects, written straight to the real servers."""
    rig.run_ids = [str(uuid.uuid4()) for _ in range(KFP_RUNS)]
    async with rig.engine.begin() as conn:
        await insert_kfp_runs(conn, rig.run_ids, namespace=rig.ns)
    rig.rows = await rig.rows_left()
    for i in range(ARTIFACT_RUNS):
        keys = [f"fault/{rig.ns}/art-{i}/{f}" for f in ("main.log", "model.tgz")]
        rig.outputs += keys
    await plant(s3, *rig.outputs)


async def finish_runs(rig: Rig, kube: KubeStack) -> None:
    """The runs, finished now: lapse plans them (planning needs neither line)."""
    for i, run_id in enumerate(rig.run_ids):
        labels = {"pipeline/runid": run_id, "pipeline/persistedFinalState": "true"}
        await kube.workflows.create(rig.ns, finished_workflow(f"kfp-{i}", labels=labels))
    for i in range(ARTIFACT_RUNS):
        body = workflow_with_outputs(f"art-{i}", rig.outputs[2 * i : 2 * i + 2])
        body["metadata"]["labels"]["fault/outputs"] = "true"
        await kube.workflows.create(rig.ns, body)


async def audit_rows(rig: Rig) -> list[dict[str, Any]]:
    """The audit trail of the rig's namespace, as `lapse history` shows it (read from the
    audit stream here: a CLI process costs seconds on the loaded machine)."""
    nc = await nats.connect(rig.nats.url)
    try:
        js = nc.jetstream()
        rows = [
            history_row(event)
            async for event in audit_events(js, Streams().audit)
            if event.get_type() in OUTCOME_TYPES  # `lapse history`'s rows: the outcomes
        ]
    finally:
        await nc.close()
    return [row for row in rows if row is not None and row["namespace"] == rig.ns]


async def dead_letter_count(rig: Rig) -> int:
    nc = await nats.connect(rig.nats.url)
    try:
        return len([letter async for letter in dead_letters(nc.jetstream(), Streams().dlq)])
    finally:
        await nc.close()


async def waiting_on(rig: Rig, functions: set[str]) -> dict[str, Any] | None:
    status: dict[str, Any] = await asyncio.to_thread(lapse_json, "status", config=rig.config)
    waiting = {w["function"] for w in status["waiting"] if w["events"] > 0}
    return status if functions <= waiting else None


@pytest.mark.parametrize("drop", [False, True], ids=["refused", "black-holed"])
async def test_database_and_s3_outages_are_waited_out_with_one_outcome_per_due_event(
    kube: KubeStack, seaweedfs: EmbeddedSeaweedFS, rigs: list[Rig], drop: bool
) -> None:
    s3 = client(seaweedfs)
    began = time.monotonic()
    # Running: each row store has checked its schema through its line.
    await asyncio.gather(*(rig.up.start() for rig in rigs), *(prepare(rig, s3) for rig in rigs))
    started = time.monotonic() - began
    try:
        for rig in rigs:
            rig.sever(drop)
        down = datetime.now(UTC)
        cut = time.monotonic()
        # Finished after the cut (finishedAt is whole seconds: at most 1 s before `down`,
        # and every clock is longer), so every deadline falls inside the outage.
        await asyncio.gather(*(finish_runs(rig, kube) for rig in rigs))
        due_by = time.monotonic() + max(ROWS_TTL, ARTIFACTS_TTL)

        # Meanwhile `lapse status` says both reapers are waiting, nothing dead-lettered.
        # (It shows what each process last reported, every 5 s: the wait for it is not
        # bounded by the window, the window is stretched to it if need be.)
        reapers = {"row-reaper", "artifact-reaper"}
        waits = [
            wait_for(functools.partial(waiting_on, rig, reapers), timeout=60, interval=1.0)
            for rig in rigs
        ]
        for during in await asyncio.gather(*waits):
            assert during is not None and during["deadLetters"] == 0, during
        waited = time.monotonic() - cut
        # The rest of the outage itself: several timeouts past the last deadline.
        await asyncio.sleep(max(0.0, due_by + AFTER_DUE - time.monotonic()))
        # Nothing went while the lines were cut (nothing could), and lapse is still up.
        for rig in rigs:
            assert rig.up.process is not None and rig.up.process.poll() is None
            assert await rig.rows_left() == rig.rows > 0
            assert set(rig.outputs) <= await present(s3, f"fault/{rig.ns}/")
        up_again = datetime.now(UTC)
        for rig in rigs:
            rig.mend()
        mended = time.monotonic()

        async def drained(rig: Rig) -> float:
            async def gone() -> bool:
                return not (await rig.rows_left() or await present(s3, f"fault/{rig.ns}/"))

            # The next try comes within one back-off (16 s x 1.2 this far in; 32 s x 1.2
            # had `lapse status` been slow to show the wait) plus, black-holed, one timeout
            # of a call sent just before the mend.
            await wait_for(gone, timeout=60, interval=0.5)
            return time.monotonic() - mended

        took = await asyncio.gather(*(drained(rig) for rig in rigs))

        async def recorded(rig: Rig) -> list[dict[str, Any]]:
            rows = await audit_rows(rig)
            done = [r for r in rows if r["target"] in ("database", "artifacts")]
            return rows if len(done) >= 2 * KFP_RUNS + ARTIFACT_RUNS else []

        histories = await asyncio.gather(
            *(wait_for(functools.partial(recorded, rig), timeout=30, interval=0.5) for rig in rigs)
        )
        dead = await asyncio.gather(*(dead_letter_count(rig) for rig in rigs))
        report = []
        for rig, drain, history, dlq in zip(rigs, took, histories, dead, strict=True):
            rows = outcomes_by_name(history, "database")
            files = outcomes_by_name(history, "artifacts")
            # Each due event ended in exactly one outcome, `deleted`: none lost, none twice,
            # no `failed` (and no `rescheduled`: waiting out an outage is not an outcome).
            # The KFP runs' artifacts clock finds nothing captured: `already_gone`, once.
            assert rows == {(f"kfp-{i}", "deleted"): 1 for i in range(KFP_RUNS)}, history
            assert files == {
                **{(f"art-{i}", "deleted"): 1 for i in range(ARTIFACT_RUNS)},
                **{(f"kfp-{i}", "already_gone"): 1 for i in range(KFP_RUNS)},
            }, history
            due = [
                r
                for r in history
                if (r["target"], r["outcome"])
                in {("database", "deleted"), ("artifacts", "deleted")}
            ]
            for row in due:
                # The outage covered each deadline, and none went before the lines mended.
                assert down < parse_rfc3339(row["deadline"]) < up_again, row
                assert parse_rfc3339(row["time"]) > up_again, row
                assert row["latencySeconds"] >= 0, row
            assert dlq == 0, dlq
            assert rig.up.process is not None and rig.up.process.poll() is None
            report.append(
                f"{rig.fault(drop)}: {sum(rows.values())} row and {sum(files.values())} "
                f"artifact outcomes, one per due event, all deleted {drain:.1f} s after the mend"
            )
        print(
            f"\nlapse ups running {started:.1f} s after the start; lines cut {mended - cut:.1f} s"
            f" (every deadline inside, the last {mended - due_by:.1f} s before the mend), both"
            f" reapers waiting in `lapse status` {waited:.1f} s after the cut; 0 lost, 0 early,"
            " DLQ 0, lapse up never exited;"
            f" {time.monotonic() - began:.1f} s in all:\n  " + "\n  ".join(report)
        )
    finally:
        for rig in rigs:
            rig.mend()
        stopping = time.monotonic()
        for rig in rigs:  # all at once, then each waited for
            if rig.up.process is not None and rig.up.process.poll() is None:
                rig.up.process.send_signal(signal.SIGTERM)
        codes = [rig.up.process.wait(timeout=60) for rig in rigs if rig.up.process]
        logs = "\n".join(rig.up.log.read_text()[-3000:] for rig in rigs)
        assert codes == [0] * len(rigs), logs
        assert time.monotonic() - stopping < 30, "a stop is prompt, even with silent connections"
