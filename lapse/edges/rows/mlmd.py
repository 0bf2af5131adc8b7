"""ML Metadata's tables: bound at start-up, a run's graph read with its context locked, and
its footprint deleted in MLMD's dependency order (the decision is functions/row_reaper/mlmd.py).

MLMD's schema (as its own library creates it, schema version 10) has no foreign keys, so
nothing cascades: every row is deleted here, counted per table.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Table, delete, or_, select, true
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement

from lapse.functions.row_reaper.mlmd import (
    CONTEXT_TYPE_KIND,
    DELETE_ORDER,
    PIPELINE_RUN_CONTEXT_TYPE,
    Footprint,
    MlmdArtifact,
    MlmdExecution,
    MlmdRun,
)

# Every table and the columns lapse reads or matches on.
COLUMNS: Final = {
    "Type": ("id", "name", "type_kind"),
    "Context": ("id", "type_id", "name", "last_update_time_since_epoch"),
    "ContextProperty": ("context_id",),
    "ParentContext": ("context_id", "parent_context_id"),
    "Association": ("context_id", "execution_id"),
    "Attribution": ("context_id", "artifact_id"),
    "Execution": ("id", "last_known_state", "last_update_time_since_epoch"),
    "ExecutionProperty": ("execution_id",),
    "Event": ("id", "artifact_id", "execution_id"),
    "EventPath": ("event_id",),
    "Artifact": ("id", "uri"),
    "ArtifactProperty": ("artifact_id",),
}


@dataclass(frozen=True)
class MlmdTables:
    """MLMD's tables as reflected, by MLMD's own names."""

    tables: dict[str, Table]

    def __getitem__(self, name: str) -> Table:
        return self.tables[name]

    def c(self, table: str, column: str) -> Any:
        return self.tables[table].c[column]


async def read_run(
    conn: AsyncConnection, t: MlmdTables, run_id: str, *, lock: bool
) -> MlmdRun | None:
    """The run's graph, its context row locked (outside a dry run); None when MLMD has no
    `system.PipelineRun` context of that name."""
    type_id = (
        await conn.execute(
            select(t.c("Type", "id")).where(
                t.c("Type", "name") == PIPELINE_RUN_CONTEXT_TYPE,
                t.c("Type", "type_kind") == CONTEXT_TYPE_KIND,
            )
        )
    ).scalar()
    if type_id is None:
        return None
    query = select(t.c("Context", "id"), t.c("Context", "last_update_time_since_epoch")).where(
        t.c("Context", "type_id") == type_id, t.c("Context", "name") == run_id
    )
    row = (await conn.execute(query.with_for_update() if lock else query)).first()
    if row is None:
        return None
    context_id, context_updated = int(row[0]), int(row[1] or 0)
    run_contexts = select(t.c("Context", "id")).where(t.c("Context", "type_id") == type_id)

    association = t["Association"]
    execution = t["Execution"]
    executions = (
        await conn.execute(
            select(
                execution.c.id,
                execution.c.last_known_state,
                execution.c.last_update_time_since_epoch,
            )
            .join(association, association.c.execution_id == execution.c.id)
            .where(association.c.context_id == context_id)
        )
    ).all()
    execution_ids = [int(e[0]) for e in executions]
    other_runs_of = await _other_runs(
        conn,
        association.c.execution_id,
        association.c.context_id,
        execution_ids,
        context_id,
        run_contexts,
    )

    attribution = t["Attribution"]
    event = t["Event"]
    artifact_ids = set(
        (
            await conn.execute(
                select(attribution.c.artifact_id).where(attribution.c.context_id == context_id)
            )
        ).scalars()
    )
    if execution_ids:
        artifact_ids |= set(
            (
                await conn.execute(
                    select(event.c.artifact_id).where(event.c.execution_id.in_(execution_ids))
                )
            ).scalars()
        )
    artifacts: list[MlmdArtifact] = []
    if artifact_ids:
        wanted = sorted(int(a) for a in artifact_ids)
        uris = dict(
            (
                await conn.execute(
                    select(t.c("Artifact", "id"), t.c("Artifact", "uri")).where(
                        t.c("Artifact", "id").in_(wanted)
                    )
                )
            )
            .tuples()
            .all()
        )
        attributed = await _other_runs(
            conn,
            attribution.c.artifact_id,
            attribution.c.context_id,
            wanted,
            context_id,
            run_contexts,
        )
        read_by: dict[int, set[int]] = defaultdict(set)
        outside = event.c.execution_id.not_in(execution_ids) if execution_ids else true()
        for artifact_id, other in await conn.execute(
            select(event.c.artifact_id, event.c.execution_id).where(
                event.c.artifact_id.in_(wanted), outside
            )
        ):
            read_by[int(artifact_id)].add(int(other))
        artifacts = [
            MlmdArtifact(
                a,
                uris.get(a),
                frozenset(attributed[a]),
                frozenset(read_by[a]),
            )
            for a in wanted
            if a in uris
        ]
    return MlmdRun(
        run_id,
        context_id,
        context_updated,
        tuple(
            MlmdExecution(
                int(e[0]),
                None if e[1] is None else int(e[1]),
                int(e[2] or 0),
                frozenset(other_runs_of[int(e[0])]),
            )
            for e in executions
        ),
        tuple(artifacts),
    )


async def _other_runs(
    conn: AsyncConnection,
    member: Any,
    context: Any,
    ids: list[int],
    context_id: int,
    run_contexts: Any,
) -> dict[int, set[int]]:
    """For each of `ids` (executions in Association, artifacts in Attribution), the other
    `system.PipelineRun` contexts it is linked to."""
    linked: dict[int, set[int]] = defaultdict(set)
    if not ids:
        return linked
    query = select(member, context).where(
        member.in_(ids), context != context_id, context.in_(run_contexts)
    )
    for id_, other in await conn.execute(query):
        linked[int(id_)].add(int(other))
    return linked


async def delete_footprint(
    conn: AsyncConnection, t: MlmdTables, fp: Footprint
) -> list[tuple[str, int]]:
    """Delete the footprint's rows, children first; (table, rows) in `DELETE_ORDER`."""
    executions, artifacts, context = list(fp.executions), list(fp.artifacts), fp.context_id
    event = t["Event"]
    touching: list[ColumnElement[bool]] = []
    if executions:
        touching.append(event.c.execution_id.in_(executions))
    if artifacts:
        touching.append(event.c.artifact_id.in_(artifacts))
    events = (
        sorted((await conn.execute(select(event.c.id).where(or_(*touching)))).scalars())
        if touching
        else []
    )

    def any_of(column: Any, values: list[Any]) -> ColumnElement[bool] | None:
        return column.in_(values) if values else None

    conditions: dict[str, list[ColumnElement[bool] | None]] = {
        "EventPath": [any_of(t.c("EventPath", "event_id"), events)],
        "Event": [any_of(event.c.id, events)],
        "Association": [
            t.c("Association", "context_id") == context,
            any_of(t.c("Association", "execution_id"), executions),
        ],
        "Attribution": [
            t.c("Attribution", "context_id") == context,
            any_of(t.c("Attribution", "artifact_id"), artifacts),
        ],
        "ParentContext": [
            t.c("ParentContext", "context_id") == context,
            t.c("ParentContext", "parent_context_id") == context,
        ],
        "ExecutionProperty": [any_of(t.c("ExecutionProperty", "execution_id"), executions)],
        "Execution": [any_of(t.c("Execution", "id"), executions)],
        "ArtifactProperty": [any_of(t.c("ArtifactProperty", "artifact_id"), artifacts)],
        "Artifact": [any_of(t.c("Artifact", "id"), artifacts)],
        "ContextProperty": [t.c("ContextProperty", "context_id") == context],
        "Context": [t.c("Context", "id") == context],
    }
    counts: list[tuple[str, int]] = []
    for name in DELETE_ORDER:
        where = [c for c in conditions[name] if c is not None]
        rows = 0
        if where:
            result = await conn.execute(delete(t[name]).where(or_(*where)))
            rows = int(result.rowcount)
        counts.append((name, rows))
    return counts
