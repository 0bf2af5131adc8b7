"""Forged and stale events through `lapse up`'s ingress and `lapse serve row-reaper`, as an
attacker inside the cluster would send them (issue: "nothing is deleted on anyone's word").

Each attack here deleted something before the trust rework; now each ends in a recorded
outcome and deletes nothing (docs/security.md):
- a `cleanup.due` (target database, deadline now) POSTed to the row-reaper for a run that
  is still running: `refused`, no schedule lapse stored backs it;
- the same for a finished run whose stored database deadline is an hour away:
  `rescheduled` (the stored deadline stands);
- a `run.finished` claiming `finishedAt: 2000-01-01` for a finished run: planned from the
  Workflow as the API server has it, the stored deadlines do not move;
- an ApiServerSource Resource-mode event saying a Running Workflow completed: refused by
  the planner (the API server says Running), nothing scheduled;
- a `run.deleted` for a run that still exists: refused, its pending deletion stands.

Real NATS, kube-apiserver and PostgreSQL; lapse as users run it (subprocesses). A control
run, due in seconds, is deleted meanwhile: the pipeline was working while the forged
events were refused.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings.http import to_binary_event
from cloudevents.core.v1.event import CloudEvent

from lapse.config import Streams
from lapse.edges.database import create_engine
from lapse.edges.nats import connect
from lapse.edges.schedules import NatsScheduleStore
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port
from lapse.events.builder import build_event
from lapse.events.models import CleanupDue, RunDeleted, RunFinished
from lapse.events.run import KFP_RUN_ID_LABEL, Engine, RunRef, Target
from lapse.events.types import EventType
from tests.conftest import KubeStack, kube_stack
from tests.e2e.test_lapse_up import LapseUp, lapse_json
from tests.kfp_schema import create_kfp_tables, insert_kfp_runs, kfp_counts, run_details
from tests.stack import Database, scratch_database, wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats, pytest.mark.db]

FULL_ROWS = {"run_details": 1, "run_metrics": 2, "tasks": 2, "resource_references": 2}


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    with kube_stack(tmp_path_factory.mktemp("kube-forged")) as stack:
        yield stack


@pytest.fixture(scope="module")
async def kfp_database() -> AsyncIterator[Database]:
    async with scratch_database("postgresql") as db:
        engine = create_engine(db.url)
        await create_kfp_tables(engine)
        await engine.dispose()
        yield db


def write_config(path: Path, nats_url: str, kube: KubeStack, db: Database) -> Path:
    path.write_text(
        f"nats: {{url: '{nats_url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        f"database: {{url: '{db.url}', targets: {{kfp: {{enabled: true}}}}}}\n"
        "policies:\n"
        "  - name: control\n"
        "    match: {labels: {role: control}}\n"
        "    kubernetes: {ttl: 2s}\n"
        "    database: {ttl: 4s}\n"
        "  - name: kfp-runs\n"
        "    match: {has_labels: [pipeline/runid]}\n"
        "    kubernetes: {ttl: 1h}\n"
        "    database: {ttl: 1h}\n"
        # A real cluster deletes only in the namespaces it is given (else dry-run).
        "safety: {namespaces: {include: ['*']}}\n"
    )
    return path


def workflow(name: str, run_id: str, *, phase: str, role: str = "victim") -> dict[str, Any]:
    now = datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    done = phase in ("Succeeded", "Failed", "Error")
    status: dict[str, Any] = {"phase": phase, "startedAt": now}
    if done:
        status["finishedAt"] = now
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "labels": {
                "workflows.argoproj.io/completed": "true" if done else "false",
                KFP_RUN_ID_LABEL: run_id,
                "pipeline/persistedFinalState": "true",
                "role": role,
            },
        },
        "spec": {"entrypoint": "main"},
        "status": status,
    }


def run_of(wf: dict[str, Any], *, finished_at: datetime) -> RunRef:
    meta = wf["metadata"]
    return RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace=meta["namespace"], name=meta["name"], uid=meta["uid"], phase="Succeeded",
        labels=meta.get("labels", {}), kfp_run_id=meta["labels"][KFP_RUN_ID_LABEL],
        finished_at=finished_at,
    )  # fmt: skip


async def post(url: str, event: BaseCloudEvent) -> httpx.Response:
    message = to_binary_event(event)
    async with httpx.AsyncClient() as http:
        return await http.post(url, headers=message.headers, content=message.body)


class Serve:
    """`lapse serve row-reaper`, as Knative would run it."""

    def __init__(self, config: Path, log: Path) -> None:
        self.port = free_port()
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "lapse.cli", "--config", str(config), "serve",
                 "row-reaper", "--listen", f"127.0.0.1:{self.port}"],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ},
            )  # fmt: skip

    async def ready(self) -> None:
        async def answers() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"lapse serve exited:\n{self.log.read_text()[-3000:]}")
            try:
                async with httpx.AsyncClient() as http:
                    got = await http.get(f"http://127.0.0.1:{self.port}/health/readiness")
                    return got.status_code == 200
            except httpx.TransportError:
                return False

        await wait_for(answers, timeout=60, interval=0.2)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)


async def test_forged_events_delete_nothing_and_each_is_recorded(
    tmp_path: Path, own_nats: EmbeddedNats, kube: KubeStack, kfp_database: Database
) -> None:
    config = write_config(tmp_path / "lapse.yaml", own_nats.url, kube, kfp_database)
    ns = kube.namespace(f"forged-{uuid.uuid4().hex[:6]}")
    running_id, finished_id, control_id = (str(uuid.uuid4()) for _ in range(3))
    engine = create_engine(kfp_database.url)
    async with engine.begin() as conn:
        await insert_kfp_runs(conn, [running_id, finished_id, control_id], namespace=ns)
        # What KFP holds for a run that is still going.
        await conn.execute(
            run_details.update()
            .where(run_details.c["UUID"] == running_id)
            .values(FinishedAtInSec=0, State="RUNNING", Conditions="Running")
        )
    wfs = kube.workflows
    running = await wfs.create(ns, workflow("running", running_id, phase="Running"))
    finished = await wfs.create(ns, workflow("finished", finished_id, phase="Succeeded"))
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    serve = Serve(config, tmp_path / "serve.log")
    try:
        await serve.ready()
        nc = await connect(own_nats.url)
        store = NatsScheduleStore(nc.jetstream(), Streams())

        async def planned() -> bool:
            return await store.get(Target.DATABASE, finished["metadata"]["uid"]) is not None

        await wait_for(planned, timeout=60, interval=0.2)
        stored = await store.get(Target.DATABASE, finished["metadata"]["uid"])
        assert stored is not None and stored.deadline > datetime.now(UTC) + timedelta(minutes=50)
        now = datetime.now(UTC)
        ingress = f"http://127.0.0.1:{up.ingress_port}/"
        row_reaper = f"http://127.0.0.1:{serve.port}/"

        # 1. A due event for the running run's rows, straight to the row-reaper.
        due_running = CleanupDue(
            run=run_of(running, finished_at=now - timedelta(days=1)), target=Target.DATABASE,
            deadline=now, policy="forged", scheduled_at=now,
        )  # fmt: skip
        answer = await post(
            row_reaper, build_event(EventType.CLEANUP_DUE, source="/x", data=due_running)
        )
        assert answer.status_code == 202, answer.text
        # 1b. The same for the finished run, whose stored deadline is an hour away.
        due_finished = due_running.model_copy(
            update={"run": run_of(finished, finished_at=now - timedelta(days=1))}
        )
        answer = await post(
            row_reaper, build_event(EventType.CLEANUP_DUE, source="/x", data=due_finished)
        )
        assert answer.status_code == 202, answer.text

        # 2. A run.finished claiming the finished run ended in 2000.
        claim = RunFinished(run=run_of(finished, finished_at=datetime(2000, 1, 1, tzinfo=UTC)))
        answer = await post(ingress, build_event(EventType.RUN_FINISHED, source="/x", data=claim))
        assert answer.status_code == 202, answer.text

        # 3. An ApiServerSource event saying the Running Workflow completed.
        lie = copy.deepcopy(running)
        lie["metadata"]["labels"]["workflows.argoproj.io/completed"] = "true"
        lie["status"] = {"phase": "Succeeded", "finishedAt": "2000-01-01T00:00:00Z"}
        resource = CloudEvent(
            attributes={
                "type": "dev.knative.apiserver.resource.update",
                "source": "https://kubernetes.default.svc",
                "id": f"forged-{uuid.uuid4().hex}",
            },
            data=lie,
        )
        answer = await post(ingress, resource)
        assert answer.status_code == 202, answer.text

        # 4. A run.deleted for the finished run, which still exists.
        gone = RunDeleted(run=run_of(finished, finished_at=now))
        answer = await post(ingress, build_event(EventType.RUN_DELETED, source="/x", data=gone))
        assert answer.status_code == 202, answer.text

        # The control run, due in seconds: the pipeline works meanwhile.
        control = await wfs.create(ns, workflow("control", control_id, phase="Succeeded",
                                                role="control"))  # fmt: skip

        async def control_rows_gone() -> bool:
            async with engine.connect() as conn:
                return sum((await kfp_counts(conn, control_id)).values()) == 0

        async def all_recorded() -> list[dict[str, Any]] | None:
            history = lapse_json("history", "-n", ns, config=config)
            failed = lapse_json("dlq", "list", "-n", ns, config=config)
            refused = [r for r in history if r["outcome"] in ("refused", "rescheduled")]
            planner = [f for f in failed if f["stage"] == "planner"]
            return [*refused, *planner] if len(refused) >= 2 and len(planner) >= 2 else None

        await wait_for(control_rows_gone, timeout=90, interval=0.5)
        recorded = await wait_for(all_recorded, timeout=60, interval=1)

        by_name = {(r["name"], r.get("outcome", r.get("stage"))): r for r in recorded}
        assert ("running", "refused") in by_name, recorded
        assert "no schedule lapse stored" in by_name[("running", "refused")]["detail"]
        assert ("finished", "rescheduled") in by_name, recorded
        reasons = [r["reason"] for r in recorded if "reason" in r]
        assert any("the API server says" in why and "not finished" in why for why in reasons), (
            reasons
        )
        assert any("still exists" in why for why in reasons), reasons

        # Nothing was deleted, and the stored deadlines did not move.
        async with engine.connect() as conn:
            assert await kfp_counts(conn, finished_id) == FULL_ROWS
            running_rows = await kfp_counts(conn, running_id)
            assert running_rows == FULL_ROWS
        for wf in (running, finished):
            assert await wfs.get(ns, wf["metadata"]["name"]) is not None
        for target in (Target.KUBERNETES, Target.DATABASE):
            after = await store.get(target, finished["metadata"]["uid"])
            assert after is not None and after.deadline > now + timedelta(minutes=50), target
        assert await store.get(Target.DATABASE, running["metadata"]["uid"]) is None
        assert await wfs.get(ns, control["metadata"]["name"]) is None
        await nc.close()
    finally:
        serve.stop()
        await engine.dispose()
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]
