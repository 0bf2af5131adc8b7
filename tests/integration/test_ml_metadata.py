"""The `ml_metadata` target on real MariaDB, with ML Metadata's own library writing the
schema and the records (ml-metadata 1.17.1 in the test-only venv of
scripts/build-mlmd-venv.sh, driven by tests/mlmd_writer.py as KFP's driver and launcher
write them), and reading them back after lapse deleted a run.

MLMD lives in its own database beside lapse's (KFP's `metadb` beside `mlpipeline`), named
by `database.targets.ml_metadata.database`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js import JetStreamContext
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from lapse.edges.artifacts import NatsCaptures
from lapse.edges.database import create_engine
from lapse.edges.rows import open_row_store
from lapse.embedded.nats import EmbeddedNats
from lapse.events.types import Outcome
from lapse.functions.artifact_reaper.capture import CapturedItem, KeptItem, RunCapture
from lapse.functions.artifact_reaper.metadata import CaptureMetadata
from lapse.functions.artifact_reaper.stores import ArtifactsConfig, ArtifactStore
from lapse.functions.ports import RetryLater
from lapse.functions.row_reaper.mlmd import DELETE_ORDER, run_only_artifact_uris
from lapse.functions.row_reaper.targets import kfp_target, mlmd_target
from tests import kfp_schema as kfp
from tests.integration.test_row_reaper import Backed, ListEmitter, completed, due, reaper
from tests.stack import Database

pytestmark = pytest.mark.db
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def mlmd_python() -> str:
    """The test-only venv's python (built once, cached under ~/.cache/lapse/mlmd-venv)."""
    # This interpreter is CPython 3.11 (lapse's own), unless PYTHON311 names another.
    env = {"PYTHON311": sys.executable, **os.environ}
    built = subprocess.run(
        ["bash", str(ROOT / "scripts/build-mlmd-venv.sh")],
        capture_output=True, text=True, timeout=600, check=True, env=env,
    )  # fmt: skip
    return built.stdout.strip().splitlines()[-1]


class Mlmd:
    """ML Metadata's library on one database, through the writer process."""

    def __init__(self, python: str, url: str, database: str) -> None:
        parsed = make_url(url)
        self.python = python
        self.database = database
        self.mysql = {
            "host": parsed.host,
            "port": parsed.port or 3306,
            "database": database,
            "user": parsed.username,
            "password": parsed.password,
        }

    async def call(self, request: dict[str, Any]) -> Any:
        done = await asyncio.to_thread(
            subprocess.run,
            [self.python, str(ROOT / "tests/mlmd_writer.py")],
            input=json.dumps({"mysql": self.mysql, **request}),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    async def write(self, *runs: dict[str, Any]) -> Any:
        return await self.call({"runs": list(runs)})

    async def read(self, *run_ids: str) -> Any:
        return await self.call({"query": True, "run_ids": list(run_ids)})


@pytest.fixture
async def engine(mysql: Database) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(mysql.url)
    yield engine
    await engine.dispose()


@pytest.fixture
async def mlmd(engine: AsyncEngine, mysql: Database, mlmd_python: str) -> AsyncIterator[Mlmd]:
    """A fresh MLMD database beside lapse's, on the same server (KFP's metadb)."""
    name = f"metadb_{uuid.uuid4().hex[:8]}"
    async with engine.connect() as conn:
        await conn.execute(text(f"CREATE DATABASE {name}"))
    yield Mlmd(mlmd_python, mysql.url, name)
    async with engine.connect() as conn:
        await conn.execute(text(f"DROP DATABASE {name}"))


Vouch = Callable[..., Awaitable[None]]


@pytest.fixture
async def vouch(engine: AsyncEngine) -> AsyncIterator[Vouch]:
    """KFP's run tables beside MLMD, and a run's rows in them: MLMD's run id counts only
    where KFP's own record names the run a run of the run's namespace (team-a)."""
    await kfp.create_kfp_tables(engine)

    async def insert(*run_ids: str) -> None:
        async with engine.begin() as conn:
            await kfp.insert_kfp_runs(conn, run_ids)

    yield insert
    await kfp.drop_kfp_tables(engine)


def uri(run: str, name: str) -> str:
    return f"s3://mlpipeline/v2/artifacts/demo/{run}/{name}"


def runs(a: str, b: str) -> list[dict[str, Any]]:
    """Run `a` trains a model and evaluates it; run `b` is the same pipeline with `train`
    cached (KFP reuses a's model artifact: an OUTPUT event of b's cached execution, and an
    attribution to b's context) and evaluates it again."""
    return [
        {
            "run_id": a,
            "pipeline": "demo",
            "executions": [
                {
                    "name": "train",
                    "state": "COMPLETE",
                    "outputs": [
                        {"label": "model", "uri": uri(a, "model")},
                        {"label": "train-log", "uri": uri(a, "log")},
                    ],
                },
                {
                    "name": "eval",
                    "state": "COMPLETE",
                    "inputs": ["model"],
                    "outputs": [{"label": "a-metrics", "uri": uri(a, "metrics")}],
                },
            ],
        },
        {
            "run_id": b,
            "pipeline": "demo",
            "executions": [
                {"name": "train", "state": "CACHED", "outputs": [{"label": "model"}]},
                {
                    "name": "eval",
                    "state": "COMPLETE",
                    "inputs": ["model"],
                    "outputs": [{"label": "b-metrics", "uri": uri(b, "metrics")}],
                },
            ],
        },
    ]


async def table_counts(engine: AsyncEngine, database: str) -> dict[str, int]:
    async with engine.connect() as conn:
        return {
            name: (
                await conn.execute(select(func.count()).select_from(text(f"{database}.{name}")))
            ).scalar_one()
            for name in DELETE_ORDER
        }


async def test_a_runs_footprint_goes_and_a_cached_artifact_stays(
    engine: AsyncEngine, mlmd: Mlmd, vouch: Vouch
) -> None:
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    await mlmd.write(*runs(a, b))
    await vouch(a, b)
    target = mlmd_target(mlmd.database)
    store = await open_row_store(engine, [target])
    assert store.schemas == {"ml_metadata": "ML Metadata schema version 10"}

    # The seam for object storage: a's artifacts that are a's alone (not the cached model).
    graph = await store.mlmd_graph(a)
    assert graph is not None
    assert run_only_artifact_uris(graph) == sorted([uri(a, "log"), uri(a, "metrics")])

    before = await table_counts(engine, mlmd.database)
    handler, _ = await reaper(engine, [kfp_target(), target])
    result = completed((await handler.handle(due(kfp_run_id=a)))[0])

    assert result.outcome is Outcome.DELETED, result
    # Children first, in MLMD's dependency order, each table counted.
    assert result.detail is not None
    parts = result.detail.partition("; ml_metadata: ")[2].split(", ")
    assert [part.split("=")[0] for part in parts] == list(DELETE_ORDER)
    after = await table_counts(engine, mlmd.database)
    gone = {name: before[name] - after[name] for name in DELETE_ORDER}
    # a: 2 executions, 2 artifacts of its own (log, metrics), 4 events (train: 2 outputs,
    # eval: 1 input + 1 output), their paths (outputs only), the run context; the model
    # stays (b's), and so do b's rows and the pipeline's context.
    assert gone["Execution"] == 2 and gone["Artifact"] == 2 and gone["Event"] == 4
    assert gone["Context"] == 1 and gone["ParentContext"] == 1
    assert gone["Association"] == 4  # each execution with the run and the pipeline context
    # log and metrics x (run, pipeline), and the model's to a; the model's attributions to
    # b and to the pipeline stay with it.
    assert gone["Attribution"] == 5
    read = await mlmd.read(a, b)
    assert read["runs"][a] is None
    assert read["runs"][b] == {
        "executions": 2,
        "artifacts": sorted([uri(a, "model"), uri(b, "metrics")]),
        "events": 3,
    }
    assert read["artifacts"] == sorted([uri(a, "model"), uri(b, "metrics")])
    assert read["pipelines"] == ["demo"]

    # Once b goes too, nothing uses the model any more: it goes with b.
    result = completed((await handler.handle(due(kfp_run_id=b)))[0])
    assert result.outcome is Outcome.DELETED
    read = await mlmd.read(a, b)
    assert read["runs"] == {a: None, b: None} and read["artifacts"] == []
    assert read["pipelines"] == ["demo"]
    left = await table_counts(engine, mlmd.database)
    assert {name: left[name] for name in ("Event", "EventPath", "Execution", "Artifact")} == {
        "Event": 0, "EventPath": 0, "Execution": 0, "Artifact": 0,
    }  # fmt: skip

    # A third delivery finds nothing: already gone.
    again = completed((await handler.handle(due(kfp_run_id=a)))[0])
    assert again.outcome is Outcome.ALREADY_GONE


async def test_a_run_mlmd_says_is_running_keeps_every_row(
    engine: AsyncEngine, mlmd: Mlmd, vouch: Vouch
) -> None:
    run = str(uuid.uuid4())
    await vouch(run)
    await mlmd.write(
        {
            "run_id": run,
            "pipeline": "demo",
            "executions": [
                {
                    "name": "train",
                    "state": "RUNNING",
                    "outputs": [{"label": "m", "uri": uri(run, "m")}],
                }
            ],
        }
    )
    before = await table_counts(engine, mlmd.database)
    handler, _ = await reaper(engine, [kfp_target(), mlmd_target(mlmd.database)])
    result = completed((await handler.handle(due(kfp_run_id=run)))[0])
    assert result.outcome is Outcome.KEPT, result
    assert "RUNNING" in (result.detail or ""), result
    assert await table_counts(engine, mlmd.database) == before


async def test_kfp_rows_and_ml_metadata_go_in_one_due_event(
    engine: AsyncEngine, mlmd: Mlmd
) -> None:
    """KFP's database (database.url) and MLMD's beside it on the same server: one due event,
    one transaction, both footprints."""
    run = str(uuid.uuid4())
    await kfp.create_kfp_tables(engine)
    try:
        async with engine.begin() as conn:
            await kfp.insert_kfp_runs(conn, [run])
        await mlmd.write(runs(run, str(uuid.uuid4()))[0])
        handler, _ = await reaper(engine, [kfp_target(), mlmd_target(mlmd.database)])

        result = completed((await handler.handle(due(kfp_run_id=run)))[0])

        assert result.outcome is Outcome.DELETED, result
        assert result.detail is not None
        assert result.detail.startswith(
            "kfp: run_metrics=2, tasks=2, resource_references=2, run_details=1; ml_metadata: "
        ), result.detail
        async with engine.connect() as conn:
            assert await kfp.kfp_counts(conn, run) == dict.fromkeys(kfp.KFP_TABLES, 0)
        assert (await mlmd.read(run))["runs"][run] is None
    finally:
        await kfp.drop_kfp_tables(engine)


# --- ML Metadata's account of the run's artifacts, into the artifacts target's capture ---


def kfp_store() -> ArtifactsConfig:
    """The store KFP's pipeline root is in (`uri()`'s bucket and root)."""
    store = ArtifactStore(name="kfp", url="s3://mlpipeline/v2/artifacts/", min_prefix_depth=3)
    return ArtifactsConfig(stores=(store,))


def item(key: str) -> CapturedItem:
    return CapturedItem(store="kfp", key=key, tree=False)


async def test_the_runs_artifact_account_goes_into_its_capture_before_its_rows(
    engine: AsyncEngine, mlmd: Mlmd, lapse_streams: JetStreamContext, vouch: Vouch
) -> None:
    """The row-reaper, deleting run a's MLMD rows, records which of a's URIs were a's alone
    and which b still uses into a's capture (NATS key-value bucket, as the planner stored
    it): after the transaction nothing says so any more."""
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    written = await mlmd.write(*runs(a, b))
    await vouch(a, b)
    captures = NatsCaptures(lapse_streams)
    uid = str(uuid.uuid4())
    await captures.put(RunCapture(uid=uid))  # what the planner captured of a
    store = await open_row_store(engine, [kfp_target(), mlmd_target(mlmd.database)])
    handler = Backed(store, ListEmitter(), metadata=CaptureMetadata(captures, kfp_store()))

    result = completed((await handler.handle(due(kfp_run_id=a, uid=uid)))[0])

    assert result.outcome is Outcome.DELETED, result
    captured = await captures.get(uid)
    assert captured is not None and captured.metadata is not None
    assert captured.all_items == (
        item(f"v2/artifacts/demo/{a}/log"),
        item(f"v2/artifacts/demo/{a}/metrics"),
    )
    by = f"ML Metadata run context {written['contexts'][b]}"
    assert captured.kept == (KeptItem(item=item(f"v2/artifacts/demo/{a}/model"), by=(by,)),)
    # The model is b's now: no other capture may take it meanwhile.
    assert await captures.sharers(item(f"v2/artifacts/demo/{a}/model"), "another") == (uid,)


async def test_an_account_that_cannot_be_recorded_keeps_every_row(
    engine: AsyncEngine, mlmd: Mlmd, nats_server: EmbeddedNats, vouch: Vouch
) -> None:
    """NATS unreachable while the account is recorded (its connection closed under the
    captures): the transaction commits nothing, the row-reaper waits (RetryLater)."""
    a, b = str(uuid.uuid4()), str(uuid.uuid4())
    await mlmd.write(*runs(a, b))
    await vouch(a, b)
    nc = await nats.connect(nats_server.url)
    captures = NatsCaptures(nc.jetstream())
    await nc.close()
    before = await table_counts(engine, mlmd.database)
    store = await open_row_store(engine, [kfp_target(), mlmd_target(mlmd.database)])
    handler = Backed(store, ListEmitter(), metadata=CaptureMetadata(captures, kfp_store()))

    with pytest.raises(RetryLater, match="artifact captures"):
        await handler.handle(due(kfp_run_id=a))

    assert await table_counts(engine, mlmd.database) == before
