"""Argo Workflows' archive tables, as persist/sqldb/migrate.go leaves them, for tests.

`argo_archived_workflows` (primary key clustername, uid), `argo_archived_workflows_labels`
(foreign key to it, ON DELETE CASCADE) and the offloaded node status table `argo_workflows`
(primary key clustername, uid, version). `workflow`/`nodes` are JSON (JSONB for the
archive's workflow on PostgreSQL), as after Argo's latest migrations.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import (
    JSON,
    TIMESTAMP,
    Column,
    ForeignKeyConstraint,
    Index,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    func,
    insert,
    select,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

ARGO_TABLES: Final = ("argo_archived_workflows", "argo_archived_workflows_labels", "argo_workflows")

metadata = MetaData()


def _now() -> Any:
    return func.current_timestamp()


archived = Table(
    "argo_archived_workflows",
    metadata,
    Column("clustername", String(64), nullable=False),
    Column("uid", String(128), nullable=False),
    Column("name", String(256), nullable=False),
    Column("phase", String(25), nullable=False),
    Column("namespace", String(256), nullable=False),
    Column("workflow", JSON().with_variant(JSONB(), "postgresql"), nullable=False),
    Column("startedat", TIMESTAMP, nullable=False, server_default=_now()),
    Column("finishedat", TIMESTAMP, nullable=False, server_default=_now()),
    Column("instanceid", String(64), nullable=False),
    Column("creationtimestamp", TIMESTAMP, nullable=False, server_default=_now()),
    PrimaryKeyConstraint("clustername", "uid"),
    Index("argo_archived_workflows_i2", "clustername", "instanceid", "finishedat"),
)

labels = Table(
    "argo_archived_workflows_labels",
    metadata,
    Column("clustername", String(64), nullable=False),
    Column("uid", String(128), nullable=False),
    Column("name", String(317), nullable=False),
    Column("value", String(63), nullable=False),
    PrimaryKeyConstraint("clustername", "uid", "name"),
    ForeignKeyConstraint(
        ["clustername", "uid"],
        ["argo_archived_workflows.clustername", "argo_archived_workflows.uid"],
        ondelete="CASCADE",
    ),
    Index("argo_archived_workflows_labels_i1", "name", "value"),
)

offloaded = Table(
    "argo_workflows",
    metadata,
    Column("clustername", String(64), nullable=False),
    Column("uid", String(128), nullable=False),
    Column("namespace", String(256), nullable=False),
    Column("version", String(64), nullable=False),
    Column("nodes", JSON, nullable=False),
    Column("updatedat", TIMESTAMP, nullable=False, server_default=_now()),
    PrimaryKeyConstraint("clustername", "uid", "version"),
    Index("argo_workflows_i1", "clustername", "namespace", "updatedat"),
)


async def create_argo_tables(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)


async def drop_argo_tables(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(metadata.drop_all)


async def insert_archived(
    conn: AsyncConnection,
    uid: str,
    *,
    cluster: str = "default",
    name: str = "wf",
    namespace: str = "team-a",
    label_count: int = 2,
    node_versions: int = 1,
) -> None:
    """One archived workflow with its label rows and offloaded node status versions."""
    await conn.execute(
        insert(archived),
        {
            "clustername": cluster,
            "uid": uid,
            "name": name,
            "phase": "Succeeded",
            "namespace": namespace,
            "workflow": {"metadata": {"name": name, "uid": uid}},
            "instanceid": "",
        },
    )
    if label_count:
        await conn.execute(
            insert(labels),
            [
                {"clustername": cluster, "uid": uid, "name": f"l{i}", "value": "v"}
                for i in range(label_count)
            ],
        )
    if node_versions:
        await conn.execute(
            insert(offloaded),
            [
                {
                    "clustername": cluster,
                    "uid": uid,
                    "namespace": namespace,
                    "version": f"fnv:{i}",
                    "nodes": {},
                }
                for i in range(node_versions)
            ],
        )


async def argo_counts(conn: AsyncConnection, uid: str, cluster: str = "default") -> dict[str, int]:
    counts = {}
    for table in (archived, labels, offloaded):
        counts[table.name] = (
            await conn.execute(
                select(func.count())
                .select_from(table)
                .where(table.c.clustername == cluster, table.c.uid == uid)
            )
        ).scalar_one()
    return counts
