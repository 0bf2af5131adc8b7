"""Kubeflow Pipelines' run tables in the demo's SQLite file, and the rows of a finished run.

Table and column names, keys and foreign keys are KFP's own (backend/src/apiserver/model:
run.go, task.go, resource_reference.go), so lapse's built-in `kfp` target reflects and
deletes them exactly as it would in a real installation. The types are SQLite's; only the
names and keys matter to lapse. SQLite leaves foreign keys unenforced unless each
connection asks: nothing relies on the cascades, because lapse deletes the children itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    ForeignKeyConstraint,
    MetaData,
    String,
    Table,
    Text,
    and_,
    func,
    insert,
    select,
)
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

KFP_TABLES: Final = ("run_details", "run_metrics", "tasks", "resource_references")
METRICS_PER_RUN: Final = 2
TASKS_PER_RUN: Final = 2
REFERENCES_PER_RUN: Final = 2  # the run's experiment and namespace
ROWS_PER_RUN: Final = 1 + METRICS_PER_RUN + TASKS_PER_RUN + REFERENCES_PER_RUN
FINISHED_AT: Final = 1_700_000_600

metadata = MetaData()


def _cascade_to_run(name: str) -> ForeignKeyConstraint:
    return ForeignKeyConstraint(
        ["RunUUID"], ["run_details.UUID"], name=name, ondelete="CASCADE", onupdate="CASCADE"
    )


run_details = Table(
    "run_details",
    metadata,
    Column("UUID", String(191), primary_key=True),
    Column("DisplayName", String(255), nullable=False),
    Column("Name", String(255), nullable=False),
    Column("Description", String(255), nullable=False),
    Column("Namespace", String(63), nullable=False),
    Column("ExperimentUUID", String(64), nullable=False),
    Column("JobUUID", String(255)),
    Column("StorageState", String(255), nullable=False),
    Column("ServiceAccount", String(255), nullable=False),
    Column("PipelineId", String(255), nullable=False),
    Column("PipelineVersionId", String(255)),
    Column("PipelineName", String(255), nullable=False),
    Column("PipelineSpecManifest", Text),
    Column("WorkflowSpecManifest", Text),
    Column("Parameters", Text),
    Column("RuntimeParameters", Text),
    Column("PipelineRoot", Text),
    Column("CreatedAtInSec", BigInteger, nullable=False),
    Column("ScheduledAtInSec", BigInteger, server_default="0"),
    Column("FinishedAtInSec", BigInteger, server_default="0"),
    Column("Conditions", String(125), nullable=False),
    Column("State", String(255)),
    Column("StateHistory", Text),
    Column("PluginsInput", Text),
    Column("PluginsOutput", Text),
    Column("PipelineRuntimeManifest", Text, nullable=False),
    Column("WorkflowRuntimeManifest", Text, nullable=False),
    Column("PipelineContextId", BigInteger, server_default="0"),
    Column("PipelineRunContextId", BigInteger, server_default="0"),
    Column("RetryGeneration", BigInteger, server_default="0"),
    Column("RetryClaimedAtInSec", BigInteger, server_default="0"),
    Column("ArchivedAtInSec", BigInteger, server_default="0"),
)

run_metrics = Table(
    "run_metrics",
    metadata,
    Column("RunUUID", String(191), primary_key=True),
    Column("NodeID", String(191), primary_key=True),
    Column("Name", String(191), primary_key=True),
    Column("NumberValue", Float),
    Column("Format", String(255)),
    Column("Payload", Text, nullable=False),
    _cascade_to_run("run_metrics_RunUUID_run_details_UUID_foreign"),
)

tasks = Table(
    "tasks",
    metadata,
    Column("UUID", String(191), primary_key=True),
    Column("Namespace", String(255), nullable=False),
    Column("PipelineName", String(255), nullable=False),
    Column("RunUUID", String(191), nullable=False),
    Column("PodName", String(255), nullable=False),
    Column("MLMDExecutionID", String(255), nullable=False),
    Column("CreatedTimestamp", BigInteger, nullable=False),
    Column("StartedTimestamp", BigInteger, server_default="0"),
    Column("FinishedTimestamp", BigInteger, server_default="0"),
    Column("Fingerprint", String(255), nullable=False),
    Column("Name", String(255)),
    Column("ParentTaskUUID", String(255)),
    Column("State", String(255)),
    Column("StateHistory", Text),
    Column("MLMDInputs", Text),
    Column("MLMDOutputs", Text),
    Column("ChildrenPods", Text),
    Column("Payload", Text),
    _cascade_to_run("tasks_RunUUID_run_details_UUID_foreign"),
)

# No foreign key, as in KFP (gorm:"-" on every owner): these rows must be deleted explicitly.
resource_references = Table(
    "resource_references",
    metadata,
    Column("ResourceUUID", String(191), primary_key=True),
    Column("ResourceType", String(255), primary_key=True),
    Column("ReferenceUUID", String(191), nullable=False),
    Column("ReferenceName", String(255), nullable=False),
    Column("ReferenceType", String(255), primary_key=True),
    Column("Relationship", String(255), nullable=False),
    Column("Payload", Text, nullable=False),
)


async def create_tables(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)


def run_rows(run_id: str, name: str, namespace: str) -> dict[str, list[dict[str, Any]]]:
    """The rows KFP keeps for one finished run, by table (parents first)."""
    experiment = f"exp-{run_id[:8]}"
    return {
        "run_details": [
            {
                "UUID": run_id,
                "DisplayName": name,
                "Name": name,
                "Description": "lapse demo run",
                "Namespace": namespace,
                "ExperimentUUID": experiment,
                "StorageState": "AVAILABLE",
                "ServiceAccount": "pipeline-runner",
                "PipelineId": "demo-pipeline",
                "PipelineName": "demo",
                "CreatedAtInSec": FINISHED_AT - 600,
                "FinishedAtInSec": FINISHED_AT,
                "Conditions": "Succeeded",
                "State": "SUCCEEDED",
                "PipelineRuntimeManifest": "{}",
                "WorkflowRuntimeManifest": "{}",
            }
        ],
        "run_metrics": [
            {
                "RunUUID": run_id,
                "NodeID": f"{name}-node-{i}",
                "Name": "accuracy",
                "NumberValue": 0.9,
                "Format": "RAW",
                "Payload": "{}",
            }
            for i in range(METRICS_PER_RUN)
        ],
        "tasks": [
            {
                "UUID": f"{run_id}-task-{i}",
                "Namespace": namespace,
                "PipelineName": "demo",
                "RunUUID": run_id,
                "PodName": f"{name}-pod-{i}",
                "MLMDExecutionID": str(i),
                "CreatedTimestamp": FINISHED_AT - 600,
                "Fingerprint": f"fp-{i}",
            }
            for i in range(TASKS_PER_RUN)
        ],
        "resource_references": [
            {
                "ResourceUUID": run_id,
                "ResourceType": "Run",
                "ReferenceUUID": reference,
                "ReferenceName": reference,
                "ReferenceType": kind,
                "Relationship": "Owner",
                "Payload": "{}",
            }
            for reference, kind in ((experiment, "Experiment"), (namespace, "Namespace"))
        ],
    }


async def insert_runs(engine: AsyncEngine, runs: Iterable[tuple[str, str]], namespace: str) -> int:
    """Insert the rows of each (run id, workflow name); returns how many rows were written."""
    batch: dict[str, list[dict[str, Any]]] = {name: [] for name in KFP_TABLES}
    for run_id, name in runs:
        for table, rows in run_rows(run_id, name, namespace).items():
            batch[table] += rows
    async with engine.begin() as conn:
        for table in KFP_TABLES:
            if batch[table]:
                await conn.execute(insert(metadata.tables[table]), batch[table])
    return sum(len(rows) for rows in batch.values())


def _belongs_to(table: str, run_id: str) -> ColumnElement[bool]:
    if table == "run_details":
        return run_details.c["UUID"] == run_id
    if table == "resource_references":
        refs = resource_references.c
        return and_(refs.ResourceUUID == run_id, refs.ResourceType == "Run")
    return metadata.tables[table].c.RunUUID == run_id


async def rows_left(engine: AsyncEngine, run_ids: Iterable[str]) -> dict[str, int]:
    """Rows still in any KFP table, per run id."""
    left: dict[str, int] = {}
    async with engine.connect() as conn:
        for run_id in run_ids:
            counts = [
                (
                    await conn.execute(
                        select(func.count())
                        .select_from(metadata.tables[table])
                        .where(_belongs_to(table, run_id))
                    )
                ).scalar_one()
                for table in KFP_TABLES
            ]
            left[run_id] = sum(counts)
    return left
