"""Kubeflow Pipelines' run tables in the demo's SQLite file, and the rows of a finished run.

Column names, primary keys, foreign keys (ON DELETE/UPDATE CASCADE) and sizes follow
backend/src/apiserver/model (run.go, task.go, resource_reference.go, pipeline_spec.go,
runtime_config.go) with KFP's gorm settings: strings without a size become VARCHAR(255) on
MySQL (DefaultStringSize) and TEXT on PostgreSQL; LargeText is LONGTEXT on MySQL and TEXT on
PostgreSQL. So lapse's built-in `kfp` target reflects and deletes them exactly as in a real
installation. The demo's own copy: the tests keep theirs (tests/kfp_schema.py, their account
of KFP, which they create on MySQL and PostgreSQL) and tests/e2e/test_demo.py checks that
this one still matches it. SQLite leaves
foreign keys unenforced unless each connection asks: nothing relies on the cascades,
because lapse deletes the children itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    ForeignKeyConstraint,
    Index,
    MetaData,
    String,
    Table,
    Text,
    and_,
    func,
    insert,
    select,
)
from sqlalchemy.dialects.mysql import LONGTEXT
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import TypeEngine

KFP_TABLES: Final = ("run_details", "run_metrics", "tasks", "resource_references")
METRICS_PER_RUN: Final = 2
TASKS_PER_RUN: Final = 2
REFERENCES_PER_RUN: Final = 2  # the run's experiment and namespace
ROWS_PER_RUN: Final = 1 + METRICS_PER_RUN + TASKS_PER_RUN + REFERENCES_PER_RUN
FINISHED_AT: Final = 1_700_000_600


def _string() -> TypeEngine[str]:
    return String(255).with_variant(Text(), "postgresql")


def _large_text() -> TypeEngine[str]:
    return Text().with_variant(LONGTEXT(), "mysql", "mariadb")


metadata = MetaData()

run_details = Table(
    "run_details",
    metadata,
    Column("UUID", String(191), primary_key=True),
    Column("DisplayName", _string(), nullable=False),
    Column("Name", _string(), nullable=False),
    Column("Description", _string(), nullable=False),
    Column("Namespace", String(63), nullable=False),
    Column("ExperimentUUID", String(64), nullable=False),
    Column("JobUUID", _string()),
    Column("StorageState", _string(), nullable=False),
    Column("ServiceAccount", _string(), nullable=False),
    # PipelineSpec (embedded)
    Column("PipelineId", _string(), nullable=False),
    Column("PipelineVersionId", _string()),
    Column("PipelineName", _string(), nullable=False),
    Column("PipelineSpecManifest", _large_text()),
    Column("WorkflowSpecManifest", _large_text()),
    Column("Parameters", _large_text()),
    Column("RuntimeParameters", _large_text()),
    Column("PipelineRoot", _large_text()),
    # RunDetails (embedded)
    Column("CreatedAtInSec", BigInteger, nullable=False),
    Column("ScheduledAtInSec", BigInteger, server_default="0"),
    Column("FinishedAtInSec", BigInteger, server_default="0"),
    Column("Conditions", String(125), nullable=False),
    Column("State", _string()),
    Column("StateHistory", _large_text()),
    Column("PluginsInput", _large_text()),
    Column("PluginsOutput", _large_text()),
    Column("PipelineRuntimeManifest", _large_text(), nullable=False),
    Column("WorkflowRuntimeManifest", _large_text(), nullable=False),
    Column("PipelineContextId", BigInteger, server_default="0"),
    Column("PipelineRunContextId", BigInteger, server_default="0"),
    Column("RetryGeneration", BigInteger, server_default="0"),
    Column("RetryClaimedAtInSec", BigInteger, server_default="0"),
    Column("ArchivedAtInSec", BigInteger, server_default="0"),
    Index("experimentuuid_createatinsec", "ExperimentUUID", "CreatedAtInSec"),
    Index("namespace_createatinsec", "Namespace", "CreatedAtInSec"),
)

run_metrics = Table(
    "run_metrics",
    metadata,
    Column("RunUUID", String(191), primary_key=True),
    Column("NodeID", String(191), primary_key=True),
    Column("Name", String(191), primary_key=True),
    Column("NumberValue", Float(53)),
    Column("Format", _string()),
    Column("Payload", _large_text(), nullable=False),
    ForeignKeyConstraint(
        ["RunUUID"],
        ["run_details.UUID"],
        name="run_metrics_RunUUID_run_details_UUID_foreign",
        ondelete="CASCADE",
        onupdate="CASCADE",
    ),
)

tasks = Table(
    "tasks",
    metadata,
    Column("UUID", String(191), primary_key=True),
    Column("Namespace", _string(), nullable=False),
    Column("PipelineName", _string(), nullable=False),
    Column("RunUUID", String(191), nullable=False),
    Column("PodName", _string(), nullable=False),
    Column("MLMDExecutionID", _string(), nullable=False),
    Column("CreatedTimestamp", BigInteger, nullable=False),
    Column("StartedTimestamp", BigInteger, server_default="0"),
    Column("FinishedTimestamp", BigInteger, server_default="0"),
    Column("Fingerprint", _string(), nullable=False),
    Column("Name", _string()),
    Column("ParentTaskUUID", _string()),
    Column("State", _string()),
    Column("StateHistory", _large_text()),
    Column("MLMDInputs", _large_text()),
    Column("MLMDOutputs", _large_text()),
    Column("ChildrenPods", _large_text()),
    Column("Payload", _large_text()),
    Index("tasks_RunUUID_run_details_UUID_foreign", "RunUUID"),
    ForeignKeyConstraint(
        ["RunUUID"],
        ["run_details.UUID"],
        name="tasks_RunUUID_run_details_UUID_foreign",
        ondelete="CASCADE",
        onupdate="CASCADE",
    ),
)

# No foreign key: KFP declares ResourceReferences with gorm:"-" on every owner model.
resource_references = Table(
    "resource_references",
    metadata,
    Column("ResourceUUID", String(191), primary_key=True),
    Column("ResourceType", _string(), primary_key=True),
    Column("ReferenceUUID", String(191), nullable=False),
    Column("ReferenceName", _string(), nullable=False),
    Column("ReferenceType", _string(), primary_key=True),
    Column("Relationship", _string(), nullable=False),
    Column("Payload", _large_text(), nullable=False),
    Index("referencefilter", "ResourceType", "ReferenceUUID", "ReferenceType"),
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
