"""`lapse reconcile` against a real kube-apiserver, NATS and PostgreSQL / MariaDB.

What is checked is what lands in NATS: pending schedules (`NatsScheduleStore.get`) for
deadlines ahead, and fired due messages on `lapse.due.<target>.<uid>` for deadlines that had
already passed (the scheduler fires those within about a quarter of a second).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from sqlalchemy import insert

from lapse.config import LapseConfig, Streams
from lapse.edges.database import create_engine
from lapse.edges.kubernetes import KubeObjects, Workflows, load_api_client
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.kube import EmbeddedKube
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import parse_payload
from lapse.events.kinds import ARGO_WORKFLOW, KindSpec
from lapse.events.models import CleanupDue
from lapse.events.nats_binding import from_nats
from lapse.events.run import KFP_RUN_ID_LABEL, Target
from lapse.events.subjects import due_subject
from lapse.events.timeutil import format_rfc3339
from lapse.operations.reconcile import (
    Options,
    Reconciler,
    ReconcileSummary,
    build_planner,
    reconcile,
)
from lapse.runtime.resources import Resources
from tests import kfp_schema as kfp
from tests.conftest import KubeStack, compact_etcd
from tests.stack import Database, scratch_database, wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats, pytest.mark.db]

STREAMS = Streams()
KFP_POLICY = {
    "name": "kfp-runs",
    "match": {"has_labels": [KFP_RUN_ID_LABEL]},
    "database": {"ttl": "1d"},
}


@pytest.fixture
def js(lapse_streams: JetStreamContext) -> JetStreamContext:
    return lapse_streams


@pytest.fixture(scope="module", params=["postgresql", "mysql"])
async def kfp_db(request: pytest.FixtureRequest) -> AsyncIterator[Database]:
    async with scratch_database(request.param) as db:
        engine = create_engine(db.url)
        await kfp.create_kfp_tables(engine)
        await engine.dispose()
        yield db


def config_for(
    nats: EmbeddedNats,
    kube: KubeStack,
    db: Database | None = None,
    policies: list[dict[str, Any]] | None = None,
) -> LapseConfig:
    """Without `db`, KFP is not a database target and reconcile skips the rows pass."""
    database = {"url": db.url, "targets": {"kfp": {"enabled": True}}} if db else {}
    return LapseConfig.model_validate(
        {
            "nats": {"url": nats.url},
            "kubernetes": {"kubeconfig": str(kube.kubeconfig)},
            "database": database,
            "policies": policies or [],
        }
    )


async def run_reconcile(
    config: LapseConfig, namespace: str, *, dry_run: bool = False
) -> ReconcileSummary:
    async with Resources(config) as resources:
        summary = await reconcile(resources, Options(namespace=namespace, dry_run=dry_run))
    assert summary.ok, summary.problems
    return summary


def workflow(
    name: str,
    *,
    finished_at: datetime | None,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Workflow as the Argo controller leaves it: finished (completed label, terminal
    phase, finishedAt) or still running."""
    started = format_rfc3339((finished_at or datetime.now(UTC)) - timedelta(minutes=1))
    status: dict[str, Any] = {"phase": "Running", "startedAt": started}
    if finished_at is not None:
        status = {**status, "phase": "Succeeded", "finishedAt": format_rfc3339(finished_at)}
    completed = "true" if finished_at is not None else "false"
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "labels": {"workflows.argoproj.io/completed": completed, **(labels or {})},
            "annotations": annotations or {},
        },
        "spec": {"entrypoint": "main"},
        "status": status,
    }


async def fired_due(js: JetStreamContext, target: Target, uid: str) -> CleanupDue | None:
    try:
        msg = await js.get_last_msg(STREAMS.schedule, due_subject(target, uid))
    except NotFoundError:
        return None
    return parse_payload(from_nats(msg.headers, msg.data or b""), CleanupDue)


async def wait_fired(js: JetStreamContext, target: Target, uid: str) -> CleanupDue:
    """The due message of a past-due deadline: the scheduler fires it within ~0.25 s."""

    async def fired() -> CleanupDue | None:
        return await fired_due(js, target, uid)

    due = await wait_for(fired, timeout=10)
    assert due is not None
    return due


def a_second_ago() -> datetime:
    return datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)


async def test_finished_workflows_get_schedules_and_a_second_run_changes_nothing(
    kube: KubeStack, nats_server: EmbeddedNats, js: JetStreamContext
) -> None:
    config = config_for(nats_server, kube)
    ns = kube.namespace(f"rec-{uuid.uuid4().hex[:6]}")
    finished_at = a_second_ago()
    hourly = {"lapse.dev/ttl": "1h"}
    uids = {}
    for name in ("a", "b", "c"):
        created = await kube.workflows.create(
            ns, workflow(name, finished_at=finished_at, annotations=hourly)
        )
        uids[name] = created["metadata"]["uid"]
    kept = {"lapse.dev/keep": "true"}
    created = await kube.workflows.create(
        ns, workflow("kept", finished_at=finished_at, annotations=kept)
    )
    uids["kept"] = created["metadata"]["uid"]
    created = await kube.workflows.create(ns, workflow("running", finished_at=None))
    uids["running"] = created["metadata"]["uid"]

    first = await run_reconcile(config, ns)
    assert first.runs is not None
    assert (first.runs.listed, first.runs.scheduled, first.runs.unchanged) == (4, 3, 1)
    assert first.runs.deadlines == {"kubernetes": 3}  # database: never by default
    assert (first.runs.failed, first.runs.errors, first.runs.ignored) == (0, 0, 0)
    store = NatsScheduleStore(js, STREAMS)
    for name in ("a", "b", "c"):
        pending = await store.get(Target.KUBERNETES, uids[name])
        assert pending is not None and pending.deadline == finished_at + timedelta(hours=1)
    assert await store.get(Target.KUBERNETES, uids["kept"]) is None
    assert await store.get(Target.KUBERNETES, uids["running"]) is None

    again = await run_reconcile(config, ns)
    assert again.runs is not None
    assert (again.runs.listed, again.runs.scheduled, again.runs.unchanged) == (4, 0, 4)

    # A TTL changed while lapse was not looking: a dry run counts it and writes nothing.
    current = await kube.workflows.get(ns, "a")
    assert current is not None
    current["metadata"]["annotations"]["lapse.dev/ttl"] = "2h"
    await kube.workflows.replace(ns, "a", current)
    dry = await run_reconcile(config, ns, dry_run=True)
    assert dry.runs is not None and (dry.runs.scheduled, dry.runs.unchanged) == (1, 3)
    pending = await store.get(Target.KUBERNETES, uids["a"])
    assert pending is not None and pending.deadline == finished_at + timedelta(hours=1)

    moved = await run_reconcile(config, ns)
    assert moved.runs is not None and (moved.runs.scheduled, moved.runs.unchanged) == (1, 3)
    pending = await store.get(Target.KUBERNETES, uids["a"])
    assert pending is not None and pending.deadline == finished_at + timedelta(hours=2)


async def test_a_past_due_run_fires_once_and_is_not_scheduled_again(
    kube: KubeStack, nats_server: EmbeddedNats, js: JetStreamContext
) -> None:
    config = config_for(nats_server, kube)
    ns = kube.namespace(f"rec-{uuid.uuid4().hex[:6]}")
    finished_at = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
    created = await kube.workflows.create(
        ns, workflow("old", finished_at=finished_at, annotations={"lapse.dev/ttl": "1s"})
    )
    uid = created["metadata"]["uid"]

    first = await run_reconcile(config, ns)
    assert first.runs is not None and first.runs.scheduled == 1
    due = await wait_fired(js, Target.KUBERNETES, uid)
    assert due.deadline == finished_at + timedelta(seconds=1)

    # Nothing has reaped it yet (no reaper runs here): its due event is in the pipeline,
    # and a second one would only make the reaper report already_gone.
    again = await run_reconcile(config, ns)
    assert again.runs is not None
    assert (again.runs.scheduled, again.runs.unchanged) == (0, 1)


async def test_orphaned_kfp_rows_past_their_database_deadline_are_scheduled(
    kube: KubeStack, nats_server: EmbeddedNats, js: JetStreamContext, kfp_db: Database
) -> None:
    config = config_for(nats_server, kube, kfp_db, [KFP_POLICY])
    ns = kube.namespace(f"rec-{uuid.uuid4().hex[:6]}")
    ids = {name: str(uuid.uuid4()) for name in ("gone1", "gone2", "live", "recent", "running")}
    other = str(uuid.uuid4())
    now = int(datetime.now(UTC).timestamp())
    finished = {"recent": now - 60, "running": 0}  # the others: 2023 (kfp_rows' default)
    engine = create_engine(kfp_db.url)
    try:
        async with engine.begin() as conn:
            for name, run_id in ids.items():
                await _insert_run(conn, run_id, ns, finished.get(name))
            await _insert_run(conn, other, "someone-else", None)
    finally:
        await engine.dispose()
    # The live run's Workflow still exists (finished long ago, so it is planned by the
    # runs pass under its own uid).
    old = datetime(2023, 11, 14, 22, 23, 20, tzinfo=UTC)
    await kube.workflows.create(
        ns, workflow("live", finished_at=old, labels={KFP_RUN_ID_LABEL: ids["live"]})
    )

    summary = await run_reconcile(config, ns)
    rows = summary.rows
    assert rows is not None
    assert (rows.considered, rows.orphaned, rows.scheduled) == (4, 2, 2)
    assert (rows.live, rows.not_due, rows.never, rows.errors) == (1, 1, 0, 0)
    for name in ("gone1", "gone2"):
        due = await wait_fired(js, Target.DATABASE, ids[name])
        assert due.target is Target.DATABASE
        assert due.run.kfp_run_id == ids[name] and due.run.namespace == ns
        assert due.deadline == datetime.fromtimestamp(1_700_000_600, UTC) + timedelta(days=1)
        assert due.policy == "policy:kfp-runs"
    store = NatsScheduleStore(js, STREAMS)
    for run_id in (ids["live"], ids["recent"], ids["running"], other):
        assert await store.get(Target.DATABASE, run_id) is None
        assert await fired_due(js, Target.DATABASE, run_id) is None

    again = await run_reconcile(config, ns)
    assert again.rows is not None
    assert (again.rows.orphaned, again.rows.scheduled, again.rows.unchanged) == (2, 0, 2)


async def test_rows_are_skipped_when_kfp_is_not_a_target(
    kube: KubeStack, nats_server: EmbeddedNats, js: JetStreamContext
) -> None:
    config = config_for(nats_server, kube)
    summary = await run_reconcile(config, f"nothing-{uuid.uuid4().hex[:6]}")
    assert summary.rows is None and summary.rows_skipped is not None
    assert summary.runs is not None and summary.runs.listed == 0


async def _insert_run(conn: Any, run_id: str, namespace: str, finished_at: int | None) -> None:
    rows = kfp.kfp_rows(run_id, namespace=namespace)
    if finished_at is not None:
        rows["run_details"][0]["FinishedAtInSec"] = finished_at
    for name in kfp.KFP_TABLES:
        await conn.execute(insert(kfp.metadata.tables[name]), rows[name])


class CompactingObjects(KubeObjects):
    """Compacts etcd between the first and the second page, and checks that the server then
    refuses the old continue token, before reconcile itself asks for the page."""

    def __init__(self, inner: KubeObjects, workflows: Workflows, server: EmbeddedKube) -> None:
        self.__dict__.update(inner.__dict__)
        self.inner = inner
        self.workflows = workflows
        self.server = server
        self.expired = False

    async def list_page(
        self,
        kind: KindSpec,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        limit: int = 500,
        continue_token: str | None = None,
        request_timeout: float | None = None,
    ) -> dict[str, Any]:
        if kind is ARGO_WORKFLOW and continue_token is not None and not self.expired:
            # A write moves the revision past the list's snapshot; compaction then drops it.
            await self.workflows.create("elsewhere", workflow("w", finished_at=None))
            compact_etcd(self.server.etcd_url)
            with pytest.raises(ApiException) as refused:
                await self.workflows.list(
                    "expiry", label_selector="workflows.argoproj.io/completed=true",
                    limit=2, continue_token=continue_token,
                )  # fmt: skip
            assert refused.value.status == 410
            self.expired = True
        return await self.inner.list_page(
            kind,
            namespace,
            label_selector=label_selector,
            limit=limit,
            continue_token=continue_token,
            request_timeout=request_timeout,
        )


class CompactingResources(Resources):
    def __init__(self, config: LapseConfig, server: EmbeddedKube) -> None:
        super().__init__(config)
        self.server = server
        self.compacting: CompactingObjects | None = None

    def objects(self) -> KubeObjects:
        if self.compacting is None:
            self.compacting = CompactingObjects(super().objects(), super().workflows(), self.server)
        return self.compacting


async def test_an_expired_continue_token_does_not_end_the_listing(
    uncached_kube: KubeStack, nats_server: EmbeddedNats, js: JetStreamContext
) -> None:
    server, workflows = uncached_kube.server, uncached_kube.workflows
    core = client.CoreV1Api(load_api_client(str(server.kubeconfig_path)))
    for name in ("expiry", "elsewhere"):
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    finished_at = a_second_ago()
    hourly = {"lapse.dev/ttl": "1h"}
    for i in range(5):
        await workflows.create(
            "expiry", workflow(f"wf-{i}", finished_at=finished_at, annotations=hourly)
        )
    kubeconfig = str(server.kubeconfig_path)
    config = LapseConfig.model_validate(
        {"nats": {"url": nats_server.url}, "kubernetes": {"kubeconfig": kubeconfig}}
    )
    resources = CompactingResources(config, server)
    async with resources:
        planner = await build_planner(resources, dry_run=False)
        reconciler = Reconciler(resources, planner, Options(namespace="expiry", page_size=2))
        summary = await reconciler.run()
    assert resources.compacting is not None and resources.compacting.expired
    assert summary.ok, summary.problems
    assert summary.runs is not None
    # The server's fresh token continues after the last item it served: none is lost.
    assert (summary.runs.listed, summary.runs.scheduled) == (5, 5)
