"""row-reaper against real PostgreSQL and MariaDB: KFP, Argo archive and declared tables.

Connection trouble is provoked for real: the engine talks to the database through a TCP
proxy on loopback that the test closes (refusing new connections, cutting open ones) and
opens again; the shared database servers are never stopped.

The subject here is the database edge. What lapse stored for each due event (the schedule
the row-reaper proves a deadline from) is held in memory (`tests.fakes.FakeSchedules`): every
due event these tests deliver is first stored as fired, as the NATS scheduler would have.
The proof against a real NATS server, and forged events that no schedule backs, are in
tests/e2e/test_forged_events.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cloudevents.core.base import BaseCloudEvent
from sqlalchemy import (
    BigInteger,
    Column,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    event,
    func,
    insert,
    select,
    text,
)
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from lapse.config import DatabaseTargets
from lapse.edges.database import create_engine
from lapse.edges.rows import (
    CoalescingRowStore,
    DatabaseUnavailable,
    SchemaMismatch,
    SqlRowStore,
    open_row_store,
)
from lapse.edges.rows.delete import normalizer
from lapse.edges.rows.guard import read_facts
from lapse.edges.rows.model import PendingRun
from lapse.edges.rows.reflect import reflect_targets
from lapse.events.builder import build_event, outcome_id, parse_payload
from lapse.events.models import CleanupCompleted, CleanupDue, CleanupFailed
from lapse.events.run import KFP_RUN_ID_LABEL, Engine, RunRef, Target
from lapse.events.types import EventType, Outcome
from lapse.functions.ports import RetryLater
from lapse.functions.row_reaper import (
    Contradicted,
    Counted,
    RowReaper,
    RowStore,
    RunRows,
    TargetSpec,
    targets_for,
)
from lapse.functions.row_reaper.targets import argo_archive_target, kfp_target
from lapse.functions.row_reaper.verdict import Precondition, RunFacts, meets
from lapse.functions.safety import SafetyConfig
from lapse.functions.trust import Trust
from tests import argo_archive_schema as argo
from tests import kfp_schema as kfp
from tests.fakes import FakeSchedules
from tests.stack import Database, wait_for

pytestmark = pytest.mark.db

DEADLINE = datetime(2026, 1, 1, tzinfo=UTC)


class ListEmitter:
    def __init__(self) -> None:
        self.events: list[BaseCloudEvent] = []

    async def emit(self, event: BaseCloudEvent) -> None:
        self.events.append(event)


def due(
    *,
    kfp_run_id: str | None = None,
    uid: str | None = None,
    name: str = "wf",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    finished_at: datetime | None = None,
    namespace: str = "team-a",
) -> BaseCloudEvent:
    labels = dict(labels or {})
    if kfp_run_id is not None:
        labels[KFP_RUN_ID_LABEL] = kfp_run_id
    run = RunRef(
        engine=Engine.ARGO,
        api_version="argoproj.io/v1alpha1",
        kind="Workflow",
        namespace=namespace,
        name=name,
        uid=uid or str(uuid.uuid4()),
        phase="Succeeded",
        labels=labels,
        annotations=annotations or {},
        kfp_run_id=kfp_run_id,
        finished_at=finished_at,
    )
    payload = CleanupDue(
        run=run, target=Target.DATABASE, deadline=DEADLINE, policy="test", scheduled_at=DEADLINE
    )
    return build_event(EventType.CLEANUP_DUE, source="/lapse/test", data=payload)


def completed(event: BaseCloudEvent) -> CleanupCompleted:
    assert event.get_type() == EventType.CLEANUP_COMPLETED
    assert event.get_source() == "/lapse/row-reaper"
    return parse_payload(event, CleanupCompleted)


@pytest.fixture
async def engine(database: Database) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database.url)
    yield engine
    async with engine.begin() as conn:
        await conn.run_sync(USER_TABLES.drop_all)
    await kfp.drop_kfp_tables(engine)
    await argo.drop_argo_tables(engine)
    await engine.dispose()


class Backed:
    """A RowReaper whose every due event is one lapse stored (fired by the scheduler), on
    the store's coalescing front as `lapse up` gives it (lapse/runtime/registry.py)."""

    def __init__(self, rows: RowStore, emitter: ListEmitter, **options: Any) -> None:
        self.stored = FakeSchedules()
        self.inner = RowReaper(
            rows=CoalescingRowStore(rows), schedules=self.stored, emitter=emitter, **options
        )

    async def handle(self, event: BaseCloudEvent) -> list[BaseCloudEvent]:
        return await self.inner.handle(self.stored.fired(event))


async def reaper(
    engine: AsyncEngine, targets: list[TargetSpec], *, dry_run: bool = False
) -> tuple[Backed, ListEmitter]:
    emitter = ListEmitter()
    store = await open_row_store(engine, targets)
    return Backed(store, emitter, safety=SafetyConfig(dry_run=dry_run)), emitter


async def handle_all(handler: Backed, events: list[BaseCloudEvent]) -> list[BaseCloudEvent]:
    """Every event delivered at once, as a consumer's batch is; outcomes in event order."""
    return [e for emitted in await asyncio.gather(*map(handler.handle, events)) for e in emitted]


# --- KFP ---------------------------------------------------------------------------------


async def test_kfp_rows_of_the_due_run_are_deleted_and_only_those(engine: AsyncEngine) -> None:
    await kfp.create_kfp_tables(engine)
    gone, kept = str(uuid.uuid4()), str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [gone, kept], metrics=3, tasks=2)
        # Same UUID, other resource type: KFP's delete leaves it, so must lapse.
        await conn.execute(
            insert(kfp.resource_references),
            {
                "ResourceUUID": gone,
                "ResourceType": "Job",
                "ReferenceUUID": "x",
                "ReferenceName": "x",
                "ReferenceType": "Experiment",
                "Relationship": "Owner",
                "Payload": "{}",
            },
        )
    handler, emitter = await reaper(engine, [kfp_target()])

    emitted = await handler.handle(due(kfp_run_id=gone))

    assert emitted == emitter.events and len(emitted) == 1
    result = completed(emitted[0])
    assert result.outcome is Outcome.DELETED
    assert result.detail == "kfp: run_metrics=3, tasks=2, resource_references=2, run_details=1"
    assert result.latency_seconds is not None and result.latency_seconds > 0
    async with engine.connect() as conn:
        assert await kfp.kfp_counts(conn, gone) == dict.fromkeys(kfp.KFP_TABLES, 0)
        assert await kfp.kfp_counts(conn, kept) == {
            "run_details": 1,
            "run_metrics": 3,
            "tasks": 2,
            "resource_references": 2,
        }
        other_type = await conn.execute(
            select(func.count())
            .select_from(kfp.resource_references)
            .where(kfp.resource_references.c.ResourceUUID == gone)
        )
        assert other_type.scalar_one() == 1


async def test_second_delivery_is_already_gone_and_deletes_nothing(engine: AsyncEngine) -> None:
    await kfp.create_kfp_tables(engine)
    run_id, other = str(uuid.uuid4()), str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [run_id, other])
    handler, _ = await reaper(engine, [kfp_target()])
    event = due(kfp_run_id=run_id)

    first = completed((await handler.handle(event))[0])
    async with engine.connect() as conn:
        before = await kfp.kfp_total(conn)
    second = completed((await handler.handle(event))[0])

    assert first.outcome is Outcome.DELETED
    assert second.outcome is Outcome.ALREADY_GONE
    assert second.detail == "kfp: run_metrics=0, tasks=0, resource_references=0, run_details=0"
    async with engine.connect() as conn:
        assert (
            await kfp.kfp_total(conn)
            == before
            == {
                "run_details": 1,
                "run_metrics": 2,
                "tasks": 2,
                "resource_references": 2,
            }
        )


async def test_run_without_kfp_run_id_is_already_gone_without_touching_rows(
    engine: AsyncEngine,
) -> None:
    await kfp.create_kfp_tables(engine)
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [str(uuid.uuid4())])
    handler, _ = await reaper(engine, [kfp_target()])

    result = completed((await handler.handle(due()))[0])

    assert result.outcome is Outcome.ALREADY_GONE
    assert result.detail is not None and "skipped" in result.detail
    assert KFP_RUN_ID_LABEL in result.detail
    async with engine.connect() as conn:
        assert (await kfp.kfp_total(conn))["run_details"] == 1


async def test_dry_run_counts_and_deletes_nothing(engine: AsyncEngine) -> None:
    await kfp.create_kfp_tables(engine)
    await argo.create_argo_tables(engine)
    run_id, uid = str(uuid.uuid4()), str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [run_id], metrics=4)
        await argo.insert_archived(conn, uid, label_count=3)
    handler, _ = await reaper(engine, [kfp_target(), argo_archive_target("default")], dry_run=True)

    result = completed((await handler.handle(due(kfp_run_id=run_id, uid=uid)))[0])

    assert result.outcome is Outcome.DRY_RUN and result.dry_run
    assert result.detail == (
        "would delete kfp: run_metrics=4, tasks=2, resource_references=2, run_details=1; "
        "argo_archive: argo_archived_workflows_labels=3, argo_archived_workflows=1, "
        "argo_workflows=1"
    )
    async with engine.connect() as conn:
        assert await kfp.kfp_counts(conn, run_id) == {
            "run_details": 1,
            "run_metrics": 4,
            "tasks": 2,
            "resource_references": 2,
        }
        assert await argo.argo_counts(conn, uid) == {
            "argo_archived_workflows": 1,
            "argo_archived_workflows_labels": 3,
            "argo_workflows": 1,
        }


async def test_many_runs_at_once_each_in_its_own_transaction(engine: AsyncEngine) -> None:
    await kfp.create_kfp_tables(engine)
    # Three transactions' worth (the front takes 64 runs at most): the 300 runs of the
    # concurrent-duplicates test below cover the volume.
    run_ids = [str(uuid.uuid4()) for _ in range(150)]
    survivor = str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [*run_ids, survivor])
    handler, emitter = await reaper(engine, [kfp_target()])
    events = [due(kfp_run_id=run_id) for run_id in run_ids]

    emitted = await handle_all(handler, events)
    emitted += await handler.handle(events[0])  # a duplicate delivery, later

    outcomes = [completed(e).outcome for e in emitted]
    assert outcomes.count(Outcome.DELETED) == len(run_ids)
    assert outcomes.count(Outcome.ALREADY_GONE) == 1
    assert all(
        completed(e).detail == "kfp: run_metrics=2, tasks=2, resource_references=2, run_details=1"
        for e in emitted[: len(run_ids)]
    )
    assert sorted(e.get_id() for e in emitter.events) == sorted(e.get_id() for e in emitted)
    async with engine.connect() as conn:
        assert await kfp.kfp_total(conn) == {
            "run_details": 1,
            "run_metrics": 2,
            "tasks": 2,
            "resource_references": 2,
        }
        assert (await kfp.kfp_counts(conn, survivor))["run_details"] == 1


async def test_concurrent_duplicate_deliveries_delete_each_run_once(engine: AsyncEngine) -> None:
    await kfp.create_kfp_tables(engine)
    run_ids = [str(uuid.uuid4()) for _ in range(300)]
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, run_ids)
    handler, _ = await reaper(engine, [kfp_target()])
    events = {run_id: due(kfp_run_id=run_id) for run_id in run_ids}

    # The same runs, delivered to two consumers at once, in opposite orders.
    forward, backward = await asyncio.gather(
        handle_all(handler, list(events.values())),
        handle_all(handler, list(reversed(events.values()))),
    )

    deleted: dict[str, int] = {}
    for emitted in (forward, backward):
        for result in map(completed, emitted):
            assert result.run.kfp_run_id is not None
            if result.outcome is Outcome.DELETED:
                deleted[result.run.kfp_run_id] = deleted.get(result.run.kfp_run_id, 0) + 1
            else:
                assert result.outcome is Outcome.ALREADY_GONE
    assert len(forward) == len(backward) == 300
    assert deleted == dict.fromkeys(run_ids, 1)
    async with engine.connect() as conn:
        assert await kfp.kfp_total(conn) == dict.fromkeys(kfp.KFP_TABLES, 0)


# --- Argo archive ------------------------------------------------------------------------


async def test_argo_archive_rows_of_the_cluster_are_deleted(engine: AsyncEngine) -> None:
    await argo.create_argo_tables(engine)
    uid, other_uid = str(uuid.uuid4()), str(uuid.uuid4())
    async with engine.begin() as conn:
        await argo.insert_archived(conn, uid, label_count=3, node_versions=2)
        await argo.insert_archived(conn, uid, cluster="other")  # same uid, other cluster
        await argo.insert_archived(conn, other_uid)
    handler, _ = await reaper(engine, [argo_archive_target("default")])

    result = completed((await handler.handle(due(uid=uid)))[0])
    again = completed((await handler.handle(due(uid=uid)))[0])

    assert result.outcome is Outcome.DELETED
    assert result.detail == (
        "argo_archive: argo_archived_workflows_labels=3, argo_archived_workflows=1, "
        "argo_workflows=2"
    )
    assert again.outcome is Outcome.ALREADY_GONE
    async with engine.connect() as conn:
        assert await argo.argo_counts(conn, uid) == dict.fromkeys(argo.ARGO_TABLES, 0)
        intact = {
            "argo_archived_workflows": 1,
            "argo_archived_workflows_labels": 2,
            "argo_workflows": 1,
        }
        assert await argo.argo_counts(conn, uid, cluster="other") == intact
        assert await argo.argo_counts(conn, other_uid) == intact


# --- user-declared tables ----------------------------------------------------------------

USER_TABLES = MetaData()
artifacts = Table(
    "ml_run_artifacts",
    USER_TABLES,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", String(64), nullable=False, index=True),
    Column("path", String(200), nullable=False),
)
# Keyed by the run directly (no foreign key).
artifact_files = Table(
    "ml_artifact_files",
    USER_TABLES,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", String(64), nullable=False, index=True),
)
# Keyed through the parent's surrogate id: a real foreign key, no cascade.
artifact_tags = Table(
    "ml_artifact_tags",
    USER_TABLES,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("artifact_id", Integer, ForeignKey("ml_run_artifacts.id"), nullable=False),
    Column("tag", String(40), nullable=False),
)
# Not declared to lapse: a row here makes deleting its artifact fail for good.
artifact_holds = Table(
    "ml_artifact_holds",
    USER_TABLES,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("artifact_id", Integer, ForeignKey("ml_run_artifacts.id"), nullable=False),
)
job_stats = Table(
    "ml_job_stats",
    USER_TABLES,
    Column("job_id", BigInteger, primary_key=True, autoincrement=False),
    Column("value", Integer, nullable=False),
)

RUN_LABEL = "example.com/run"
USER_CONFIG: dict[str, Any] = {
    "tables": [
        {
            "name": "artifacts",
            "table": "ml_run_artifacts",
            "key_column": "run_id",
            "key_from": f"label:{RUN_LABEL}",
            "children": [
                {"table": "ml_artifact_files", "foreign_key_column": "run_id"},
                {"table": "ml_artifact_tags", "foreign_key_column": "artifact_id"},
            ],
        },
        {
            "name": "job-stats",
            "table": "ml_job_stats",
            "key_column": "job_id",
            "key_from": "annotation:example.com/job-id",
        },
    ]
}


async def seed_artifacts(engine: AsyncEngine, run_key: str, artifacts_per_run: int = 2) -> None:
    async with engine.begin() as conn:
        for i in range(artifacts_per_run):
            result = await conn.execute(
                insert(artifacts).values(run_id=run_key, path=f"s3://b/{run_key}/{i}")
            )
            assert result.inserted_primary_key is not None
            artifact_id = result.inserted_primary_key[0]
            await conn.execute(
                insert(artifact_tags),
                [{"artifact_id": artifact_id, "tag": t} for t in ("a", "b", "c")],
            )
        await conn.execute(insert(artifact_files), [{"run_id": run_key}] * 4)


async def artifact_counts(engine: AsyncEngine, run_key: str) -> tuple[int, int, int]:
    async with engine.connect() as conn:
        parents = (
            await conn.execute(
                select(func.count()).select_from(artifacts).where(artifacts.c.run_id == run_key)
            )
        ).scalar_one()
        files = (
            await conn.execute(
                select(func.count())
                .select_from(artifact_files)
                .where(artifact_files.c.run_id == run_key)
            )
        ).scalar_one()
        tags = (
            await conn.execute(
                select(func.count())
                .select_from(artifact_tags.join(artifacts))
                .where(artifacts.c.run_id == run_key)
            )
        ).scalar_one()
    return parents, files, tags


async def test_declared_tables_children_first_only_that_run(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(USER_TABLES.create_all)
        await conn.execute(
            insert(job_stats), [{"job_id": 41, "value": 1}, {"job_id": 42, "value": 2}]
        )
    await seed_artifacts(engine, "run-a")
    await seed_artifacts(engine, "run-b")
    targets = targets_for(DatabaseTargets.model_validate(USER_CONFIG))
    handler, _ = await reaper(engine, targets)
    event = due(labels={RUN_LABEL: "run-a"}, annotations={"example.com/job-id": "42"})

    result = completed((await handler.handle(event))[0])
    again = completed((await handler.handle(event))[0])

    assert result.outcome is Outcome.DELETED
    assert result.detail == (
        "artifacts: ml_artifact_files=4, ml_artifact_tags=6, ml_run_artifacts=2; "
        "job-stats: ml_job_stats=1"
    )
    assert again.outcome is Outcome.ALREADY_GONE
    assert await artifact_counts(engine, "run-a") == (0, 0, 0)
    assert await artifact_counts(engine, "run-b") == (2, 4, 6)
    async with engine.connect() as conn:
        left = (await conn.execute(select(job_stats.c.job_id))).scalars().all()
    assert left == [41]


async def test_refused_run_fails_alone_and_the_batch_goes_on(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(USER_TABLES.create_all)
    for key in ("ok-1", "held", "ok-2"):
        await seed_artifacts(engine, key, artifacts_per_run=1)
    async with engine.begin() as conn:
        held_id = (
            await conn.execute(select(artifacts.c.id).where(artifacts.c.run_id == "held"))
        ).scalar_one()
        await conn.execute(insert(artifact_holds).values(artifact_id=held_id))
    targets = targets_for(DatabaseTargets.model_validate(USER_CONFIG))
    handler, _ = await reaper(engine, targets)
    events = [due(labels={RUN_LABEL: key}) for key in ("ok-1", "held", "ok-2")]
    # Not a whole number for the BIGINT key column: refused before any SQL runs.
    events.append(due(labels={RUN_LABEL: "ok-1"}, annotations={"example.com/job-id": "x1"}))

    emitted = [e for due_event in events for e in await handler.handle(due_event)]

    by_type = [e.get_type() for e in emitted]
    assert by_type.count(EventType.CLEANUP_COMPLETED) == 2
    assert by_type.count(EventType.CLEANUP_FAILED) == 2
    failures = [
        parse_payload(e, CleanupFailed) for e in emitted if e.get_type().endswith("failed.v1")
    ]
    assert {f.run.labels[RUN_LABEL] for f in failures if f.run} == {"held", "ok-1"}
    assert all(f.stage == "row-reaper" and f.target is Target.DATABASE for f in failures)
    held = next(f for f in failures if f.run and f.run.labels[RUN_LABEL] == "held")
    assert "refused" in held.reason
    bad_key = next(f for f in failures if f.run and f.run.labels[RUN_LABEL] == "ok-1")
    assert "x1" in bad_key.reason and "ml_job_stats" in bad_key.reason
    assert await artifact_counts(engine, "ok-1") == (0, 0, 0)
    assert await artifact_counts(engine, "ok-2") == (0, 0, 0)
    # All or nothing per run: the held run's children were not deleted either.
    assert await artifact_counts(engine, "held") == (1, 4, 3)


async def test_a_batch_settles_each_run_alone_refused_and_bad_keys_included(
    engine: AsyncEngine,
) -> None:
    """`handle_batch` (what `lapse up`'s dispatcher calls with a fetch): the same
    verdicts as one at a time, each event with its own outcome and no failure of its own."""
    async with engine.begin() as conn:
        await conn.run_sync(USER_TABLES.create_all)
    for key in ("ok-1", "held", "ok-2"):
        await seed_artifacts(engine, key, artifacts_per_run=1)
    async with engine.begin() as conn:
        held_id = (
            await conn.execute(select(artifacts.c.id).where(artifacts.c.run_id == "held"))
        ).scalar_one()
        await conn.execute(insert(artifact_holds).values(artifact_id=held_id))
    targets = targets_for(DatabaseTargets.model_validate(USER_CONFIG))
    handler, emitter = await reaper(engine, targets)
    events = [due(labels={RUN_LABEL: key}) for key in ("ok-1", "held", "ok-2")]
    events.append(due(labels={RUN_LABEL: "ok-1"}, annotations={"example.com/job-id": "x1"}))

    results = await handler.inner.handle_batch(
        [(handler.stored.fired(e), Trust.CLAIM) for e in events]
    )

    assert all(isinstance(r, list) for r in results)
    assert [e for r in results if isinstance(r, list) for e in r] == emitter.events
    derived = {
        outcome_id(e.get_id(), kind): (i, kind)
        for i, e in enumerate(events)
        for kind in (EventType.CLEANUP_COMPLETED, EventType.CLEANUP_FAILED)
    }
    owners = [derived[e.get_id()] for e in emitter.events]
    assert sorted(i for i, _ in owners) == [0, 1, 2, 3], "one outcome per due event"
    assert dict(owners) == {
        0: EventType.CLEANUP_COMPLETED,
        1: EventType.CLEANUP_FAILED,
        2: EventType.CLEANUP_COMPLETED,
        3: EventType.CLEANUP_FAILED,
    }
    assert await artifact_counts(engine, "ok-1") == (0, 0, 0)
    assert await artifact_counts(engine, "ok-2") == (0, 0, 0)
    assert await artifact_counts(engine, "held") == (1, 4, 3)


async def test_a_run_twice_in_one_batch_is_deleted_once_with_two_outcomes(
    engine: AsyncEngine,
) -> None:
    await kfp.create_kfp_tables(engine)
    run_id = str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [run_id])
    handler, emitter = await reaper(engine, [kfp_target()])
    first = due(kfp_run_id=run_id, uid="same-run")
    again = due(kfp_run_id=run_id, uid="same-run")

    results = await handler.inner.handle_batch(
        [(handler.stored.fired(e), Trust.CLAIM) for e in (first, again)]
    )

    assert results == [[emitter.events[0]], [emitter.events[1]]]
    assert [completed(e).outcome for e in emitter.events] == [
        Outcome.DELETED,
        Outcome.ALREADY_GONE,
    ]
    assert [e.get_id() for e in emitter.events] == [
        outcome_id(first.get_id(), EventType.CLEANUP_COMPLETED),
        outcome_id(again.get_id(), EventType.CLEANUP_COMPLETED),
    ]
    async with engine.connect() as conn:
        assert await kfp.kfp_counts(conn, run_id) == dict.fromkeys(kfp.KFP_TABLES, 0)


# --- start-up checks ---------------------------------------------------------------------


async def test_missing_tables_and_columns_fail_at_start_naming_the_key(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(USER_TABLES.create_all)
    config = DatabaseTargets.model_validate(
        {
            "kfp": {"enabled": True},
            "tables": [
                {"name": "gone", "table": "no_such_table", "key_column": "run_id"},
                {
                    "name": "typo",
                    "table": "ml_run_artifacts",
                    "key_column": "runid",
                    "children": [{"table": "ml_artifact_files", "foreign_key_column": "run"}],
                },
            ],
        }
    )

    with pytest.raises(SchemaMismatch) as caught:
        await open_row_store(engine, targets_for(config))

    problems = caught.value.problems
    assert any(
        p.startswith("database.targets.kfp: table 'run_details' does not exist") for p in problems
    )
    assert any(
        p.startswith("database.targets.tables[0].table: table 'no_such_table' does not exist")
        for p in problems
    )
    assert any(
        p.startswith("database.targets.tables[1].key_column:") and "'runid'" in p for p in problems
    )
    assert any(
        p.startswith("database.targets.tables[1].children[0].foreign_key_column:") and "'run'" in p
        for p in problems
    )
    assert str(caught.value).startswith("database.targets.")


async def test_no_target_enabled_fails_at_start(engine: AsyncEngine) -> None:
    with pytest.raises(SchemaMismatch, match=r"^database\.targets: nothing to delete"):
        await open_row_store(engine, targets_for(DatabaseTargets()))


# --- unreachable database ----------------------------------------------------------------


class TcpProxy:
    """A loopback TCP relay to the database that a test can close and open again."""

    def __init__(self, port: int, upstream: tuple[str, int]) -> None:
        self.port = port
        self.upstream = upstream
        self.server: asyncio.Server | None = None
        self.links: set[asyncio.StreamWriter] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        # Accept connections but relay nothing: a database that hangs instead of refusing.
        self.stall = False

    async def open(self) -> TcpProxy:
        self.server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def cut(self) -> None:
        """Refuse new connections and drop the open ones, like a dead server."""
        if self.server is not None:
            self.server.close()
            self.server = None
        for writer in self.links:
            writer.transport.abort()
        self.links.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.stall:
            self.links.add(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self.links |= {writer, up_writer}
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(source, sink))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        sink.transport.abort()


@pytest.fixture
async def proxied(
    database: Database, engine: AsyncEngine
) -> AsyncIterator[tuple[TcpProxy, AsyncEngine]]:
    url = make_url(database.url)
    proxy = await TcpProxy(0, (url.host or "127.0.0.1", url.port or 0)).open()
    through = create_engine(url.set(port=proxy.port))
    yield proxy, through
    proxy.cut()
    await through.dispose()


async def test_unreachable_database_retries_then_deletes_everything(
    engine: AsyncEngine, proxied: tuple[TcpProxy, AsyncEngine]
) -> None:
    proxy, through = proxied
    await kfp.create_kfp_tables(engine)
    run_ids = [str(uuid.uuid4()) for _ in range(3)]
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, run_ids)
    handler, emitter = await reaper(through, [kfp_target()])
    events = [due(kfp_run_id=run_id) for run_id in run_ids]

    proxy.cut()
    for due_event in events:
        with pytest.raises(RetryLater) as single:
            await handler.handle(due_event)
        assert single.value.delay > 0 and "unreachable" in single.value.reason
    assert emitter.events == []
    async with engine.connect() as conn:
        assert (await kfp.kfp_total(conn))["run_details"] == 3

    await proxy.open()
    emitted = await handle_all(handler, events)

    assert [completed(e).outcome for e in emitted] == [Outcome.DELETED] * 3
    async with engine.connect() as conn:
        assert await kfp.kfp_total(conn) == dict.fromkeys(kfp.KFP_TABLES, 0)


async def test_started_while_unreachable_checks_schema_once_reachable(
    engine: AsyncEngine, proxied: tuple[TcpProxy, AsyncEngine]
) -> None:
    proxy, through = proxied
    await kfp.create_kfp_tables(engine)
    run_id = str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [run_id])
    proxy.cut()

    with pytest.raises(DatabaseUnavailable):
        await open_row_store(through, [kfp_target()])
    emitter = ListEmitter()
    handler = Backed(SqlRowStore(through, [kfp_target()]), emitter)
    with pytest.raises(RetryLater):
        await handler.handle(due(kfp_run_id=run_id))
    assert emitter.events == []

    await proxy.open()
    result = completed((await handler.handle(due(kfp_run_id=run_id)))[0])

    assert result.outcome is Outcome.DELETED
    async with engine.connect() as conn:
        assert await kfp.kfp_counts(conn, run_id) == dict.fromkeys(kfp.KFP_TABLES, 0)


async def test_hanging_database_times_out_into_retry_later(
    engine: AsyncEngine, proxied: tuple[TcpProxy, AsyncEngine]
) -> None:
    proxy, through = proxied
    await kfp.create_kfp_tables(engine)
    run_id = str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [run_id])
    emitter = ListEmitter()
    # The schema is read on the default timeout: on a loaded machine PostgreSQL's reflection
    # through the proxy took over 1 s (this test failed at start-up, not where it means to).
    store = await open_row_store(through, [kfp_target()])
    store.timeout = 1.0
    handler = Backed(store, emitter)
    proxy.cut()
    proxy.stall = True
    await proxy.open()

    started = asyncio.get_running_loop().time()
    with pytest.raises(RetryLater) as caught:
        await handler.handle(due(kfp_run_id=run_id))

    assert asyncio.get_running_loop().time() - started < 5
    assert "did not answer in time" in caught.value.reason
    assert emitter.events == []
    proxy.cut()
    proxy.stall = False
    await proxy.open()
    result = completed((await handler.handle(due(kfp_run_id=run_id)))[0])
    assert result.outcome is Outcome.DELETED


async def test_a_postgresql_that_never_answers_a_connect_is_given_up_at_the_connect_timeout(
    postgres: Database,
) -> None:
    # database.connect_timeout reaches asyncpg (whose own default is 60 s). The outer bound
    # only keeps a regression from hanging the test; the elapsed time tells them apart.
    url = make_url(postgres.url)
    proxy = await TcpProxy(0, (url.host or "127.0.0.1", url.port or 0)).open()
    proxy.stall = True
    engine = create_engine(url.set(port=proxy.port), connect_timeout=timedelta(seconds=1))
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(15), engine.connect():
                pass
        assert loop.time() - started < 8
    finally:
        proxy.cut()
        await engine.dispose()


async def test_mysql_without_returning_counts_with_a_locking_select(mysql: Database) -> None:
    # MariaDB has DELETE ... RETURNING, MySQL has not: take MySQL's path on the same server.
    engine = create_engine(mysql.url)
    try:
        async with engine.connect():
            pass  # the dialect learns the server version on first connect
        engine.sync_engine.dialect.delete_returning = False
        await kfp.create_kfp_tables(engine)
        await argo.create_argo_tables(engine)
        run_ids = [str(uuid.uuid4()) for _ in range(3)]
        async with engine.begin() as conn:
            await kfp.insert_kfp_runs(conn, run_ids, metrics=3)
            await argo.insert_archived(conn, run_ids[0], label_count=2)
        handler, _ = await reaper(engine, [kfp_target(), argo_archive_target("default")])
        events = [due(kfp_run_id=r, uid=r) for r in run_ids[:2]]
        statements: list[str] = []
        event.listen(
            engine.sync_engine,
            "before_cursor_execute",
            lambda conn, cursor, statement, *args: statements.append(statement),
        )

        results = [completed(e) for due_event in events for e in await handler.handle(due_event)]

        assert not any("RETURNING" in s for s in statements)
        # Per run: run_metrics, tasks, resource_references, run_details, and the archive's
        # labels, workflow and offloaded nodes (the archive's parent is locked by its guard)
        # for the run the archive has: without its parent row, whose run the other rows are
        # is unknown, and the second run's archive tables are not touched.
        assert sum("GROUP BY" in s and "FOR UPDATE" in s for s in statements) == 4 + 3 + 4

        assert [r.detail for r in results] == [
            "kfp: run_metrics=3, tasks=2, resource_references=2, run_details=1; "
            "argo_archive: argo_archived_workflows_labels=2, argo_archived_workflows=1, "
            "argo_workflows=1",
            "kfp: run_metrics=3, tasks=2, resource_references=2, run_details=1; "
            "argo_archive: argo_archived_workflows_labels=0, argo_archived_workflows=0, "
            "argo_workflows=0",
        ]
        async with engine.connect() as conn:
            assert await kfp.kfp_total(conn) == {
                "run_details": 1,
                "run_metrics": 3,
                "tasks": 2,
                "resource_references": 2,
            }
    finally:
        await kfp.drop_kfp_tables(engine)
        await argo.drop_argo_tables(engine)
        await engine.dispose()


def cut_before(proxy: TcpProxy, engine: AsyncEngine, needle: str) -> Callable[[], None]:
    """Drop the connection just before the first statement containing `needle` is sent."""

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if needle in statement:
            proxy.cut()

    event.listen(engine.sync_engine, "before_cursor_execute", before)
    return lambda: event.remove(engine.sync_engine, "before_cursor_execute", before)


async def test_connection_lost_mid_transaction_commits_nothing(
    engine: AsyncEngine, proxied: tuple[TcpProxy, AsyncEngine]
) -> None:
    proxy, through = proxied
    await kfp.create_kfp_tables(engine)
    run_id = str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [run_id], metrics=3)
    handler, emitter = await reaper(through, [kfp_target()])
    stop = cut_before(proxy, through, "DELETE FROM run_details")
    try:
        with pytest.raises(RetryLater) as caught:
            await handler.handle(due(kfp_run_id=run_id))
    finally:
        stop()
    assert "connection lost" in caught.value.reason

    assert emitter.events == []
    async with engine.connect() as conn:
        # run_metrics, tasks and resource_references were deleted in the lost transaction.
        assert await kfp.kfp_counts(conn, run_id) == {
            "run_details": 1,
            "run_metrics": 3,
            "tasks": 2,
            "resource_references": 2,
        }

    await proxy.open()
    result = completed((await handler.handle(due(kfp_run_id=run_id)))[0])

    assert result.outcome is Outcome.DELETED
    assert result.detail == "kfp: run_metrics=3, tasks=2, resource_references=2, run_details=1"
    async with engine.connect() as conn:
        assert await kfp.kfp_counts(conn, run_id) == dict.fromkeys(kfp.KFP_TABLES, 0)


async def test_an_early_due_event_deletes_nothing_and_the_stored_schedule_stands(
    engine: AsyncEngine,
) -> None:
    await kfp.create_kfp_tables(engine)
    run_id = str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [run_id])
    emitter = ListEmitter()
    store = await open_row_store(engine, [kfp_target()])
    early = DEADLINE - timedelta(minutes=10)
    handler = Backed(store, emitter, clock=lambda: early)

    result = completed((await handler.handle(due(kfp_run_id=run_id)))[0])

    assert result.outcome is Outcome.RESCHEDULED
    assert result.detail is not None and DEADLINE.isoformat() in result.detail
    async with engine.connect() as conn:
        assert (await kfp.kfp_counts(conn, run_id))["run_details"] == 1


# --- the database's own account of the run ---------------------------------------------------


async def test_a_kfp_run_the_database_says_is_running_keeps_every_row(
    engine: AsyncEngine,
) -> None:
    await kfp.create_kfp_tables(engine)
    running, retried, done = (str(uuid.uuid4()) for _ in range(3))
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [running, retried, done])
        # Still going: no finish time. Retried: finished once, RUNNING again.
        await conn.execute(
            kfp.run_details.update()
            .where(kfp.run_details.c["UUID"] == running)
            .values(FinishedAtInSec=0, State="RUNNING", Conditions="Running")
        )
        await conn.execute(
            kfp.run_details.update()
            .where(kfp.run_details.c["UUID"] == retried)
            .values(State="RUNNING")
        )
    handler, _ = await reaper(engine, [kfp_target()])

    results = {
        run_id: completed((await handler.handle(due(kfp_run_id=run_id)))[0])
        for run_id in (running, retried, done)
    }

    assert results[running].outcome is Outcome.KEPT
    assert results[retried].outcome is Outcome.KEPT
    assert results[retried].detail is not None and "RUNNING" in results[retried].detail
    assert results[done].outcome is Outcome.DELETED
    async with engine.connect() as conn:
        full = {"run_details": 1, "run_metrics": 2, "tasks": 2, "resource_references": 2}
        assert await kfp.kfp_counts(conn, running) == full
        assert await kfp.kfp_counts(conn, retried) == full


async def test_the_store_holds_each_run_of_one_transaction_to_its_precondition_data(
    engine: AsyncEngine,
) -> None:
    """The edge alone, handed the precondition as data (`verdict.Precondition`): in one
    transaction, a run KFP records as finished a second after the bound and one RUNNING
    again keep every row and come back with what the locked row said; the run finished
    exactly at its bound goes."""
    await kfp.create_kfp_tables(engine)
    late, running, on_time = (str(uuid.uuid4()) for _ in range(3))
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [late, running, on_time])
        await conn.execute(
            kfp.run_details.update()
            .where(kfp.run_details.c["UUID"] == running)
            .values(State="RUNNING")
        )
    finished = datetime.fromtimestamp(1_700_000_600, UTC)  # what insert_kfp_runs records
    store = await open_row_store(engine, [kfp_target()])

    def rows(run_id: str, bound: datetime) -> RunRows:
        return RunRows({"kfp": run_id}, Precondition(bound), namespace="team-a")

    results = await store.delete(
        [
            rows(late, finished - timedelta(seconds=1)),
            rows(running, finished),
            rows(on_time, finished),
        ],
        dry_run=False,
    )

    assert results[0] == Contradicted(
        RunFacts(running=False, finished_at=finished, state="SUCCEEDED", namespace="team-a")
    )
    assert results[1] == Contradicted(
        RunFacts(running=True, finished_at=finished, state="RUNNING", namespace="team-a")
    )
    assert isinstance(results[2], Counted) and results[2].total == 7
    async with engine.connect() as conn:
        full = {"run_details": 1, "run_metrics": 2, "tasks": 2, "resource_references": 2}
        assert await kfp.kfp_counts(conn, late) == full
        assert await kfp.kfp_counts(conn, running) == full
        assert sum((await kfp.kfp_counts(conn, on_time)).values()) == 0


async def test_a_run_that_finished_later_than_planned_is_moved_not_deleted(
    engine: AsyncEngine,
) -> None:
    await kfp.create_kfp_tables(engine)
    run_id = str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [run_id])
    planned_finish = datetime.fromtimestamp(1_700_000_600 - 3600, UTC)  # an hour too early
    emitter = ListEmitter()
    store = await open_row_store(engine, [kfp_target()])
    now = DEADLINE + timedelta(seconds=5)
    handler = Backed(store, emitter, clock=lambda: now)

    result = completed(
        (await handler.handle(due(kfp_run_id=run_id, finished_at=planned_finish)))[0]
    )

    assert result.outcome is Outcome.RESCHEDULED
    [(_, _, fire_at, moved)] = handler.stored.puts
    assert fire_at == moved.deadline == DEADLINE + timedelta(hours=1)
    async with engine.connect() as conn:
        assert (await kfp.kfp_counts(conn, run_id))["run_details"] == 1


async def test_mariadb_matching_a_key_without_its_accent_judges_the_row_it_matched(
    mysql: Database,
) -> None:
    # MariaDB's utf8mb4_general_ci finds `cafe` for `IN ('café')`: the row it returns must be
    # judged (here: still running, so kept), never deleted unread beside a key that only
    # looks different to Python.
    tables = MetaData()
    job_runs = Table(
        "ml_job_runs",
        tables,
        Column("run_key", String(64), primary_key=True),
        Column("finished_at", BigInteger, nullable=False),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_general_ci",
    )
    config = {
        "tables": [
            {
                "name": "job-runs",
                "table": "ml_job_runs",
                "key_column": "run_key",
                "key_from": "annotation:example.com/job",
                "finished_column": "finished_at",
            }
        ]
    }
    engine = create_engine(mysql.url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(tables.create_all)
            await conn.execute(insert(job_runs), [{"run_key": "cafe", "finished_at": 0}])
            same = await conn.scalar(select(func.count()).where(job_runs.c.run_key == "café"))
        assert same == 1, "the collation this test is about must match the accent away"
        handler, _ = await reaper(engine, targets_for(DatabaseTargets.model_validate(config)))

        result = completed((await handler.handle(due(annotations={"example.com/job": "café"})))[0])

        assert result.outcome is Outcome.KEPT, result
        async with engine.connect() as conn:
            assert (await conn.execute(select(job_runs.c.run_key))).scalars().all() == ["cafe"]
    finally:
        async with engine.begin() as conn:
            await conn.run_sync(tables.drop_all)
        await engine.dispose()


@pytest.mark.parametrize("change", ["running again", "finished later"])
async def test_a_row_changed_while_the_store_waits_on_its_lock_is_kept(
    engine: AsyncEngine, change: str
) -> None:
    """The precondition is the locking read's own WHERE: another transaction (KFP's
    persistence agent) holds the run's row, changed, while the store's delete of a batch
    waits on it; it commits, and the database re-checks the WHERE on the row as committed,
    so the run keeps every row and reports what the row now says, while the batch's other
    run goes."""
    await kfp.create_kfp_tables(engine)
    changed, other = str(uuid.uuid4()), str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [changed, other])
    finished = datetime.fromtimestamp(1_700_000_600, UTC)  # what insert_kfp_runs records
    update = (
        {"State": "RUNNING"}
        if change == "running again"
        else {"FinishedAtInSec": int(finished.timestamp()) + 60}
    )
    store = await open_row_store(engine, [kfp_target()])
    agent = create_engine(engine.url)
    try:
        async with agent.connect() as conn:
            tx = await conn.begin()
            await conn.execute(
                kfp.run_details.update().where(kfp.run_details.c["UUID"] == changed).values(update)
            )
            deleting = asyncio.ensure_future(
                store.delete(
                    [
                        RunRows({"kfp": run_id}, Precondition(finished), namespace="team-a")
                        for run_id in (changed, other)
                    ],
                    dry_run=False,
                )
            )

            async def waits_on_the_lock() -> bool:
                assert not deleting.done(), deleting.result()
                return await _lock_waiters(conn) > 0

            await wait_for(waits_on_the_lock, timeout=10, interval=0.05)
            await tx.commit()
        results = await asyncio.wait_for(deleting, timeout=10)
    finally:
        await agent.dispose()

    [kept, deleted] = results
    assert isinstance(kept, Contradicted), kept
    if change == "running again":
        assert kept.facts.running and kept.facts.state == "RUNNING"
    else:
        assert kept.facts.finished_at == finished + timedelta(seconds=60)
    assert isinstance(deleted, Counted) and deleted.total == 7
    async with engine.connect() as conn:
        full = {"run_details": 1, "run_metrics": 2, "tasks": 2, "resource_references": 2}
        assert await kfp.kfp_counts(conn, changed) == full
        assert sum((await kfp.kfp_counts(conn, other)).values()) == 0


async def _lock_waiters(conn: AsyncConnection) -> int:
    """Sessions of this database other than `conn`'s waiting on a row lock (MariaDB: in a
    locking read, which here can only be waiting on `conn`'s)."""
    if conn.dialect.name == "postgresql":
        query = text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()"
        )
    else:
        # innodb_trx needs the PROCESS privilege; a session sees its own user's threads.
        query = text(
            "SELECT count(*) FROM information_schema.processlist WHERE db = DATABASE() "
            "AND id <> CONNECTION_ID() AND info LIKE '%FOR UPDATE%'"
        )
    return int((await conn.execute(query)).scalar() or 0)


async def test_the_locked_where_alone_decides_as_meets_would(engine: AsyncEngine) -> None:
    """The edge's locking read, called without the store (no batch, no handler): the rows
    its WHERE selects are exactly those `verdict.meets` lets go, across finish times at,
    under and over the bound (whole seconds in KFP's BIGINT, timestamps in Argo's archive),
    unfinished ones and running states; the rest are read for their outcome only."""
    await kfp.create_kfp_tables(engine)
    await argo.create_argo_tables(engine)
    at = 1_700_000_600
    kfp_rows: dict[str, tuple[int, str | None]] = {  # FinishedAtInSec, State
        "on-bound": (at, "SUCCEEDED"),
        "a-second-late": (at + 1, "FAILED"),
        "early": (at - 100, None),
        "unfinished": (0, "PENDING"),
        "retried": (at - 5, "RUNNING"),
        "canceling": (at - 5, "CANCELING"),
    }
    archive_rows = {  # finishedat, phase
        "on-bound": (at, "Succeeded"),
        "a-second-late": (at + 1, "Failed"),
        "pending": (at - 5, "Pending"),
        "empty-phase": (at - 5, ""),
    }
    keys = {name: str(uuid.uuid4()) for name in {*kfp_rows, *archive_rows}}
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [keys[n] for n in kfp_rows])
        for name, (finished, state) in kfp_rows.items():
            await conn.execute(
                kfp.run_details.update()
                .where(kfp.run_details.c["UUID"] == keys[name])
                .values(FinishedAtInSec=finished, State=state)
            )
        for name, (finished, phase) in archive_rows.items():
            await argo.insert_archived(conn, keys[name])
            await conn.execute(
                argo.archived.update()
                .where(argo.archived.c.uid == keys[name])
                .values(finishedat=datetime.fromtimestamp(finished, UTC).replace(tzinfo=None),
                        phase=phase)
            )  # fmt: skip
    bound = datetime.fromtimestamp(at, UTC) + timedelta(milliseconds=999)
    async with engine.connect() as conn:
        bound_targets = await conn.run_sync(
            reflect_targets, [kfp_target(), argo_archive_target("default")]
        )
        await conn.rollback()
        for target, rows in zip(bound_targets, (kfp_rows, archive_rows), strict=True):
            runs = [
                PendingRun(i, {target.spec.name: keys[name]}, Precondition(bound))
                for i, name in enumerate(rows)
            ]
            for run in runs:
                run.values[target.parent] = run.keys[target.spec.name]
            async with conn.begin():
                locked, contradicted = await read_facts(
                    conn, target, runs, dry_run=False, normalize=normalizer(conn)
                )
            names = list(rows)
            read = {names[i]: facts for i, facts in (locked | contradicted).items()}
            assert set(read) == set(rows), target.spec.name  # every row read once
            assert {names[i] for i in locked} == {"on-bound", "early"} & set(rows)
            for name, facts in read.items():  # the WHERE and the pure judgement agree
                assert meets(Precondition(bound), facts) is (name in {names[i] for i in locked})
