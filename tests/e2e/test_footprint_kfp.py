"""A KFP v2 run's whole footprint, each part on its own clock, through `lapse up` (a
subprocess, as users run it) on real servers: the Workflow in a kube-apiserver, KFP's rows
(tests/kfp_schema.py) and ML Metadata's records (written by MLMD's own library,
tests/mlmd_writer.py) in MariaDB, its artifacts in a SeaweedFS S3 server.

Run `a` trains a model and evaluates it; run `b`, still running, is the same pipeline with
`train` cached: KFP reuses a's model (an OUTPUT event of b's cached execution and an
attribution to b's context). What lapse deletes of `a`:

- T1 (kubernetes, 2 s): the Workflow;
- T2 (database, 8 s): KFP's rows and a's ML Metadata records; in the same transaction the
  row-reaper records MLMD's account of a's artifacts into a's capture (the model is b's too);
- T3 (artifacts, 16 s): a's artifacts: what lies under its pipeline-root prefix (declared,
  `{label:pipeline-name}/{run_id}/`) and what only ML Metadata knows (a report outside that
  prefix), except the model, kept as `shared`.

None goes before its clock; objects planted beside the prefix (a sibling run id that starts
the same, b's own outputs, the same path outside the store's root) survive.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from lapse.edges.database import create_engine
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.seaweedfs import REGION, EmbeddedSeaweedFS
from tests.conftest import ARTIFACT_BUCKET, KubeStack, kube_stack
from tests.e2e.test_lapse_up import LapseUp, lapse_json
from tests.integration.test_artifact_reaper import client, plant, present
from tests.integration.test_ml_metadata import Mlmd, mlmd_python  # noqa: F401 (a fixture)
from tests.kfp_schema import create_kfp_tables, insert_kfp_runs, kfp_counts
from tests.stack import Database, scratch_database, wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats, pytest.mark.db]

KUBERNETES_TTL, DATABASE_TTL, ARTIFACTS_TTL = 2, 8, 16


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    with kube_stack(tmp_path_factory.mktemp("kube-footprint-kfp")) as stack:
        yield stack


@pytest.fixture
async def kfp_db() -> AsyncIterator[Database]:
    """KFP's `mlpipeline` on MariaDB; ML Metadata's `metadb` is created beside it."""
    async with scratch_database("mysql") as db:
        engine = create_engine(db.url)
        await create_kfp_tables(engine)
        await engine.dispose()
        yield db


@pytest.fixture
async def mlmd(kfp_db: Database, mlmd_python: str) -> AsyncIterator[Mlmd]:  # noqa: F811
    name = f"metadb_{uuid.uuid4().hex[:8]}"
    engine = create_engine(kfp_db.url)
    async with engine.connect() as conn:
        await conn.execute(text(f"CREATE DATABASE {name}"))
    yield Mlmd(mlmd_python, kfp_db.url, name)
    async with engine.connect() as conn:
        await conn.execute(text(f"DROP DATABASE {name}"))
    await engine.dispose()


def kfp_workflow(name: str, run_id: str, *, finished: bool) -> dict[str, Any]:
    """A KFP v2 run's Workflow as KFP's backend labels it (run id, persisted state)."""
    now = datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    labels = {"pipeline/runid": run_id, "pipeline-name": "demo"}
    status: dict[str, Any] = {"phase": "Running", "startedAt": now}
    if finished:
        labels |= {
            "workflows.argoproj.io/completed": "true",
            "pipeline/persistedFinalState": "true",
        }
        status |= {"phase": "Succeeded", "finishedAt": now}
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"name": name, "labels": labels},
        "spec": {"entrypoint": "main"},
        "status": status,
    }


async def mlmd_rows(engine: AsyncEngine, database: str, run_id: str) -> int:
    """The run's context in ML Metadata (0 once lapse deleted its footprint)."""
    async with engine.connect() as conn:
        query = text(f"SELECT COUNT(*) FROM {database}.Context WHERE name = :run")
        return int((await conn.execute(query, {"run": run_id})).scalar_one())


async def test_a_kfp_runs_object_rows_metadata_and_artifacts_go_on_their_own_clocks(
    tmp_path: Path,
    own_nats: EmbeddedNats,
    kube: KubeStack,
    seaweedfs: EmbeddedSeaweedFS,
    kfp_db: Database,
    mlmd: Mlmd,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in seaweedfs.env().items():  # where S3 users keep them, never lapse.yaml
        monkeypatch.setenv(key, value)
    ns = kube.namespace(f"kfp-{uuid.uuid4().hex[:6]}")
    root = f"root-{ns}/"  # the pipeline root: s3://<bucket>/root-<ns>/
    a, b = str(uuid.uuid4()), str(uuid.uuid4())

    def uri(key: str) -> str:
        return f"s3://{ARTIFACT_BUCKET}/{root}{key}"

    model, log, metrics = f"demo/{a}/train/model", f"demo/{a}/train/log", f"demo/{a}/eval/m"
    report = f"reports/{a}/eval.html"  # under the root, outside a's prefix: MLMD's alone
    own = [root + key for key in (log, metrics, report)]
    beside = [
        root + f"demo/{a}x/train/log",  # a run id that starts the same
        root + f"demo/{b}/eval/m",  # b's own output
        f"other/{root}{log}",  # the same path outside the store's root
    ]
    s3 = client(seaweedfs)
    await plant(s3, *own, root + model, *beside)
    await mlmd.write(
        {
            "run_id": a,
            "pipeline": "demo",
            "executions": [
                {
                    "name": "train",
                    "state": "COMPLETE",
                    "outputs": [
                        {"label": "model", "uri": uri(model)},
                        {"label": "log", "uri": uri(log)},
                    ],
                },
                {
                    "name": "eval",
                    "state": "COMPLETE",
                    "inputs": ["model"],
                    "outputs": [
                        {"label": "a-metrics", "uri": uri(metrics)},
                        {"label": "a-report", "uri": uri(report)},
                    ],
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
                    "state": "RUNNING",
                    "inputs": ["model"],
                    "outputs": [{"label": "b-metrics", "uri": uri(f"demo/{b}/eval/m")}],
                },
            ],
        },
    )
    engine = create_engine(kfp_db.url)
    async with engine.begin() as conn:
        await insert_kfp_runs(conn, [a], namespace=ns)

    config = tmp_path / "lapse.yaml"
    config.write_text(
        f"nats: {{url: '{own_nats.url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        f"database:\n"
        f"  url: '{kfp_db.url}'\n"
        f"  targets: {{kfp: {{enabled: true}}, "
        f"ml_metadata: {{enabled: true, database: {mlmd.database}}}}}\n"
        "policies:\n"
        "  - name: kfp-runs\n"
        "    match: {has_labels: [pipeline/runid]}\n"
        f"    kubernetes: {{ttl: {KUBERNETES_TTL}s}}\n"
        f"    database: {{ttl: {DATABASE_TTL}s}}\n"
        f"    artifacts: {{ttl: {ARTIFACTS_TTL}s}}\n"
        "safety: {max_deletions_per_second: 1000, namespaces: {include: ['*']}}\n"
        "artifacts:\n"
        "  stores:\n"
        f"    - name: kfp\n"
        f"      url: 's3://{ARTIFACT_BUCKET}/{root}'\n"
        f"      endpoint: '{seaweedfs.endpoint}'\n"
        f"      region: {REGION}\n"
        "      min_prefix_depth: 3\n"
        # The namespace's own pipeline root: the whole store is its runs' (KFP's layout
        # names no namespace).
        f"      namespaces: ['{ns}']\n"
        "      roots: ['']\n"
        "      capture: {argo-workflow: ['{label:pipeline-name}/{run_id}/']}\n"
    )
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    try:
        await kube.workflows.create(ns, kfp_workflow("run-b", b, finished=False))
        run_a = kfp_workflow("run-a", a, finished=True)
        await kube.workflows.create(ns, run_a)
        finished = datetime.fromisoformat(run_a["status"]["finishedAt"]).timestamp()

        async def object_gone() -> float:  # 0.0: not yet
            items = (await kube.workflows.list(ns))["items"]
            return 0.0 if "run-a" in {w["metadata"]["name"] for w in items} else time.time()

        async def rows_gone() -> float:  # 0.0: not yet
            async with engine.connect() as conn:
                counts = await kfp_counts(conn, a)
            if sum(counts.values()) or await mlmd_rows(engine, mlmd.database, a):
                return 0.0
            return time.time()

        async def artifacts_gone() -> float:  # 0.0: not yet
            return 0.0 if set(own) & await present(client(seaweedfs)) else time.time()

        t1 = await wait_for(object_gone, timeout=60, interval=0.2)
        assert t1 >= finished + KUBERNETES_TTL
        async with engine.connect() as conn:
            assert sum((await kfp_counts(conn, a)).values()) > 0, "rows went with the object"
        assert await mlmd_rows(engine, mlmd.database, a) == 1, "metadata went with the object"
        assert set(own) <= await present(s3), "artifacts went with the object"

        t2 = await wait_for(rows_gone, timeout=60, interval=0.2)
        assert t2 >= finished + DATABASE_TTL
        assert set(own) <= await present(s3), "artifacts went with the rows"
        read = await mlmd.read(a, b)
        assert read["runs"][a] is None
        # b keeps its rows and the model it reuses (attributed to it).
        assert read["runs"][b]["artifacts"] == sorted([uri(model), uri(f"demo/{b}/eval/m")])

        t3 = await wait_for(artifacts_gone, timeout=60, interval=0.2)
        assert t3 >= finished + ARTIFACTS_TTL
        left = await present(client(seaweedfs))
        assert root + model in left, "the model b reuses was deleted"
        assert set(beside) <= left

        async def recorded() -> list[dict[str, Any]]:
            rows = lapse_json("history", "-n", ns, config=config)
            return rows if any(r["target"] == "artifacts" for r in rows) else []

        history = await wait_for(recorded, timeout=30, interval=0.5)
        outcomes = Counter((row["target"], row["outcome"]) for row in history)
        assert outcomes[("kubernetes", "deleted")] == 1
        assert outcomes[("database", "deleted")] == 1
        assert outcomes[("artifacts", "deleted")] == 1
        [artifacts] = [r for r in history if r["target"] == "artifacts"]
        detail = artifacts.get("detail") or ""
        assert "deleted 3 objects" in detail, artifacts
        assert f"kfp:{root}{model} (by ML Metadata run context" in detail, artifacts
        status = lapse_json("status", config=config)
        assert status["deadLetters"] == 0
        print(
            f"\nKFP footprint: object {t1 - finished:.1f} s, rows and metadata "
            f"{t2 - finished:.1f} s, artifacts {t3 - finished:.1f} s after finishing "
            f"(clocks {KUBERNETES_TTL}/{DATABASE_TTL}/{ARTIFACTS_TTL} s)"
        )
    finally:
        await engine.dispose()
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]
