"""Kubeflow Pipelines' run tables and the rows of finished runs, for tests and benchmarks.

The tables are defined once, in lapse.demo.kfp, with KFP's own names, keys, foreign keys
and per-database types; on PostgreSQL the names stay mixed case (gorm quotes them), as in a
real install. That definition is the main branch's models (backend/src/apiserver/model at
kubeflow/pipelines#13532). The 2.17 release's differ only in run_details, which lacks the
three columns #13532 added (`git diff 2.17.0 master -- backend/src/apiserver/model` touches
run.go alone, adding exactly those): `create_kfp_tables(engine, release="2.17")` builds
that schema by dropping them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

# One definition of KFP's tables: the demo's, which the tests create on MySQL/PostgreSQL.
from lapse.demo.kfp import (
    KFP_TABLES,
    metadata,
    resource_references,
    run_details,
    run_metrics,
    tasks,
)
from lapse.functions.row_reaper.targets import KFP_RUN_GC_COLUMNS

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
