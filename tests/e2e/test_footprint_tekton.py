"""A Tekton PipelineRun's whole footprint, each part on its own clock, through `lapse up`
(a subprocess, as users run it) on real servers: the PipelineRun in a kube-apiserver with
Tekton's CRDs, Tekton Results' rows in PostgreSQL (its own GORM models,
tests/tekton_results_schema.py), its log blobs in a SeaweedFS S3 server.

The blobs are where Tekton Results' blob log layout puts them (tektoncd/results:
`LOGS_TYPE: Blob`, the plugin reads `<LOGS_PATH>/<namespace>/<result>/<record>/`, the
Result named by the PipelineRun's uid and each record by a TaskRun's uid; its e2e Vector
sink writes `logs/<namespace>/<result>/<taskRunUID>/<container>`), captured by the declared
template `logs/{namespace}/{uid}/` when the run is planned.

- The PipelineRun is expired at once (kubernetes 1 s) but the Results watcher has not
  stored it (`results.tekton.dev/stored: "false"`): held, checked every `gate_retry.backoff`
  (1 s); the mark, written here as the watcher writes it, lets it go within 2 s.
- Its Result and records go at T2 (database 8 s), its log blobs at T3 (artifacts 14 s):
  none before, and blobs planted beside them (another run's, a uid that starts the same,
  the same path outside the store's root) survive.
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

from lapse.edges.database import create_engine
from lapse.edges.kubernetes import KubeObjects
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.seaweedfs import REGION, EmbeddedSeaweedFS
from lapse.events.kinds import TEKTON_PIPELINERUN
from lapse.events.timeutil import format_rfc3339
from tests import tekton_results_schema as results
from tests.conftest import ARTIFACT_BUCKET, KubeStack, kube_stack
from tests.e2e.test_engines import RESULTS_STORED, results_marks
from tests.e2e.test_lapse_up import LapseUp, lapse_json
from tests.integration.test_artifact_reaper import client, plant, present
from tests.integration.test_kinds import condition, meta
from tests.stack import Database, scratch_database, wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats, pytest.mark.db]

KUBERNETES_TTL, DATABASE_TTL, ARTIFACTS_TTL = 1, 25, 35


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    with kube_stack(tmp_path_factory.mktemp("kube-footprint-tekton")) as stack:
        yield stack


@pytest.fixture
async def results_db() -> AsyncIterator[Database]:
    """Tekton Results' database (PostgreSQL, the one it supports)."""
    async with scratch_database("postgresql") as db:
        engine = create_engine(db.url)
        await results.create_tables(engine)
        await engine.dispose()
        yield db


async def test_a_pipelinerun_held_for_results_then_its_rows_and_log_blobs_on_their_clocks(
    tmp_path: Path,
    own_nats: EmbeddedNats,
    kube: KubeStack,
    seaweedfs: EmbeddedSeaweedFS,
    results_db: Database,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in seaweedfs.env().items():  # where S3 users keep them, never lapse.yaml
        monkeypatch.setenv(key, value)
    objects = KubeObjects(kube.api_client, kube.executor)
    ns = kube.namespace(f"tkn-{uuid.uuid4().hex[:6]}")
    root = f"results-{ns}/"  # the Results log bucket's root in this test's bucket

    config = tmp_path / "lapse.yaml"
    config.write_text(
        f"nats: {{url: '{own_nats.url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        f"database: {{url: '{results_db.url}', targets: {{tekton_results: {{enabled: true}}}}}}\n"
        "policies:\n"
        "  - name: tekton\n"
        "    match: {engines: [tekton]}\n"
        f"    kubernetes: {{ttl: {KUBERNETES_TTL}s}}\n"
        f"    database: {{ttl: {DATABASE_TTL}s}}\n"
        f"    artifacts: {{ttl: {ARTIFACTS_TTL}s}}\n"
        "safety:\n"
        "  max_deletions_per_second: 1000\n"
        "  namespaces: {include: ['*']}\n"
        "  gate_retry: {backoff: 1s, max_wait: 1h}\n"
        "artifacts:\n"
        "  stores:\n"
        "    - name: tekton-logs\n"
        f"      url: 's3://{ARTIFACT_BUCKET}/{root}'\n"
        f"      endpoint: '{seaweedfs.endpoint}'\n"
        f"      region: {REGION}\n"
        "      min_prefix_depth: 4\n"
        "      capture: {tekton-pipelinerun: ['logs/{namespace}/{uid}/']}\n"
    )
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    engine = create_engine(results_db.url)
    try:
        body: dict[str, Any] = {
            "apiVersion": "tekton.dev/v1",
            "kind": "PipelineRun",
            "metadata": meta(ns, "build", ttl=None, labels={"app": "build"}),
            "spec": {"pipelineRef": {"name": "build"}},
        }
        body["metadata"]["annotations"].update(results_marks(ns, "build", "false"))
        created = await objects.create(TEKTON_PIPELINERUN, ns, body)
        uid = created["metadata"]["uid"]
        now = datetime.now(UTC).replace(microsecond=0)
        finished = now.timestamp()
        created["status"] = {
            "startTime": format_rfc3339(now),
            "completionTime": format_rfc3339(now),
            "conditions": [condition("Succeeded", "True", format_rfc3339(now))],
        }
        # What Results stored of it: its Result (named by its uid), records, log blobs.
        async with engine.begin() as conn:
            await results.insert_pipelinerun(conn, ns, uid, ended=now, taskruns=2)
        tr1, tr2 = str(uuid.uuid4()), str(uuid.uuid4())
        logs = [
            f"{root}logs/{ns}/{uid}/{tr1}/step-build",
            f"{root}logs/{ns}/{uid}/{tr2}/step-test",
        ]
        beside = [
            f"{root}logs/{ns}/{uuid.uuid4()}/{tr1}/step-build",  # another run's
            f"{root}logs/{ns}/{uid}x/{tr1}/step-build",  # a uid that starts the same
            f"logs/{ns}/{uid}/{tr1}/step-build",  # outside the store's root
        ]
        s3 = client(seaweedfs)
        await plant(s3, *logs, *beside)
        await objects.replace_status(TEKTON_PIPELINERUN, ns, "build", created)

        async def held_twice() -> bool:
            rows = lapse_json("history", "-n", ns, "--outcome", "rescheduled", config=config)
            return len([r for r in rows if "tekton-results-stored" in (r["detail"] or "")]) >= 2

        # Two gated checks a backoff apart: the hold is a wait, not a one-off.
        await wait_for(held_twice, timeout=60, interval=0.5)
        current = await objects.get(TEKTON_PIPELINERUN, ns, "build")
        assert current is not None, "deleted before Tekton Results stored it"
        current["metadata"]["annotations"][RESULTS_STORED] = "true"
        await objects.replace(TEKTON_PIPELINERUN, ns, "build", current)
        marked = time.time()

        async def object_gone() -> float:  # 0.0: not yet (a LIST: a GET may see it going)
            items = await objects.list_items(TEKTON_PIPELINERUN, ns, label_selector="app=build")
            return 0.0 if items else time.time()

        async def rows_gone() -> float:  # 0.0: not yet
            async with engine.connect() as conn:
                left = await results.counts(conn, uid)
            return 0.0 if sum(left.values()) else time.time()

        async def blobs_gone() -> float:  # 0.0: not yet
            return 0.0 if set(logs) & await present(client(seaweedfs)) else time.time()

        t1 = await wait_for(object_gone, timeout=30, interval=0.1)
        async with engine.connect() as conn:
            assert await results.counts(conn, uid) == {"results": 1, "records": 4}
        assert set(logs) <= await present(s3), "log blobs went with the object"

        t2 = await wait_for(rows_gone, timeout=60, interval=0.2)
        assert t2 >= finished + DATABASE_TTL
        assert set(logs) <= await present(s3), "log blobs went with the rows"

        t3 = await wait_for(blobs_gone, timeout=60, interval=0.2)
        assert t3 >= finished + ARTIFACTS_TTL
        assert set(beside) <= await present(client(seaweedfs))

        async def recorded() -> list[dict[str, Any]]:
            rows = lapse_json("history", "-n", ns, config=config)
            return rows if any(r["target"] == "artifacts" for r in rows) else []

        history = await wait_for(recorded, timeout=30, interval=0.5)
        outcomes = Counter((row["target"], row["outcome"]) for row in history)
        assert outcomes[("kubernetes", "deleted")] == 1
        assert outcomes[("database", "deleted")] == 1
        assert outcomes[("artifacts", "deleted")] == 1
        [rows] = [r for r in history if r["target"] == "database" and r["outcome"] == "deleted"]
        assert rows["detail"] == "tekton_results: records=4, results=1"
        [blobs] = [r for r in history if r["target"] == "artifacts"]
        assert (blobs["detail"] or "").startswith("deleted 2 objects"), blobs
        assert lapse_json("status", config=config)["deadLetters"] == 0
        after_mark = t1 - marked
        print(
            f"\nTekton footprint: object {after_mark:.2f} s after the Results mark "
            f"(backoff 1 s), rows {t2 - finished:.1f} s, log blobs {t3 - finished:.1f} s "
            f"after finishing (clocks {DATABASE_TTL}/{ARTIFACTS_TTL} s)"
        )
        assert after_mark <= 2, f"deleted {after_mark:.2f} s after the mark"
    finally:
        await engine.dispose()
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]
