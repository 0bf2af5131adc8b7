"""`lapse up` (a subprocess) deleting runs of engines other than Argo: a Tekton PipelineRun
announced only by Tekton's own CloudEvent POSTed to the ingress, and a batch/v1 Job seen by
the watcher. Real NATS, kube-apiserver with the real Tekton CRDs, and real Jobs."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from lapse.edges.kubernetes import KubeObjects
from lapse.embedded.nats import EmbeddedNats
from lapse.events.kinds import JOB, TEKTON_PIPELINERUN
from tests.conftest import KubeStack, kube_stack
from tests.e2e.test_lapse_up import LapseUp, lapse_json
from tests.integration.test_kinds import job, pipelinerun, requests_by_verb, spent
from tests.stack import wait_for


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    with kube_stack(tmp_path_factory.mktemp("kube-engines")) as stack:
        yield stack


def config_file(path: Path, nats_url: str, kube: KubeStack) -> Path:
    path.write_text(
        f"nats: {{url: '{nats_url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        "safety: {max_deletions_per_second: 200, namespaces: {include: ['*']}}\n"
    )
    return path


def tekton_cloudevent(pipeline_run: dict[str, Any]) -> tuple[dict[str, str], bytes]:
    """What Tekton's controller sends its CloudEvents sink: binary mode, the PipelineRun
    converted to v1beta1 and without TypeMeta (as in Tekton's own events)."""
    body = {k: v for k, v in pipeline_run.items() if k not in ("apiVersion", "kind")}
    headers = {
        "ce-specversion": "1.0",
        "ce-type": "dev.tekton.event.pipelinerun.successful.v1",
        "ce-source": f"/apis///namespaces/{body['metadata']['namespace']}//"
        f"{body['metadata']['name']}",
        "ce-id": str(uuid.uuid4()),
        "ce-subject": body["metadata"]["name"],
        "content-type": "application/json",
    }
    return headers, json.dumps({"pipelineRun": body}).encode()


async def test_a_tekton_cloudevent_and_a_job_are_deleted_at_their_deadlines(
    tmp_path: Path, own_nats: EmbeddedNats, kube: KubeStack
) -> None:
    objects = KubeObjects(kube.api_client, kube.executor)
    ns = kube.namespace(f"engines-{uuid.uuid4().hex[:6]}")
    now = datetime.now(UTC)

    body, status = pipelinerun(ns, "build", ttl="3s")
    created = await objects.create(TEKTON_PIPELINERUN, ns, body)
    created["status"] = {**status, "completionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ")}
    run = await objects.replace_status(TEKTON_PIPELINERUN, ns, "build", created)

    # Only the ingress hears of the PipelineRun: no watcher runs in this `lapse up`.
    config = config_file(tmp_path / "lapse.yaml", own_nats.url, kube)
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    up.args.append("--no-watch")
    await up.start()
    try:
        headers, data = tekton_cloudevent(run)
        async with httpx.AsyncClient() as http:
            answer = await http.post(
                f"http://127.0.0.1:{up.ingress_port}/", headers=headers, content=data
            )
        assert answer.status_code == 202, answer.text

        async def pipelinerun_gone() -> bool:
            return await objects.get(TEKTON_PIPELINERUN, ns, "build") is None

        await wait_for(pipelinerun_gone, timeout=60, interval=0.5)
    finally:
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]

    # The watcher's path: a Job that finished just now, with a 2 s TTL.
    body, status = job(ns, "report", ttl="2s", labels={"app": "report"})
    created = await objects.create(JOB, ns, body)
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for condition in status["conditions"]:
        condition["lastTransitionTime"] = stamp
    created["status"] = {**status, "completionTime": stamp}
    report = await objects.replace_status(JOB, ns, "report", created)
    before = requests_by_verb(kube, "jobs")
    watching = LapseUp(config, tmp_path / "state", tmp_path / "up2.log")
    await watching.start()
    try:

        async def job_gone() -> bool:  # a LIST: this test's own GETs would be counted
            return not await objects.list_items(JOB, ns, label_selector="app=report")

        await wait_for(job_gone, timeout=60, interval=0.5)
    finally:
        assert watching.stop() == 0, (tmp_path / "up2.log").read_text()[-3000:]
    # The version the watcher read was DELETEd held to its resourceVersion, not read again
    # (safety.read_before_delete: auto), as the API server itself counts.
    used = spent(before, requests_by_verb(kube, "jobs"))
    assert used.get("DELETE") == 1 and "GET" not in used, used

    history = lapse_json("history", "-n", ns, config=config)
    outcomes = Counter((row["kind"], row["outcome"]) for row in history)
    assert outcomes == {("PipelineRun", "deleted"): 1, ("Job", "deleted"): 1}, history
    uids = {row["uid"] for row in history}
    assert uids == {run["metadata"]["uid"], report["metadata"]["uid"]}
    for row in history:  # none early: each deleted at or after its deadline
        assert row["latencySeconds"] >= 0
    jobs = lapse_json("history", "-n", ns, "--kind", "Job", config=config)
    assert [row["name"] for row in jobs] == ["report"]


# The annotations tektoncd/results' watcher writes (pkg/watcher/reconciler/annotation):
# record and result after each upsert, stored "true" once the done run is stored.
RESULTS_RECORD = "results.tekton.dev/record"
RESULTS_RESULT = "results.tekton.dev/result"
RESULTS_STORED = "results.tekton.dev/stored"


def results_marks(ns: str, name: str, stored: str) -> dict[str, str]:
    result = f"{ns}/results/{uuid.uuid4()}"
    return {
        RESULTS_RESULT: result,
        RESULTS_RECORD: f"{result}/records/{uuid.uuid4()}",
        RESULTS_STORED: stored,
    }


async def test_a_pipelinerun_is_held_until_tekton_results_stored_it(
    tmp_path: Path, own_nats: EmbeddedNats, kube: KubeStack
) -> None:
    """`lapse up` with its watcher: an expired PipelineRun the Results watcher has reached
    but not stored (`results.tekton.dev/stored: "false"`, as it writes while the final
    state is not yet stored) is held, re-checked every `gate_retry.backoff`; the mark
    (written here as the watcher writes it) lets it go at the next check."""
    objects = KubeObjects(kube.api_client, kube.executor)
    ns = kube.namespace(f"results-{uuid.uuid4().hex[:6]}")
    body, status = pipelinerun(ns, "stored-late", ttl="1s", labels={"app": "stored-late"})
    body["metadata"]["annotations"].update(results_marks(ns, "stored-late", "false"))
    created = await objects.create(TEKTON_PIPELINERUN, ns, body)
    created["status"] = status
    run = await objects.replace_status(TEKTON_PIPELINERUN, ns, "stored-late", created)

    config = tmp_path / "lapse.yaml"
    config.write_text(
        f"nats: {{url: '{own_nats.url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        "safety:\n"
        "  namespaces: {include: ['*']}\n"
        "  gate_retry: {backoff: 1s, max_wait: 1h}\n"
    )
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    try:

        async def held_twice() -> bool:
            rows = lapse_json("history", "-n", ns, "--outcome", "rescheduled", config=config)
            return len([r for r in rows if "tekton-results-stored" in (r["detail"] or "")]) >= 2

        # Two gated checks a backoff apart: the hold is a wait, not a one-off.
        await wait_for(held_twice, timeout=60, interval=1)
        assert await objects.get(TEKTON_PIPELINERUN, ns, "stored-late") is not None

        current = await objects.get(TEKTON_PIPELINERUN, ns, "stored-late")
        assert current is not None
        current["metadata"]["annotations"][RESULTS_STORED] = "true"
        await objects.replace(TEKTON_PIPELINERUN, ns, "stored-late", current)
        marked = datetime.now(UTC)

        async def gone() -> bool:  # a LIST: a GET of a PipelineRun being deleted is no answer
            return not await objects.list_items(
                TEKTON_PIPELINERUN, ns, label_selector="app=stored-late"
            )

        await wait_for(gone, timeout=60, interval=0.2)
    finally:
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]

    deleted = lapse_json("history", "-n", ns, "--outcome", "deleted", config=config)
    assert [r["uid"] for r in deleted] == [run["metadata"]["uid"]], deleted
    # What the audit trail says: deleted once, after the mark (its time is the reaper's).
    after_mark = (datetime.fromisoformat(deleted[0]["time"]) - marked).total_seconds()
    print(f"deleted {after_mark:.2f} s after the Results mark (gate_retry.backoff 1s)")
    assert after_mark > 0
    assert after_mark <= 2, f"deleted {after_mark:.2f} s after the mark, backoff is 1 s"
