"""Tekton Results' tables as its API server creates them (GORM AutoMigrate of
tektoncd/results pkg/api/server/db/model.go: Result, Record), on PostgreSQL, and the rows
its watcher writes for a run (pkg/watcher/results: a Result named by the top-level run's
uid, in a parent named by its namespace; one Record per object, named by the object's uid;
log and event-list records in the same Result)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Column,
    DateTime,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    func,
    insert,
    select,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.schema import Table

metadata = MetaData()

results = Table(
    "results",
    metadata,
    Column("parent", String(64), primary_key=True),
    Column("id", String(64), primary_key=True),
    Column("name", String(64)),
    Column("annotations", JSONB),
    Column("created_time", DateTime(timezone=True), server_default=func.current_timestamp()),
    Column("updated_time", DateTime(timezone=True), server_default=func.current_timestamp()),
    # Summary RecordSummary `gorm:"embedded;embeddedPrefix:recordsummary_;"`
    Column("recordsummary_record", String(256)),
    Column("recordsummary_type", String(768)),
    Column("recordsummary_start_time", DateTime(timezone=True)),
    Column("recordsummary_end_time", DateTime(timezone=True)),
    Column("recordsummary_status", Integer),
    Column("recordsummary_annotations", JSONB),
    Column("etag", String(128)),
    Index("results_by_name", "parent", "name", unique=True),
)

records = Table(
    "records",
    metadata,
    Column("parent", String(64), primary_key=True),
    Column("result_id", String(64), primary_key=True),
    Column("result_name", String(64)),
    Column("id", String(64), primary_key=True),
    Column("name", String(64)),
    Column("type", String(768)),
    Column("data", LargeBinary().with_variant(JSONB, "postgresql")),
    Column("created_time", DateTime(timezone=True), server_default=func.current_timestamp()),
    Column("updated_time", DateTime(timezone=True), server_default=func.current_timestamp()),
    Column("etag", String(128)),
    Index("records_by_name", "parent", "result_name", "name"),
    ForeignKeyConstraint(
        ["parent", "result_id"],
        ["results.parent", "results.id"],
        ondelete="CASCADE",
        onupdate="CASCADE",
    ),
)


async def create_tables(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)


async def drop_tables(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(metadata.drop_all)


async def insert_pipelinerun(
    conn: AsyncConnection,
    namespace: str,
    uid: str,
    *,
    ended: datetime | None,
    taskruns: int = 2,
) -> None:
    """A PipelineRun's Result and its records: the PipelineRun's, each TaskRun's (named by
    its own uid, in the PipelineRun's Result), and one log record."""
    result_id = str(uuid.uuid4())
    await conn.execute(
        insert(results),
        {
            "parent": namespace,
            "id": result_id,
            "name": uid,
            "annotations": {},
            "recordsummary_record": f"{namespace}/results/{uid}/records/{uid}",
            "recordsummary_type": "tekton.dev/v1.PipelineRun",
            "recordsummary_end_time": ended,
            "recordsummary_status": 1 if ended else 0,
        },
    )
    rows: list[dict[str, Any]] = [
        {"name": uid, "type": "tekton.dev/v1.PipelineRun"},
        *({"name": str(uuid.uuid4()), "type": "tekton.dev/v1.TaskRun"} for _ in range(taskruns)),
        {"name": str(uuid.uuid4()), "type": "results.tekton.dev/v1alpha3.Log"},
    ]
    await conn.execute(
        insert(records),
        [
            {
                "parent": namespace,
                "result_id": result_id,
                "result_name": uid,
                "id": str(uuid.uuid4()),
                "data": {"kind": row["type"]},
                **row,
            }
            for row in rows
        ],
    )


async def counts(conn: AsyncConnection, uid: str) -> dict[str, int]:
    return {
        "results": (
            await conn.execute(
                select(func.count()).select_from(results).where(results.c.name == uid)
            )
        ).scalar_one(),
        "records": (
            await conn.execute(
                select(func.count()).select_from(records).where(records.c.result_name == uid)
            )
        ).scalar_one(),
    }
