"""The fault matrix for the row and artifact targets, through `lapse up` (a subprocess):
PostgreSQL, MariaDB and SeaweedFS S3 each (1) refusing and (2) black-holed while runs
fall due. The rule (issue 37): an outage is waited out, never dead-lettered, and never
ends the process; each due event ends in exactly one outcome; 0 lost, 0 early.

Four `lapse up`s run side by side, one per database kind and fault, each with the
row-reaper on its real database (KFP tables) and the artifact-reaper on the real
SeaweedFS, each with its own NATS: the targets are independent, so all six outages run
concurrently and the matrix costs one window, not six.

Each dependency is reached through `Blackhole` (tests/e2e/test_outages.py), a loopback TCP
relay the test controls, with the real server behind it: it is not a mock of the server,
only of the network between lapse and it (the shared servers keep serving the other tests).
Each test reports what it measured on stdout (`pytest -s` shows it).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
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

import pytest
from obstore.store import S3Store
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from lapse.edges.artifacts.stores import CONNECT_TIMEOUT
from lapse.edges.artifacts.stores import TIMEOUT as S3_TIMEOUT
from lapse.edges.database import create_engine
from lapse.edges.rows.store import DEFAULT_TIMEOUT as ROW_STORE_TIMEOUT
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.seaweedfs import REGION, EmbeddedSeaweedFS
from lapse.events.timeutil import parse_rfc3339
from lapse.runtime.outages import Backoff
from tests.conftest import ARTIFACT_BUCKET, KubeStack
from tests.e2e.test_artifacts_up import workflow_with_outputs
from tests.e2e.test_lapse_up import LapseUp, finished_workflow, lapse_json
from tests.e2e.test_outages import Blackhole, outcomes_by_name
from tests.integration.test_artifact_reaper import client, plant, present
from tests.kfp_schema import create_kfp_tables, insert_kfp_runs, kfp_counts
from tests.stack import Database, scratch_database, wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats, pytest.mark.db]

# The runs fall due at most this long after the line is cut (the longest TTL below: the
# line is cut once they are planned, which is after they finished).
DUE_WITHIN = 9.0
# The shortest window that exceeds every client timeout and retry interval involved: a
# call begun at a deadline inside it (black-holed: it hears nothing) gives up only at its
# own timeout (the row store's and obstore's 60 s; obstore's retry_timeout is the same
# 60 s, so it does not retry past it), and its first retry after the back-off (1 s) must
# meet the outage too. Refused, a connect fails at once (connect timeout 3 s) and the
# tries back off 1, 2, 4 ... 32 s (63 s in all), so the window also sees the back-off
# reach its 60 s cap (lapse/runtime/outages.py): the drain after it is the cap's.
# LAG: a due event reaches its reaper up to ~4 s late on a busy 2-core machine (measured),
# and `lapse status` takes a few seconds to say so.
LAG = 8.0
OUTAGE = (
    DUE_WITHIN
    + max(ROW_STORE_TIMEOUT, S3_TIMEOUT.total_seconds(), CONNECT_TIMEOUT.total_seconds())
    + Backoff().first * (1 + Backoff().jitter)
    + LAG
)
KFP_RUNS = 6
ARTIFACT_RUNS = 3


@dataclass
class Rig:
    """One `lapse up` with its own NATS, its database and the S3 store behind two lines."""

    drop: bool  # the fault: black-holed, else refused
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
    outputs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine = create_engine(self.db.url)
        self.config = self.tmp / "lapse.yaml"
        self.up = LapseUp(self.config, self.tmp / "state", self.tmp / "up.log")

    def write_config(self, kube: KubeStack, seaweedfs: EmbeddedSeaweedFS) -> None:
        real = make_url(self.db.url)
        db_url = real.set(host="127.0.0.1", port=self.db_line.port)
        endpoint = urlsplit(seaweedfs.endpoint)
        s3_endpoint = f"{endpoint.scheme}://127.0.0.1:{self.s3_line.port}"
        self.config.write_text(
            f"nats: {{url: '{self.nats.url}'}}\n"
            f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
            "database:\n"
            f"  url: '{db_url.render_as_string(hide_password=False)}'\n"
            "  targets: {kfp: {enabled: true}}\n"
            "policies:\n"
            "  - name: kfp-rows\n"
            f"    match: {{namespaces: ['{self.ns}'], has_labels: [pipeline/runid]}}\n"
            "    kubernetes: {ttl: 1h}\n"
            "    database: {ttl: 8s}\n"
            "  - name: outputs\n"
            f"    match: {{namespaces: ['{self.ns}'], has_labels: [fault/outputs]}}\n"
            "    kubernetes: {ttl: 1s}\n"
            "    artifacts: {ttl: 9s}\n"
            f"safety: {{max_deletions_per_second: 500, namespaces: {{include: ['{self.ns}']}}}}\n"
            "artifacts:\n"
            "  stores:\n"
            f"    - {{name: argo, url: 's3://{ARTIFACT_BUCKET}/fault/', endpoint: "
            f"'{s3_endpoint}', region: {REGION}, min_prefix_depth: 3}}\n"
        )

    @property
    def fault(self) -> str:
        return f"{self.db.kind} and S3 {'black-holed' if self.drop else 'refusing'}"

    def sever(self) -> None:
        self.db_line.sever(drop=self.drop)
        self.s3_line.sever(drop=self.drop)

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
        built = []
        for kind, drop in itertools.product(("postgresql", "mysql"), (False, True)):
            db = await stack.enter_async_context(scratch_database(kind))
            engine = create_engine(db.url)
            await create_kfp_tables(engine)
            await engine.dispose()
            name = f"{kind}-{'dropped' if drop else 'refused'}"
            nats = own_nats if not built else EmbeddedNats(tmp_path / f"nats-{name}").start()
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
            ns = kube.namespace(f"fault-{kind[:5]}-{'d' if drop else 'r'}-{uuid.uuid4().hex[:6]}")
            (tmp_path / name).mkdir(exist_ok=True)
            rig = Rig(drop, db, nats, *lines, tmp_path / name, ns)
            stack.push_async_callback(rig.engine.dispose)
            rig.write_config(kube, seaweedfs)
            built.append(rig)
        yield built


async def plan_runs(rig: Rig, kube: KubeStack, s3: S3Store) -> None:
    rig.run_ids = [str(uuid.uuid4()) for _ in range(KFP_RUNS)]
    async with rig.engine.begin() as conn:
        await insert_kfp_runs(conn, rig.run_ids)
    for i, run_id in enumerate(rig.run_ids):
        labels = {"pipeline/runid": run_id, "pipeline/persistedFinalState": "true"}
        await kube.workflows.create(rig.ns, finished_workflow(f"kfp-{i}", labels=labels))
    for i in range(ARTIFACT_RUNS):
        keys = [f"fault/{rig.ns}/art-{i}/{f}" for f in ("main.log", "model.tgz")]
        rig.outputs += keys
        await plant(s3, *keys)
        body = workflow_with_outputs(f"art-{i}", keys)
        body["metadata"]["labels"]["fault/outputs"] = "true"
        await kube.workflows.create(rig.ns, body)


async def waiting_on(rig: Rig, functions: set[str]) -> dict[str, Any] | None:
    status: dict[str, Any] = await asyncio.to_thread(lapse_json, "status", config=rig.config)
    waiting = {w["function"] for w in status["waiting"] if w["events"] > 0}
    return status if functions <= waiting else None


async def test_database_and_s3_outages_are_waited_out_with_one_outcome_per_due_event(
    kube: KubeStack, seaweedfs: EmbeddedSeaweedFS, rigs: list[Rig]
) -> None:
    s3 = client(seaweedfs)
    began = time.monotonic()
    await asyncio.gather(*(rig.up.start() for rig in rigs))
    try:
        for rig in rigs:
            await plan_runs(rig, kube, s3)

        # Planned: the artifact runs' objects go after 1 s, so their schedules are stored
        # (planning is one pass per run, in the order the watcher saw them).
        async def objects_gone() -> bool:
            for rig in rigs:
                names = [
                    w["metadata"]["name"] for w in (await kube.workflows.list(rig.ns))["items"]
                ]
                if any(name.startswith("art-") for name in names):
                    return False
            return True

        await wait_for(objects_gone, timeout=30, interval=0.3)
        planned = time.monotonic() - began
        for rig in rigs:
            rig.sever()
        down = datetime.now(UTC)
        cut = time.monotonic()

        # Meanwhile `lapse status` says both reapers are waiting, nothing dead-lettered. A
        # black-holed call says so only when its own timeout ends it: inside the window.
        reapers = {"row-reaper", "artifact-reaper"}
        waits = [
            wait_for(functools.partial(waiting_on, rig, reapers), timeout=OUTAGE - 2, interval=1.0)
            for rig in rigs
        ]
        for during in await asyncio.gather(*waits):
            assert during["deadLetters"] == 0, during
        await asyncio.sleep(OUTAGE - (time.monotonic() - cut))
        # Nothing went while the line was cut (nothing could), and lapse is still up.
        for rig in rigs:
            assert rig.up.process is not None and rig.up.process.poll() is None
            assert await rig.rows_left() > 0
            assert set(rig.outputs) <= await present(s3, f"fault/{rig.ns}/")
            rig.mend()
        up_again = datetime.now(UTC)
        mended = time.monotonic()

        async def drained(rig: Rig) -> float:
            async def gone() -> bool:
                return not (await rig.rows_left() or await present(s3, f"fault/{rig.ns}/"))

            # Black-holed, a call sent just before the mend waits out its own timeout first.
            await wait_for(gone, timeout=OUTAGE + 60, interval=0.5)
            return time.monotonic() - mended

        took = await asyncio.gather(*(drained(rig) for rig in rigs))

        report = []
        for rig, drain in zip(rigs, took, strict=True):

            async def recorded(rig: Rig = rig) -> list[dict[str, Any]]:
                rows: list[dict[str, Any]] = await asyncio.to_thread(
                    lapse_json, "history", "-n", rig.ns, config=rig.config
                )
                done = [r for r in rows if r["target"] in ("database", "artifacts")]
                return rows if len(done) >= 2 * KFP_RUNS + ARTIFACT_RUNS else []

            history = await wait_for(recorded, timeout=30, interval=0.5)
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
                # The outage covered each deadline, and none went before it.
                assert down < parse_rfc3339(row["deadline"]) < up_again, row
                assert parse_rfc3339(row["time"]) > up_again, row
                assert row["latencySeconds"] >= 0, row
            assert lapse_json("dlq", "list", config=rig.config) == []
            assert lapse_json("status", config=rig.config)["deadLetters"] == 0
            assert rig.up.process is not None and rig.up.process.poll() is None
            report.append(
                f"{rig.fault}: {sum(rows.values())} row and {sum(files.values())} artifact "
                f"outcomes, one per due event, all deleted {drain:.1f} s after the mend"
            )
        print(
            f"\nplanned {planned:.1f} s after the start; lines cut {mended - cut:.1f} s "
            f"(every deadline inside), 0 lost, 0 early, DLQ 0, lapse up never exited:\n  "
            + "\n  ".join(report)
        )
    finally:
        for rig in rigs:
            rig.mend()
        began = time.monotonic()
        codes = [rig.up.stop(signal.SIGTERM) for rig in rigs]
        logs = "\n".join(rig.up.log.read_text()[-3000:] for rig in rigs)
        assert codes == [0] * len(rigs), logs
        assert time.monotonic() - began < 60, "a stop is prompt, even with silent connections"
