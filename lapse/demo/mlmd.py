"""ML Metadata's tables in the demo's SQLite file, and one KFP run's records in them.

MLMD's own library is not in lapse's environment (it pins an older protobuf: the tests run
it in a separate one, tests/mlmd_writer.py), so the demo creates MLMD's tables itself, as
MLMD's SQLite schema (version 10) has them, and writes the rows KFP's driver and launcher
would (kubeflow/pipelines backend/src/v2/metadata/client.go): the pipeline's
`system.Pipeline` context, the run's `system.PipelineRun` context named by the KFP run id
(its child), each execution associated with both and each output artifact attributed to
both, with an OUTPUT event (and its path) per artifact. lapse's `ml_metadata` target then
reflects and deletes them as it would in KFP's metadb.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    func,
    insert,
    select,
)
from sqlalchemy.ext.asyncio import AsyncEngine

SCHEMA_VERSION: Final = 10
# MLMD's Type.type_kind, Execution.State and Event.Type (metadata_store.proto).
EXECUTION_TYPE, ARTIFACT_TYPE, CONTEXT_TYPE = 0, 1, 2
COMPLETE: Final = 3
OUTPUT_EVENT: Final = 4
ARTIFACT_LIVE: Final = 2

metadata = MetaData()


def _properties(name: str, owner: str) -> Table:
    return Table(
        name,
        metadata,
        Column(owner, Integer, primary_key=True),
        Column("name", String(255), primary_key=True),
        Column("is_custom_property", Boolean, primary_key=True),
        Column("int_value", Integer),
        Column("double_value", Float),
        Column("string_value", Text),
        Column("byte_value", LargeBinary),
        Column("proto_value", LargeBinary),
        Column("bool_value", Boolean),
    )


def _node(name: str, *extra: Column[Any]) -> Table:
    return Table(
        name,
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("type_id", Integer, nullable=False),
        *extra,
        Column("name", String(255)),
        Column("external_id", String(255), unique=True),
        Column("create_time_since_epoch", BigInteger, nullable=False, server_default="0"),
        Column("last_update_time_since_epoch", BigInteger, nullable=False, server_default="0"),
    )


type_ = Table(
    "Type",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(255), nullable=False),
    Column("version", String(255)),
    Column("type_kind", Integer, nullable=False),
    Column("description", Text),
    Column("input_type", Text),
    Column("output_type", Text),
    Column("external_id", String(255), unique=True),
)
artifact = _node("Artifact", Column("uri", Text), Column("state", Integer))
execution = _node("Execution", Column("last_known_state", Integer))
context = _node("Context")
artifact_property = _properties("ArtifactProperty", "artifact_id")
execution_property = _properties("ExecutionProperty", "execution_id")
context_property = _properties("ContextProperty", "context_id")
parent_context = Table(
    "ParentContext",
    metadata,
    Column("context_id", Integer, primary_key=True),
    Column("parent_context_id", Integer, primary_key=True),
)
event = Table(
    "Event",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("artifact_id", Integer, nullable=False),
    Column("execution_id", Integer, nullable=False),
    Column("type", Integer, nullable=False),
    Column("milliseconds_since_epoch", BigInteger),
)
event_path = Table(
    "EventPath",
    metadata,
    Column("event_id", Integer, nullable=False),
    Column("is_index_step", Boolean, nullable=False),
    Column("step_index", Integer),
    Column("step_key", Text),
)
association = Table(
    "Association",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("context_id", Integer, nullable=False),
    Column("execution_id", Integer, nullable=False),
)
attribution = Table(
    "Attribution",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("context_id", Integer, nullable=False),
    Column("artifact_id", Integer, nullable=False),
)
mlmd_env = Table("MLMDEnv", metadata, Column("schema_version", Integer, primary_key=True))


@dataclass(frozen=True)
class Recorded:
    """The ids of one run's rows (beside the pipeline's own context, which stays)."""

    run_context: int
    pipeline_context: int
    executions: tuple[int, ...]
    artifacts: tuple[int, ...]
    events: tuple[int, ...]

    @property
    def rows(self) -> int:
        """Rows that are the run's: context, its property and parent link; per execution
        itself, a property and two associations; per artifact itself, a property, two
        attributions, its event and the event's path."""
        return 3 + 4 * len(self.executions) + 6 * len(self.artifacts)


async def create_tables(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
        if (await conn.execute(select(func.count()).select_from(mlmd_env))).scalar_one() == 0:
            await conn.execute(insert(mlmd_env), [{"schema_version": SCHEMA_VERSION}])


async def record_run(
    engine: AsyncEngine,
    *,
    run_id: str,
    pipeline: str,
    tasks: Sequence[tuple[str, Sequence[str]]],
    updated_ms: int,
) -> Recorded:
    """Write one finished KFP run: `tasks` are (task name, output artifact URIs)."""
    async with engine.begin() as conn:

        async def put(table: Table, row: dict[str, Any]) -> int:
            result = await conn.execute(insert(table).values(**row))
            key = result.inserted_primary_key
            return int(key[0]) if key else 0  # EventPath has no key

        async def type_id(name: str, kind: int) -> int:
            found = (
                await conn.execute(
                    select(type_.c.id).where(type_.c.name == name, type_.c.type_kind == kind)
                )
            ).scalar()
            return (
                int(found)
                if found is not None
                else await put(type_, {"name": name, "type_kind": kind})
            )

        stamps = {"create_time_since_epoch": updated_ms, "last_update_time_since_epoch": updated_ms}
        pipeline_type = await type_id("system.Pipeline", CONTEXT_TYPE)
        run_type = await type_id("system.PipelineRun", CONTEXT_TYPE)
        execution_type = await type_id("system.ContainerExecution", EXECUTION_TYPE)
        artifact_type = await type_id("system.Artifact", ARTIFACT_TYPE)
        pipeline_ctx = (
            await conn.execute(
                select(context.c.id).where(
                    context.c.type_id == pipeline_type, context.c.name == pipeline
                )
            )
        ).scalar()
        if pipeline_ctx is None:
            pipeline_ctx = await put(
                context, {"type_id": pipeline_type, "name": pipeline, **stamps}
            )
        run_ctx = await put(context, {"type_id": run_type, "name": run_id, **stamps})
        await put(
            context_property,
            {"context_id": run_ctx, "name": "namespace", "is_custom_property": True,
             "string_value": "lapse-demo"},
        )  # fmt: skip
        await put(parent_context, {"context_id": run_ctx, "parent_context_id": pipeline_ctx})
        executions, artifacts, events = [], [], []
        for task, uris in tasks:
            done = await put(
                execution,
                {"type_id": execution_type, "name": f"{run_id}-{task}",
                 "last_known_state": COMPLETE, **stamps},
            )  # fmt: skip
            executions.append(done)
            await put(
                execution_property,
                {"execution_id": done, "name": "task_name", "is_custom_property": True,
                 "string_value": task},
            )  # fmt: skip
            for ctx in (pipeline_ctx, run_ctx):
                await put(association, {"context_id": ctx, "execution_id": done})
            for uri in uris:
                made = await put(
                    artifact,
                    {"type_id": artifact_type, "uri": uri, "state": ARTIFACT_LIVE, **stamps},
                )
                artifacts.append(made)
                await put(
                    artifact_property,
                    {"artifact_id": made, "name": "display_name", "is_custom_property": True,
                     "string_value": uri.rsplit("/", 1)[-1]},
                )  # fmt: skip
                for ctx in (pipeline_ctx, run_ctx):
                    await put(attribution, {"context_id": ctx, "artifact_id": made})
                happened = await put(
                    event,
                    {"artifact_id": made, "execution_id": done, "type": OUTPUT_EVENT,
                     "milliseconds_since_epoch": updated_ms},
                )  # fmt: skip
                events.append(happened)
                await put(
                    event_path,
                    {"event_id": happened, "is_index_step": False,
                     "step_key": uri.rsplit("/", 1)[-1]},
                )  # fmt: skip
    return Recorded(
        int(run_ctx), int(pipeline_ctx), tuple(executions), tuple(artifacts), tuple(events)
    )


async def rows_left(engine: AsyncEngine, run: Recorded) -> dict[str, int]:
    """The run's MLMD rows still present, per table (the pipeline's context not counted)."""
    ctx, executions, artifacts, events = (
        run.run_context, run.executions, run.artifacts, run.events
    )  # fmt: skip
    queries = {
        "Context": select(func.count()).select_from(context).where(context.c.id == ctx),
        "ContextProperty": select(func.count())
        .select_from(context_property)
        .where(context_property.c.context_id == ctx),
        "ParentContext": select(func.count())
        .select_from(parent_context)
        .where(parent_context.c.context_id == ctx),
        "Execution": select(func.count())
        .select_from(execution)
        .where(execution.c.id.in_(executions)),
        "ExecutionProperty": select(func.count())
        .select_from(execution_property)
        .where(execution_property.c.execution_id.in_(executions)),
        "Association": select(func.count())
        .select_from(association)
        .where(association.c.execution_id.in_(executions)),
        "Artifact": select(func.count()).select_from(artifact).where(artifact.c.id.in_(artifacts)),
        "ArtifactProperty": select(func.count())
        .select_from(artifact_property)
        .where(artifact_property.c.artifact_id.in_(artifacts)),
        "Attribution": select(func.count())
        .select_from(attribution)
        .where(attribution.c.artifact_id.in_(artifacts)),
        "Event": select(func.count()).select_from(event).where(event.c.id.in_(events)),
        "EventPath": select(func.count())
        .select_from(event_path)
        .where(event_path.c.event_id.in_(events)),
    }
    async with engine.connect() as conn:
        left = {name: (await conn.execute(query)).scalar_one() for name, query in queries.items()}
    return {name: count for name, count in left.items() if count}


async def pipeline_context_present(engine: AsyncEngine, run: Recorded) -> bool:
    """The pipeline's context is shared by all its runs: it must outlive this one."""
    async with engine.connect() as conn:
        query = (
            select(func.count()).select_from(context).where(context.c.id == run.pipeline_context)
        )
        return bool((await conn.execute(query)).scalar_one())
