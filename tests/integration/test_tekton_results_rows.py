"""The `tekton_results` target on real PostgreSQL (the database Tekton Results supports),
its tables built from Results' own GORM models (tests/tekton_results_schema.py)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from lapse.edges.database import create_engine
from lapse.events.types import Outcome
from lapse.functions.row_reaper.targets import tekton_results_target
from tests import tekton_results_schema as results
from tests.integration.test_row_reaper import completed, due, reaper
from tests.stack import Database

pytestmark = pytest.mark.db
ENDED = datetime(2025, 12, 31, 23, 0, tzinfo=UTC)


@pytest.fixture
async def engine(postgres: Database) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(postgres.url)
    await results.create_tables(engine)
    yield engine
    await results.drop_tables(engine)
    await engine.dispose()


async def test_a_runs_result_and_records_go_and_only_those(engine: AsyncEngine) -> None:
    gone, kept = str(uuid.uuid4()), str(uuid.uuid4())
    async with engine.begin() as conn:
        await results.insert_pipelinerun(conn, "team-a", gone, ended=ENDED, taskruns=2)
        await results.insert_pipelinerun(conn, "team-a", kept, ended=ENDED, taskruns=1)
    handler, _ = await reaper(engine, [tekton_results_target()])

    result = completed((await handler.handle(due(uid=gone, finished_at=ENDED)))[0])

    assert result.outcome is Outcome.DELETED, result
    # Records first (the PipelineRun's, two TaskRuns', its log), then the Result.
    assert result.detail == "tekton_results: records=4, results=1"
    async with engine.connect() as conn:
        assert await results.counts(conn, gone) == {"results": 0, "records": 0}
        assert await results.counts(conn, kept) == {"results": 1, "records": 3}
    again = completed((await handler.handle(due(uid=gone, finished_at=ENDED)))[0])
    assert again.outcome is Outcome.ALREADY_GONE


async def test_a_result_whose_summary_has_not_ended_keeps_every_row(engine: AsyncEngine) -> None:
    running, later = str(uuid.uuid4()), str(uuid.uuid4())
    async with engine.begin() as conn:
        await results.insert_pipelinerun(conn, "team-a", running, ended=None)
        # Results says it ended an hour after the time lapse planned from: moved, not deleted.
        await results.insert_pipelinerun(
            conn, "team-a", later, ended=datetime.now(UTC) + timedelta(hours=1)
        )
    handler, _ = await reaper(engine, [tekton_results_target()])

    kept = completed((await handler.handle(due(uid=running, finished_at=ENDED)))[0])
    moved = completed((await handler.handle(due(uid=later, finished_at=ENDED)))[0])

    assert kept.outcome is Outcome.KEPT, kept
    assert moved.outcome is Outcome.RESCHEDULED, moved
    async with engine.connect() as conn:
        assert await results.counts(conn, running) == {"results": 1, "records": 4}
        assert await results.counts(conn, later) == {"results": 1, "records": 4}
