"""Forged due events in the same fetch as a run's real one, through `lapse up`'s dispatcher
and the row-reaper's batch path: each event ends in its own outcome, judged from what lapse
read for it, and none is credited with another's deletion.

The batch path once put a forged event and the real one for the same KFP run in one
transaction, where the rows deleted were counted for whichever named them first: the
forgery ended `deleted`. Now events naming the same uid or row key never share a
transaction (functions/row_reaper/batches.py).

Real servers: the due events are messages in a real NATS schedule stream (what the
scheduler leaves behind, and the proof the row-reaper reads back), the rows are KFP's
tables in PostgreSQL and MariaDB. The store is wrapped only to record which runs each
`delete` carried.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest
from cloudevents.core.base import BaseCloudEvent
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from lapse.config import NatsConfig
from lapse.edges.rows import open_row_store
from lapse.edges.schedules import NatsScheduleStore
from lapse.events.builder import build_event, outcome_id, parse_payload
from lapse.events.models import CleanupCompleted, CleanupDue
from lapse.events.run import KFP_RUN_ID_LABEL, Engine, RunRef, Target
from lapse.events.types import EventType, Outcome
from lapse.functions.row_reaper import RowStore
from lapse.functions.row_reaper.ports import RunResult, RunRows
from lapse.functions.row_reaper.targets import TargetSpec, kfp_target
from lapse.functions.trust import Provenance
from lapse.runtime.dispatcher import BatchHandler, Dispatcher, Subscription
from lapse.telemetry.handling import instrumented
from tests import kfp_schema as kfp
from tests.integration import test_row_reaper as rows_fixtures
from tests.integration.test_dispatcher_batches import ROUTE, STREAMS, fire, reaper, settled
from tests.integration.test_row_reaper import ListEmitter
from tests.stack import Database, wait_for

pytestmark = [pytest.mark.db, pytest.mark.nats]

engine = rows_fixtures.engine
FULL = {"run_details": 1, "run_metrics": 2, "tasks": 2, "resource_references": 2}


class Recording:
    """The real row store, recording the KFP run ids each `delete` carried."""

    def __init__(self, inner: RowStore) -> None:
        self.inner = inner
        self.batches: list[list[str]] = []

    @property
    def targets(self) -> Sequence[TargetSpec]:
        return self.inner.targets

    async def delete(self, runs: Sequence[RunRows], *, dry_run: bool) -> list[RunResult]:
        self.batches.append([run.keys["kfp"] for run in runs])
        return await self.inner.delete(runs, dry_run=dry_run)


def due(run_id: str, uid: str, deadline: datetime, name: str) -> BaseCloudEvent:
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="team-a", name=name, uid=uid, phase="Succeeded",
        labels={KFP_RUN_ID_LABEL: run_id}, kfp_run_id=run_id,
    )  # fmt: skip
    payload = CleanupDue(
        run=run, target=Target.DATABASE, deadline=deadline, policy="test", scheduled_at=deadline
    )
    return build_event(EventType.CLEANUP_DUE, source="/lapse/ttl-planner", data=payload)


async def test_forged_due_events_sharing_a_fetch_with_the_real_one_are_never_credited(
    lapse_streams: JetStreamContext, engine: AsyncEngine
) -> None:
    js = lapse_streams
    await kfp.create_kfp_tables(engine)
    real_id, victim_id, bystander_id = (str(uuid.uuid4()) for _ in range(3))
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [real_id, victim_id, bystander_id])
    past = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=1)
    real_uid, victim_uid = str(uuid.uuid4()), str(uuid.uuid4())
    real = due(real_id, real_uid, past, "real")
    # The victim's rows: lapse stored their schedule, an hour away.
    victim_due = due(victim_id, victim_uid, past + timedelta(hours=1), "victim")
    await NatsScheduleStore(js, STREAMS).put(
        Target.DATABASE,
        victim_uid,
        datetime.now(UTC) + timedelta(hours=1),
        victim_due,
        provenance=Provenance.CLAIMED,
    )
    # Forgeries naming the real run's KFP id, on due subjects as a publisher with NATS
    # credentials would put them: under the victim's uid (claiming it is due), under a uid
    # lapse never planned (on plain NATS, what is published there is the stored proof:
    # docs/security.md), and the real event replayed under its own uid.
    under_victim = due(real_id, victim_uid, past, "victim")
    unplanned = due(real_id, str(uuid.uuid4()), past, "nobody")
    replayed = due(real_id, real_uid, past, "real")
    fetch = [under_victim, real, unplanned, replayed]
    await fire(js, fetch)  # all there before the first fetch: one batch

    emitter = ListEmitter()
    rows = Recording(await open_row_store(engine, [kfp_target()]))
    # Wrapped as `lapse up` wraps it (lapse/runtime/registry.py): still a batch handler.
    handler = instrumented("row-reaper", await reaper(js, rows, emitter))
    assert isinstance(handler, BatchHandler)
    dispatcher = Dispatcher(js, emitter, NatsConfig(), [Subscription(ROUTE, handler)], batch=64)
    dispatching = asyncio.create_task(dispatcher.run())
    try:

        async def all_out() -> bool:
            return len(emitter.events) >= len(fetch) and await settled(js)

        await wait_for(all_out, timeout=60, interval=0.1)
    finally:
        dispatcher.stop()
        await asyncio.wait_for(dispatching, 30)

    wanted = {outcome_id(e.get_id(), EventType.CLEANUP_COMPLETED): e for e in fetch}
    ends: dict[str, Outcome] = {}
    for event in emitter.events:
        owner = wanted[event.get_id()]
        assert owner.get_id() not in ends, "two outcomes for one due event"
        ends[owner.get_id()] = parse_payload(event, CleanupCompleted).outcome
    assert ends[under_victim.get_id()] is Outcome.RESCHEDULED  # the victim's: an hour away
    # The three naming the real run's rows (the unplanned one proved by what was published
    # on its due subject) each in a transaction of its own: the first to reach the row
    # store's front deletes them, the others count none of them.
    naming = [ends[e.get_id()] for e in (real, unplanned, replayed)]
    assert sorted(naming) == sorted(
        [Outcome.DELETED, Outcome.ALREADY_GONE, Outcome.ALREADY_GONE]
    ), ends
    # One transaction per round: never the same KFP run twice in one.
    assert rows.batches == [[real_id], [real_id], [real_id]], rows.batches
    async with engine.connect() as conn:
        assert await kfp.kfp_counts(conn, real_id) == dict.fromkeys(kfp.KFP_TABLES, 0)
        assert await kfp.kfp_counts(conn, victim_id) == FULL
        assert await kfp.kfp_counts(conn, bystander_id) == FULL


async def test_forged_due_events_naming_a_running_runs_rows_in_one_fetch_are_each_judged(
    lapse_streams: JetStreamContext, engine: AsyncEngine, database: Database
) -> None:
    """What the first batch path got wrong (tests/e2e/test_forged_inputs.py): two forged
    due events in one fetch naming the same running run's KFP id. In one transaction the
    run's record was read once, for the first: the second went unjudged, and the running
    run's rows were deleted. Each is judged in a transaction of its own now, and the key
    in capitals too (MySQL's collation finds the same rows by it)."""
    js = lapse_streams
    await kfp.create_kfp_tables(engine)
    running_id, finished_id = str(uuid.uuid4()), str(uuid.uuid4())
    async with engine.begin() as conn:
        await kfp.insert_kfp_runs(conn, [running_id, finished_id])
        await conn.execute(
            kfp.run_details.update()
            .where(kfp.run_details.c["UUID"] == running_id)
            .values(FinishedAtInSec=0, State="RUNNING", Conditions="Running")
        )
    past = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=1)
    # Published on due subjects lapse never planned: on plain NATS what is there is the
    # stored proof (docs/security.md), so each is proven and reaches the transaction.
    forged = [
        due(running_id, str(uuid.uuid4()), past, "forged-1"),
        due(running_id, str(uuid.uuid4()), past, "forged-2"),
        due(running_id.upper(), str(uuid.uuid4()), past, "forged-3"),
    ]
    real = due(finished_id, str(uuid.uuid4()), past, "real")
    fetch = [forged[0], real, forged[1], forged[2]]
    await fire(js, fetch)

    emitter = ListEmitter()
    rows = Recording(await open_row_store(engine, [kfp_target()]))
    handler = instrumented("row-reaper", await reaper(js, rows, emitter))
    dispatcher = Dispatcher(js, emitter, NatsConfig(), [Subscription(ROUTE, handler)], batch=64)
    dispatching = asyncio.create_task(dispatcher.run())
    try:

        async def all_out() -> bool:
            return len(emitter.events) >= len(fetch) and await settled(js)

        await wait_for(all_out, timeout=60, interval=0.1)
    finally:
        dispatcher.stop()
        await asyncio.wait_for(dispatching, 30)

    wanted = {outcome_id(e.get_id(), EventType.CLEANUP_COMPLETED): e for e in fetch}
    ends = {
        wanted[e.get_id()].get_id(): parse_payload(e, CleanupCompleted).outcome
        for e in emitter.events
    }
    assert len(ends) == len(emitter.events) == len(fetch), "one outcome per due event"
    # PostgreSQL compares the key exactly: in capitals it names no rows.
    capitals = Outcome.KEPT if database.kind == "mysql" else Outcome.ALREADY_GONE
    assert ends == {
        forged[0].get_id(): Outcome.KEPT,
        real.get_id(): Outcome.DELETED,
        forged[1].get_id(): Outcome.KEPT,
        forged[2].get_id(): capitals,
    }
    # Each forgery in a transaction of its own, the real run in one of them or alone (the
    # coalescing front takes them in the order their proofs came back): never the same KFP
    # run twice in one transaction, in capitals or not.
    folded = [[key.casefold() for key in batch] for batch in rows.batches]
    assert all(len(set(batch)) == len(batch) for batch in folded), rows.batches
    assert sum(running_id in batch for batch in folded) == len(forged), rows.batches
    assert sorted(key for batch in rows.batches for key in batch) == sorted(
        [running_id, running_id, running_id.upper(), finished_id]
    ), rows.batches
    async with engine.connect() as conn:
        assert await kfp.kfp_counts(conn, running_id) == FULL
        assert await kfp.kfp_counts(conn, finished_id) == dict.fromkeys(kfp.KFP_TABLES, 0)
