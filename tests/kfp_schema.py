"""Kubeflow Pipelines' run tables and the rows of finished runs, for tests and benchmarks.

The tests' own account of KFP's schema, written from KFP's models (not imported from
lapse, whose demo keeps its own copy for `lapse demo`): the tests check lapse against KFP,
so the schema they create must not come from the code under test. Column names, primary
keys, foreign keys (ON DELETE/UPDATE CASCADE) and sizes follow backend/src/apiserver/model
(run.go, task.go, resource_reference.go, pipeline_spec.go, runtime_config.go) with KFP's
gorm settings: strings without a size become VARCHAR(255) on MySQL (DefaultStringSize) and
TEXT on PostgreSQL; LargeText is LONGTEXT on MySQL and TEXT on PostgreSQL. On PostgreSQL
the names stay mixed case (gorm quotes them), as in a real install.

That is the main branch's models (kubeflow/pipelines#13532). The 2.17 release's differ only
in run_details, which lacks the three columns #13532 added (`git diff 2.17.0 master --
backend/src/apiserver/model` touches run.go alone, adding exactly those):
`create_kfp_tables(engine, release="2.17")` builds that schema by dropping them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final, Literal

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
    func,
    insert,
    select,
)
from sqlalchemy.dialects.mysql import LONGTEXT
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.types import TypeEngine

KFP_TABLES: Final = ("run_details", "run_metrics", "tasks", "resource_references")
# run_details' columns kubeflow/pipelines#13532 added for KFP's own run GC (model/run.go):
# what a 2.17 schema lacks. Written here from KFP's diff, not taken from lapse's detector.
KFP_RUN_GC_COLUMNS: Final = ("ArchivedAtInSec", "RetryGeneration", "RetryClaimedAtInSec")


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


Release = Literal["2.17", "main"]
RELEASES: tuple[Release, ...] = ("2.17", "main")


async def create_kfp_tables(engine: AsyncEngine, release: Release = "main") -> None:
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        if release == "2.17":
            quote = conn.dialect.identifier_preparer.quote
            for column in KFP_RUN_GC_COLUMNS:
                await conn.exec_driver_sql(f"ALTER TABLE run_details DROP COLUMN {quote(column)}")


async def drop_kfp_tables(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(metadata.drop_all)


def kfp_rows(
    run_id: str, *, metrics: int = 2, tasks: int = 2, namespace: str = "team-a"
) -> dict[str, list[dict[str, Any]]]:
    """The rows KFP writes for one finished run, keyed by table (insert parents first)."""
    experiment = f"exp-{run_id[:8]}"
    return {
        "run_details": [
            {
                "UUID": run_id,
                "DisplayName": f"run {run_id[:8]}",
                "Name": f"pipeline-{run_id[:8]}",
                "Description": "",
                "Namespace": namespace,
                "ExperimentUUID": experiment,
                "StorageState": "AVAILABLE",
                "ServiceAccount": "pipeline-runner",
                "PipelineId": "p1",
                "PipelineName": "demo",
                "CreatedAtInSec": 1_700_000_000,
                "FinishedAtInSec": 1_700_000_600,
                "Conditions": "Succeeded",
                "State": "SUCCEEDED",
                "PipelineRuntimeManifest": "{}",
                "WorkflowRuntimeManifest": "{}",
            }
        ],
        "run_metrics": [
            {
                "RunUUID": run_id,
                "NodeID": f"node-{i}",
                "Name": "accuracy",
                "NumberValue": 0.9,
                "Format": "RAW",
                "Payload": "{}",
            }
            for i in range(metrics)
        ],
        "tasks": [
            {
                "UUID": f"{run_id}-t{i}",
                "Namespace": namespace,
                "PipelineName": "demo",
                "RunUUID": run_id,
                "PodName": f"pod-{i}",
                "MLMDExecutionID": str(i),
                "CreatedTimestamp": 1_700_000_000,
                "Fingerprint": "f",
            }
            for i in range(tasks)
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


async def insert_kfp_runs(
    conn: AsyncConnection,
    run_ids: Iterable[str],
    *,
    metrics: int = 2,
    tasks: int = 2,
    namespace: str = "team-a",
) -> None:
    """The runs' rows, each a run of `namespace` (run_details.Namespace: KFP's own record
    of whose run it is, which lapse holds a Workflow's label to)."""
    batch: dict[str, list[dict[str, Any]]] = {name: [] for name in KFP_TABLES}
    for run_id in run_ids:
        rows_of = kfp_rows(run_id, metrics=metrics, tasks=tasks, namespace=namespace)
        for name, rows in rows_of.items():
            batch[name] += rows
    for name in KFP_TABLES:  # parents first: the foreign keys are enforced
        if batch[name]:
            await conn.execute(insert(metadata.tables[name]), batch[name])


async def kfp_counts(conn: AsyncConnection, run_id: str) -> dict[str, int]:
    """Rows per KFP table that belong to `run_id` (resource_references: as the Run)."""
    conditions = {
        "run_details": run_details.c["UUID"] == run_id,
        "run_metrics": run_metrics.c.RunUUID == run_id,
        "tasks": tasks.c.RunUUID == run_id,
        "resource_references": (resource_references.c.ResourceUUID == run_id)
        & (resource_references.c.ResourceType == "Run"),
    }
    counts = {}
    for name, condition in conditions.items():
        table = metadata.tables[name]
        counts[name] = (
            await conn.execute(select(func.count()).select_from(table).where(condition))
        ).scalar_one()
    return counts


async def kfp_total(conn: AsyncConnection) -> dict[str, int]:
    """Rows per KFP table, all runs."""
    return {
        name: (
            await conn.execute(select(func.count()).select_from(metadata.tables[name]))
        ).scalar_one()
        for name in KFP_TABLES
    }
