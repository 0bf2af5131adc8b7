"""The forged-input suite (issue 23): generated forged and replayed events through every
entrance lapse has, against real objects and real KFP rows that are not due, delete nothing,
and each one ends recorded.

The entrances, as an attacker inside the cluster reaches them:
- `lapse up`'s HTTP ingress (the in-process `Pipeline` serving it on a real port; and with
  a bearer token configured, as beyond loopback: 401, nothing stored);
- each function over HTTP exactly as Knative serves it (`FunctionShell` behind
  func-python's ASGI app, as `lapse serve` runs it): ttl-planner, object-reaper, row-reaper;
- NATS subjects: `lapse.events.<type>`, `lapse.due.<target>.<uid>`,
  `lapse.sched.<target>.<uid>`, published WITHOUT the `Lapse-Observed` header.

The victims are not due: finished Workflows and Jobs kept for a week by their own TTL,
Running Workflows and Jobs, KFP rows of Running runs, and KFP rows whose stored database
schedule is an hour away. The forgeries: `cleanup.due` for both targets with deadlines in
the past, now or the future, real uids of the victims or random ones, real or random KFP
run ids, run refs claiming another phase, finish time or `lapse.dev/ttl: 1s`, with and
without `ce-lapseobserved: apiserver`; `run.finished`/`run.deleted` with past finish times;
Knative ApiServerSource Resource-mode events claiming Running runs completed; and replays of
real due events, captured from the stream after they fired, once their schedule moved later.

Asserted, on the real servers: every victim object (GET) and every victim row (COUNT) is
still there, and no deadline lapse stored for them came earlier; every push is answered
2xx or 4xx (a 503 would be a transient "retry later"; none happens here); every forged due
event ends in an outcome on the audit stream (refused, rescheduled, kept, skipped,
already_gone, replaced) or a cleanup.failed; every other push is a recorded 4xx, or stored
and answered (the dispatcher's consumers drain; a claim the planner finds unchanged is
silent by design). The "nothing else happened" check waits on something that would have
happened: a control run, due in a second, is deleted (object and rows) after the forgeries.

The NATS part runs against a plain embedded nats-server, where anyone who can connect may
publish anything: `NatsEntrance` says what a publisher may be expected to write there. On
plain NATS, a message on `lapse.due.database.*` or `lapse.sched.database.*` IS lapse's
stored schedule (the row-reaper's proof; NATS permissions are what keep others off those
subjects), so database-target forgeries there name only Running runs (whose rows the
database itself keeps) or unknown ones. A credentialed variant (an identity without publish
rights on `lapse.due.>`/`lapse.sched.>`) is a second `NatsEntrance` that sends them all.

Bounded for `make test`: LAPSE_FORGED_EXAMPLES (default 120) examples per entrance;
hypothesis generates them, derandomized so a failure reproduces.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings.http import to_binary_event, to_structured_event
from cloudevents.core.v1.event import CloudEvent
from func_python.cloudevent import ASGIApplication
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from sqlalchemy import update

from lapse.config import LapseConfig, Streams, load_config
from lapse.edges.database import create_engine
from lapse.edges.kubernetes import KubeObjects
from lapse.edges.nats import connect
from lapse.edges.publishing import NatsPublisher
from lapse.edges.schedules import NatsScheduleStore, schedule_headers
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port
from lapse.events.adapters import adapt_object
from lapse.events.builder import build_event, outcome_id
from lapse.events.kinds import ARGO_WORKFLOW, DEFAULT_KINDS, JOB, KindSpec
from lapse.events.models import CleanupDue, RunDeleted, RunFinished
from lapse.events.nats_binding import from_nats, to_nats
from lapse.events.observed import OBSERVED_EXTENSION, OBSERVED_HEADER
from lapse.events.run import KFP_RUN_ID_LABEL, Engine, RunRef, Target
from lapse.events.subjects import due_subject, event_subject, schedule_subject
from lapse.events.timeutil import format_rfc3339
from lapse.events.types import EventType
from lapse.functions.trust import Provenance
from lapse.operations.dlq import Filter, dead_letters, replay
from lapse.runtime.ingress import nats_ingress
from lapse.runtime.knative import FunctionShell
from lapse.runtime.pipeline import Pipeline
from lapse.runtime.routing import load_routes
from tests.conftest import KubeStack
from tests.engine_objects import succeeded_job_status
from tests.kfp_schema import create_kfp_tables, insert_kfp_runs, kfp_counts, run_details
from tests.stack import Database, scratch_database, wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats, pytest.mark.db]

EXAMPLES = int(os.environ.get("LAPSE_FORGED_EXAMPLES", "120"))
STREAMS = Streams()
# The targets this world plans: no artifacts stores are configured here.
PLANNED = (Target.KUBERNETES, Target.DATABASE)
FULL_ROWS = {"run_details": 1, "run_metrics": 2, "tasks": 2, "resource_references": 2}
# What a forged or replayed due event may end in: nothing here is due.
HARMLESS = {"refused", "rescheduled", "kept", "skipped", "already_gone", "replaced"}
WEEK = 7 * 24 * 3600


# --- the world: victims that are not due, a pipeline, the functions -------------------------


@dataclass(frozen=True)
class Victim:
    """A run that is not due: an object on the API server and/or KFP rows."""

    kind: KindSpec | None  # None: rows only (their Workflow is gone)
    namespace: str
    name: str
    uid: str
    kfp_run_id: str | None
    running: bool
    body: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def engine(self) -> Engine:
        return Engine.JOB if self.kind is JOB else Engine.ARGO

    @property
    def api_version(self) -> str:
        return "batch/v1" if self.kind is JOB else "argoproj.io/v1alpha1"

    @property
    def kind_name(self) -> str:
        return "Job" if self.kind is JOB else "Workflow"


@dataclass
class World:
    config_path: Path
    config: LapseConfig
    namespace: str
    nats: NatsClient
    js: JetStreamContext
    kube: KubeStack
    objects: KubeObjects
    db: Database
    victims: list[Victim]
    ingress_url: str
    shells: dict[str, httpx.AsyncClient]
    # The deadlines lapse stored for the victims before any forgery: none may come earlier.
    stored: dict[tuple[Target, str], datetime]
    controls: int = 0

    @property
    def kfp_ids(self) -> list[str]:
        return [v.kfp_run_id for v in self.victims if v.kfp_run_id]


def write_config(path: Path, nats_url: str, kube: KubeStack, db: Database, ns: str) -> Path:
    path.write_text(
        f"nats: {{url: '{nats_url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        f"database: {{url: '{db.url}', targets: {{kfp: {{enabled: true}}}}}}\n"
        # Every refusal recorded: the suite checks each one ends somewhere.
        "ingress: {max_records_per_minute: 100000}\n"
        # The session's API server holds other tests' objects: the reapers stay here.
        f"safety: {{namespaces: {{include: ['{ns}']}}}}\n"
        "policies:\n"
        "  - name: control\n"
        "    match: {labels: {role: control}}\n"
        "    kubernetes: {ttl: 1s}\n"
        "    database: {ttl: 1s}\n"
        "  - name: replay\n"
        "    match: {labels: {role: replay}}\n"
        "    kubernetes: {ttl: 2s}\n"
        "    database: {ttl: 2s}\n"
        "  - name: kfp-runs\n"
        "    match: {has_labels: [pipeline/runid]}\n"
        "    kubernetes: {ttl: 1h}\n"
        "    database: {ttl: 1h}\n"
    )
    return path


def rfc3339(moment: datetime) -> str:
    return format_rfc3339(moment.replace(microsecond=0))


def workflow_body(name: str, *, running: bool, kfp_run_id: str, role: str) -> dict[str, Any]:
    now = datetime.now(UTC)
    labels = {
        "workflows.argoproj.io/completed": "false" if running else "true",
        "workflows.argoproj.io/phase": "Running" if running else "Succeeded",
        KFP_RUN_ID_LABEL: kfp_run_id,
        "pipeline/persistedFinalState": "true",
        "role": role,
    }
    status: dict[str, Any] = {"phase": "Running", "startedAt": rfc3339(now - timedelta(days=2))}
    if not running:
        # A minute ago: its database deadline (finish + 1h) is still ahead.
        status.update(phase="Succeeded", finishedAt=rfc3339(now - timedelta(minutes=1)))
    annotations = {} if role in ("control", "replay") else {"lapse.dev/ttl": "7d"}
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {"entrypoint": "main"},
        "status": status,
    }


def job_body(name: str, *, running: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    started = rfc3339(datetime.now(UTC) - timedelta(days=2))
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            # A week after it finished: its own TTL, the engine's.
            "ttlSecondsAfterFinished": WEEK,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "registry.invalid/x:1"}],
                }
            },
        },
    }
    status: dict[str, Any] = {"startTime": started, "active": 1}
    if not running:
        status = succeeded_job_status(started, rfc3339(datetime.now(UTC) - timedelta(days=1)))
    return body, status


async def plan_as_the_watcher(js: JetStreamContext, obj: dict[str, Any]) -> None:
    """The run event lapse's own watcher publishes for an object it read (observed)."""
    finished = adapt_object(obj, False, DEFAULT_KINDS)
    assert isinstance(finished, RunFinished), finished
    event = build_event(EventType.RUN_FINISHED, source="/lapse/watcher", data=finished)
    await NatsPublisher(js, STREAMS, provenance=Provenance.READ_BY_LAPSE).publish(event)


@pytest.fixture(scope="module")
async def kfp_database() -> AsyncIterator[Database]:
    async with scratch_database("postgresql") as db:
        engine = create_engine(db.url)
        await create_kfp_tables(engine)
        await engine.dispose()
        yield db


@pytest.fixture(scope="module")
def module_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """A nats-server of this module's own: it owns every stream's contents."""
    server = EmbeddedNats(tmp_path_factory.mktemp("forged-nats")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
async def world(
    tmp_path_factory: pytest.TempPathFactory,
    module_nats: EmbeddedNats,
    kube: KubeStack,
    kfp_database: Database,
) -> AsyncIterator[World]:
    ns = kube.namespace(f"forged-{uuid.uuid4().hex[:6]}")
    path = write_config(
        tmp_path_factory.mktemp("forged") / "lapse.yaml", module_nats.url, kube, kfp_database, ns
    )
    config = load_config(str(path), env={})
    engine = create_engine(kfp_database.url)
    objects = KubeObjects(kube.api_client, kube.executor)
    victims: list[Victim] = []
    running_ids = [str(uuid.uuid4()) for _ in range(2)]
    finished_ids = [str(uuid.uuid4()) for _ in range(2)]
    orphan_ids = [str(uuid.uuid4()) for _ in range(2)]
    async with engine.begin() as conn:
        await insert_kfp_runs(conn, [*running_ids, *finished_ids, *orphan_ids], namespace=ns)
        # What KFP holds for a run that is still going.
        await conn.execute(
            update(run_details)
            .where(run_details.c["UUID"].in_(running_ids))
            .values(FinishedAtInSec=0, State="RUNNING", Conditions="Running")
        )
    for i, (run_id, running) in enumerate(
        [(r, True) for r in running_ids] + [(f, False) for f in finished_ids]
    ):
        name = f"{'running' if running else 'finished'}-wf-{i}"
        body = workflow_body(name, running=running, kfp_run_id=run_id, role="victim")
        created = await kube.workflows.create(ns, body)
        victims.append(
            Victim(ARGO_WORKFLOW, ns, name, created["metadata"]["uid"], run_id, running, created)
        )
    for running in (True, False):
        name = f"{'running' if running else 'finished'}-job"
        body, status = job_body(name, running=running)
        created = await objects.create(JOB, ns, body)
        created["status"] = status
        created = await objects.replace_status(JOB, ns, name, created)
        victims.append(Victim(JOB, ns, name, created["metadata"]["uid"], None, running, created))

    nc = await connect(module_nats.url)
    js = nc.jetstream()
    stop = asyncio.Event()
    port = free_port()
    # `lapse up` without the watcher (the session's API server holds other tests' objects):
    # the victims are planned by the run events the watcher would publish.
    pipeline = Pipeline(config, nats_url=module_nats.url, watch=False, listen=f"127.0.0.1:{port}")
    running_pipeline = asyncio.create_task(pipeline.run(stop))
    await asyncio.wait_for(pipeline.ready.wait(), timeout=60)
    shells: dict[str, httpx.AsyncClient] = {}
    functions: list[FunctionShell] = []
    try:
        store = NatsScheduleStore(js, STREAMS)
        for victim in victims:
            if not victim.running:
                await plan_as_the_watcher(js, victim.body)
        for i, run_id in enumerate(orphan_ids):
            # Rows whose Workflow is gone, with the database deadline lapse stored an hour away
            # (as `lapse reconcile` leaves it).
            uid = str(uuid.uuid4())
            victims.append(Victim(None, ns, f"gone-{i}", uid, run_id, False))
            run = RunRef(
                engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
                namespace=ns, name=f"gone-{i}", uid=uid, phase="Succeeded", kfp_run_id=run_id,
                labels={KFP_RUN_ID_LABEL: run_id},
                finished_at=datetime.now(UTC) - timedelta(days=1),
            )  # fmt: skip
            deadline = datetime.now(UTC) + timedelta(hours=1)
            due = CleanupDue(
                run=run, target=Target.DATABASE, deadline=deadline, policy="kfp-runs",
                scheduled_at=datetime.now(UTC),
            )  # fmt: skip
            await store.put(
                Target.DATABASE,
                uid,
                deadline,
                build_event(EventType.CLEANUP_DUE, source="/lapse/ttl-planner", data=due),
                provenance=Provenance.CLAIMED,
            )

        stored: dict[tuple[Target, str], datetime] = {}

        async def all_planned() -> bool:
            for victim in victims:
                if victim.running:
                    continue
                targets = [Target.DATABASE] if victim.kind is None else list(PLANNED)
                if victim.kfp_run_id is None:
                    targets = [Target.KUBERNETES]
                for target in targets:
                    pending = await store.get(target, victim.uid)
                    if pending is None:
                        return False
                    stored[(target, victim.uid)] = pending.deadline
            return True

        await wait_for(all_planned, timeout=60, interval=0.2)
        assert all(d > datetime.now(UTC) + timedelta(minutes=50) for d in stored.values()), stored

        env = {"LAPSE_CONFIG": str(path)}
        for name in ("ttl-planner", "object-reaper", "row-reaper"):
            function = FunctionShell(name)
            function.start(env)
            await function.started()
            assert function.ready() == (True, "ready"), function.ready()
            functions.append(function)
            transport = httpx.ASGITransport(app=ASGIApplication(function))
            shells[name] = httpx.AsyncClient(transport=transport, base_url=f"http://{name}")
        yield World(
            path, config, ns, nc, js, kube, objects, kfp_database, victims,
            f"http://127.0.0.1:{port}/", shells, stored,
        )  # fmt: skip
    finally:
        for client in shells.values():
            await client.aclose()
        for function in functions:
            function.stop()
        stop.set()
        await asyncio.wait_for(running_pipeline, 60)  # raises if the pipeline crashed
        await nc.close()
        await engine.dispose()


# --- the forgeries ------------------------------------------------------------------------

NOW = datetime.now(UTC)
PAST_FINISH = st.one_of(
    st.none(),
    st.just(datetime(2000, 1, 1, tzinfo=UTC)),
    st.integers(1, 3650 * 86400).map(lambda s: NOW - timedelta(seconds=s)),
)
TTL_CLAIMS: list[dict[str, str]] = [
    {},
    {"lapse.dev/ttl": "1s"},
    {"lapse.dev/ttl": "0s"},
    {"lapse.dev/expires": "2000-01-01T00:00:00Z"},
    {"lapse.dev/keep": "false", "lapse.dev/ttl": "1s"},
]


@st.composite
def forged_runs(draw: st.DrawFn, victims: list[Victim], *, kfp_ids: list[str]) -> RunRef:
    """A run ref naming a victim (its uid or a random one), claiming whatever helps."""
    victim = draw(st.sampled_from(victims))
    uid = draw(st.one_of(st.just(victim.uid), st.uuids().map(str)))
    kfp_run_id = draw(
        st.one_of(
            st.just(victim.kfp_run_id),
            st.sampled_from(kfp_ids) if kfp_ids else st.none(),
            st.uuids().map(str),
        )
    )
    labels = {"role": draw(st.sampled_from(["victim", "control"]))}
    if kfp_run_id is not None:
        labels[KFP_RUN_ID_LABEL] = kfp_run_id
    return RunRef(
        engine=victim.engine,
        api_version=victim.api_version,
        kind=victim.kind_name,
        namespace=victim.namespace,
        name=victim.name,
        uid=uid,
        resource_version=draw(st.sampled_from([None, "1", "999999999"])),
        phase=draw(st.sampled_from(["Succeeded", "Failed", "Error", "Complete"])),
        finished_at=draw(PAST_FINISH),
        labels=labels,
        annotations=draw(st.sampled_from(TTL_CLAIMS)),
        kfp_run_id=kfp_run_id,
    )


def claimed(event: BaseCloudEvent, claim: bool) -> BaseCloudEvent:
    """The event, with the attribute by which a sender claims lapse read it itself."""
    if not claim:
        return event
    return CloudEvent(
        attributes={**event.get_attributes(), OBSERVED_EXTENSION: "apiserver"},
        data=event.get_data(),
    )


@st.composite
def forged_dues(
    draw: st.DrawFn, victims: list[Victim], *, targets: list[Target], kfp_ids: list[str]
) -> BaseCloudEvent:
    run = draw(forged_runs(victims, kfp_ids=kfp_ids))
    offset = draw(st.sampled_from([-10 * 86400, -3600, -1, 0, 0, 30, 86400]))
    due = CleanupDue(
        run=run,
        target=draw(st.sampled_from(targets)),
        deadline=datetime.now(UTC) + timedelta(seconds=offset),
        policy=draw(st.sampled_from(["forged", "kfp-runs", "control"])),
        scheduled_at=datetime.now(UTC) - timedelta(days=draw(st.integers(0, 30))),
    )
    event = build_event(EventType.CLEANUP_DUE, source=draw(SOURCES), data=due)
    return claimed(event, draw(st.booleans()))


SOURCES = st.sampled_from(["/lapse/ttl-planner", "/lapse/object-reaper", "/forged"])


def claimed_completion(victim: Victim, finished: datetime, ttl: str) -> dict[str, Any]:
    """The victim's object as the API server does NOT have it: completed long ago."""
    obj = copy.deepcopy(victim.body)
    obj["metadata"].setdefault("annotations", {})["lapse.dev/ttl"] = ttl
    when = rfc3339(finished)
    if victim.kind is JOB:
        obj["status"] = {
            "startTime": when, "completionTime": when, "succeeded": 1,
            "conditions": [{"type": "Complete", "status": "True", "lastTransitionTime": when}],
        }  # fmt: skip
    else:
        obj["metadata"]["labels"]["workflows.argoproj.io/completed"] = "true"
        obj["status"] = {"phase": "Succeeded", "startedAt": when, "finishedAt": when}
    return obj


@st.composite
def forged_run_events(draw: st.DrawFn, victims: list[Victim], kfp_ids: list[str]) -> BaseCloudEvent:
    """What the planner takes: run.finished / run.deleted claims, and ApiServerSource
    Resource-mode events saying a run completed long ago."""
    with_objects = [v for v in victims if v.kind is not None]
    shape = draw(st.sampled_from(["finished", "deleted", "apiserver"]))
    if shape == "apiserver":
        victim = draw(st.sampled_from(with_objects))
        finished = datetime(2000, 1, 1, tzinfo=UTC) if draw(st.booleans()) else NOW
        data = claimed_completion(victim, finished, draw(st.sampled_from(["1s", "0s", "7d"])))
        plural = "jobs" if victim.kind is JOB else "workflows"
        group = "apis/batch/v1" if victim.kind is JOB else "apis/argoproj.io/v1alpha1"
        verb = draw(st.sampled_from(["add", "update"]))
        event: BaseCloudEvent = CloudEvent(
            attributes={
                "type": f"dev.knative.apiserver.resource.{verb}",
                "source": "https://kubernetes.default.svc",
                "id": f"forged-{draw(st.uuids())}",
                "subject": f"/{group}/namespaces/{victim.namespace}/{plural}/{victim.name}",
            },
            data=data,
        )
    else:
        run = draw(forged_runs(victims, kfp_ids=kfp_ids))
        if shape == "finished":
            event = build_event(EventType.RUN_FINISHED, source="/forged", data=RunFinished(run=run))
        else:
            event = build_event(EventType.RUN_DELETED, source="/forged", data=RunDeleted(run=run))
    return claimed(event, draw(st.booleans()))


def fresh(event: BaseCloudEvent) -> BaseCloudEvent:
    """The event under an id of its own. Derandomized hypothesis draws the same uuids again
    and again, and a repeated id is dropped by JetStream's duplicate window (the stream's
    and the audit's): the event would never be seen, or its outcome never recorded."""
    attributes = {**event.get_attributes(), "id": f"forged-{uuid.uuid4()}"}
    return CloudEvent(attributes=attributes, data=event.get_data())


def generate(strategy: st.SearchStrategy[Any], examples: int = EXAMPLES) -> list[Any]:
    found: list[Any] = []

    @settings(
        max_examples=examples,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(strategy)
    def collect(example: Any) -> None:
        found.append(example)

    collect()
    return found[:examples]


# --- the checks ---------------------------------------------------------------------------


async def post(
    http: httpx.AsyncClient, url: str, event: BaseCloudEvent, *, binary: bool
) -> httpx.Response:
    message = to_binary_event(event) if binary else to_structured_event(event)
    return await http.post(url, headers=message.headers, content=message.body)


async def audit(js: JetStreamContext) -> dict[str, dict[str, Any]]:
    """Every audit record, by event id: its type and payload."""
    records: dict[str, dict[str, Any]] = {}
    info = await js.stream_info(STREAMS.audit)
    last = info.state.last_seq
    seq = info.state.first_seq
    while seq and seq <= last:
        try:
            msg = await js.get_msg(STREAMS.audit, seq)
        except NotFoundError:  # a gap
            seq += 1
            continue
        event = from_nats(dict(msg.headers or {}), msg.data or b"")
        data = event.get_data()
        payload = data if isinstance(data, dict) else json.loads(data or b"{}")
        records[event.get_id()] = {"type": event.get_type(), **payload}
        seq += 1
    return records


def ending(records: dict[str, dict[str, Any]], event_id: str) -> str | None:
    """How the due event `event_id` ended: its outcome, `failed`, or None (not yet)."""
    completed = records.get(outcome_id(event_id, EventType.CLEANUP_COMPLETED))
    if completed is not None:
        return str(completed["outcome"])
    if outcome_id(event_id, EventType.CLEANUP_FAILED) in records:
        return "failed"
    return None


async def drained(js: JetStreamContext) -> bool:
    """Every message on a route's subject has been answered by the dispatcher."""
    for route in load_routes():
        try:
            info = await js.consumer_info(route.stream(STREAMS), f"lapse-{route.name}")
        except Exception:
            continue  # a route whose function is not running here
        if info.num_pending or info.num_ack_pending:
            return False
    return True


async def control_run_deleted(world: World) -> None:
    """Something that would have happened: a run due in a second, object and rows, is
    deleted while the forgeries are being answered. Until it is, nothing is concluded."""
    world.controls += 1
    run_id = str(uuid.uuid4())
    engine = create_engine(world.db.url)
    try:
        async with engine.begin() as conn:
            await insert_kfp_runs(conn, [run_id], namespace=world.namespace)
        name = f"control-{world.controls}"
        body = workflow_body(name, running=False, kfp_run_id=run_id, role="control")
        created = await world.kube.workflows.create(world.namespace, body)
        await plan_as_the_watcher(world.js, created)

        async def gone() -> bool:
            if await world.kube.workflows.get(world.namespace, name) is not None:
                return False
            async with engine.connect() as conn:
                return sum((await kfp_counts(conn, run_id)).values()) == 0

        await wait_for(gone, timeout=90, interval=0.2)
    finally:
        await engine.dispose()


async def nothing_deleted(world: World) -> None:
    """Every victim, counted on the real servers; no stored deadline came earlier."""
    engine = create_engine(world.db.url)
    try:
        async with engine.connect() as conn:
            for victim in world.victims:
                if victim.kfp_run_id is not None:
                    rows = await kfp_counts(conn, victim.kfp_run_id)
                    assert rows == FULL_ROWS, f"rows of {victim} were deleted: {rows}"
    finally:
        await engine.dispose()
    for victim in world.victims:
        if victim.kind is not None:
            obj = await world.objects.get(victim.kind, victim.namespace, victim.name)
            assert obj is not None, f"{victim} was deleted"
            assert obj["metadata"]["uid"] == victim.uid
            assert obj["metadata"].get("deletionTimestamp") is None, f"{victim} is being deleted"
    store = NatsScheduleStore(world.js, STREAMS)
    for (target, uid), deadline in world.stored.items():
        now = await store.get(target, uid)
        assert now is not None and now.deadline >= deadline, (target, uid, now, deadline)


async def ended(world: World, due_ids: list[str]) -> dict[str, str]:
    """Once the dispatcher has answered everything: how each due event ended. Each must
    have ended, harmlessly."""
    await wait_for(lambda: drained(world.js), timeout=120, interval=0.2)

    async def all_ended() -> bool:
        records = await audit(world.js)
        return all(ending(records, i) is not None for i in due_ids)

    try:
        await wait_for(all_ended, timeout=60, interval=0.5)
    finally:
        records = await audit(world.js)
        ends = {i: str(ending(records, i)) for i in due_ids}
        missing = [i for i, e in ends.items() if e == "None"]
        assert not missing, f"{len(missing)} forged due events never ended: {missing[:5]}"
    assert set(ends.values()) <= HARMLESS | {"failed"}, Counter(ends.values())
    return ends


async def settle(world: World, due_ids: list[str]) -> dict[str, str]:
    """After the control run is gone: every forged due event ended harmlessly, and nothing
    was deleted."""
    await control_run_deleted(world)
    ends = await ended(world, due_ids)
    await nothing_deleted(world)
    return ends


# --- the entrances ------------------------------------------------------------------------


async def test_forged_pushes_to_the_ingress_delete_nothing(world: World) -> None:
    """`lapse up`'s ingress: run claims are stored and planned from the API server's object;
    due events are refused at the door (4xx, recorded). Every answer is 2xx or 4xx."""
    kfp = world.kfp_ids
    examples = generate(
        st.one_of(
            forged_run_events(world.victims, kfp),
            forged_dues(world.victims, targets=list(PLANNED), kfp_ids=kfp),
        )
    )
    events = [fresh(e) for e in examples]
    answers: Counter[int] = Counter()
    why: Counter[tuple[str, int, str]] = Counter()
    async with httpx.AsyncClient() as http:
        for i, event in enumerate(events):
            answer = await post(http, world.ingress_url, event, binary=i % 2 == 0)
            answers[answer.status_code] += 1
            why[(str(event.get_type()), answer.status_code, answer.text[:70])] += 1
    assert {code // 100 for code in answers} <= {2, 4}, answers
    # Due events are no input of the ingress: the adapters refuse them (400, recorded).
    assert answers[202] > 0 and answers[400] > 0, why
    refused = [e.get_id() for e in events if e.get_type() == EventType.CLEANUP_DUE]
    await settle(world, [])
    # Each refusal at the door is recorded with the event it refused.
    records = await audit(world.js)
    originals = {
        str(r["original"]["attributes"].get("id"))
        for r in records.values()
        if r.get("stage") == "ingress" and r.get("original")
    }
    assert set(refused) <= originals, Counter((r["type"], r.get("stage")) for r in records.values())
    print(f"\ningress: {len(events)} pushes, answers {dict(sorted(answers.items()))}")


async def test_forged_events_to_each_function_over_http_delete_nothing(world: World) -> None:
    """Each function as Knative serves it: a 202 means handled, and each due event's
    outcome is on the audit stream; 503 only for a transient wait (none here)."""
    kfp = world.kfp_ids
    cases = generate(
        st.one_of(
            forged_run_events(world.victims, kfp).map(lambda e: ("ttl-planner", e)),
            forged_dues(world.victims, targets=[Target.KUBERNETES], kfp_ids=kfp).map(
                lambda e: ("object-reaper", e)
            ),
            forged_dues(world.victims, targets=[Target.DATABASE], kfp_ids=kfp).map(
                lambda e: ("row-reaper", e)
            ),
        )
    )
    answers: Counter[tuple[str, int]] = Counter()
    cases = [(function, fresh(event)) for function, event in cases]
    for i, (function, event) in enumerate(cases):
        code = (await post(world.shells[function], "/", event, binary=i % 2 == 0)).status_code
        answers[(function, code)] += 1
        assert code == 202, (function, code, event)
    due_ids = [e.get_id() for f, e in cases if f != "ttl-planner"]
    ends = await settle(world, due_ids)
    print(f"\nfunctions: {dict(answers)}; due outcomes {dict(Counter(ends.values()))}")


async def test_forged_pushes_without_the_token_are_401_and_store_nothing(
    world: World, tmp_path: Path
) -> None:
    """The ingress `lapse up` serves beyond loopback (a bearer token configured): forged
    pushes without it, or with a wrong one, are 401 before their body is read; nothing is
    stored, and each refusal is recorded (without anything the sender sent)."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    config = world.config.model_copy(
        update={"ingress": world.config.ingress.model_copy(update={"token_file": token_file})}
    )
    ingress = await nats_ingress(world.js, config, listen="0.0.0.0:8080")
    events = [fresh(e) for e in generate(forged_run_events(world.victims, world.kfp_ids), 40)]
    stored_before = (await world.js.stream_info(STREAMS.events)).state.messages
    records_before = len(await audit(world.js))
    transport = httpx.ASGITransport(app=ingress)
    async with httpx.AsyncClient(transport=transport, base_url="http://lapse") as http:
        for i, event in enumerate(events):
            message = to_binary_event(event)
            headers = dict(message.headers)
            if i % 2:
                headers["authorization"] = "Bearer s3cret-tokeN"
            answer = await http.post("/", headers=headers, content=message.body)
            assert answer.status_code == 401, answer.text
    await ingress.flush()
    assert (await world.js.stream_info(STREAMS.events)).state.messages == stored_before
    records = await audit(world.js)
    unauthorized = [r for r in records.values() if str(r.get("reason", "")).startswith("401")]
    assert len(records) - records_before == len(events) == len(unauthorized)
    assert all(r.get("original") is None for r in unauthorized)
    await nothing_deleted(world)


@dataclass(frozen=True)
class NatsEntrance:
    """Who publishes, and what such a publisher may be expected to write.

    `publish(subject, headers, body)` as that identity: True when the server stored it,
    False when the server refused it (a permissions violation). `writes_stored_state`:
    whether it may write lapse's stored schedules (`lapse.due.*`, `lapse.sched.*`), as
    anyone may on a plain server. Where it may, a database-target message there IS lapse's
    stored proof, so database forgeries there name only Running or unknown runs. A
    credentialed variant (False) sends them all, and the test asserts the server refuses
    every publish on those subjects (nothing stored, nothing to end) while what it may
    publish (`lapse.events.*`, if anything) still deletes nothing."""

    name: str
    publish: Callable[[str, dict[str, str], bytes], Awaitable[bool]]
    writes_stored_state: bool


def plain_nats(js: JetStreamContext) -> NatsEntrance:
    async def publish(subject: str, headers: dict[str, str], body: bytes) -> bool:
        await js.publish(subject, body, headers=headers)
        return True

    return NatsEntrance("plain", publish, writes_stored_state=True)


def stored_state(subject: str) -> bool:
    return subject.startswith(("lapse.due.", "lapse.sched."))


def is_schedule(subject: str) -> bool:
    return subject.startswith("lapse.sched.")


def unmarked(event: BaseCloudEvent) -> tuple[dict[str, str], bytes]:
    """The event as a NATS message without lapse's mark (and a fresh Nats-Msg-Id)."""
    message = to_nats(event)
    headers = {k: v for k, v in message.headers.items() if k != OBSERVED_HEADER}
    return headers, message.body


async def test_forged_messages_on_the_nats_subjects_delete_nothing(world: World) -> None:
    entrance = plain_nats(world.js)
    kfp = world.kfp_ids
    if entrance.writes_stored_state:
        # Rows whose stored proof such a publisher could write itself: left to the
        # credentialed variant. Running runs' rows are kept by the database's own word.
        database_victims = [v for v in world.victims if v.running] or world.victims
        database_kfp = [v.kfp_run_id for v in database_victims if v.kfp_run_id]
    else:
        database_victims, database_kfp = world.victims, kfp

    @st.composite
    def messages(draw: st.DrawFn) -> tuple[str, BaseCloudEvent]:
        way = draw(st.sampled_from(["events", "due", "sched"]))
        if way == "events":
            event = draw(forged_run_events(world.victims, kfp))
            return event_subject(str(event.get_type())), event
        target = draw(st.sampled_from(list(PLANNED)))
        if target is Target.DATABASE:
            victims, ids = database_victims, database_kfp
        else:
            victims, ids = world.victims, kfp
        event = draw(forged_dues(victims, targets=[target], kfp_ids=ids))
        uid = CleanupDue.model_validate(event.get_data()).run.uid
        subject = due_subject(target, uid) if way == "due" else schedule_subject(target, uid)
        return subject, event

    batch = [(subject, fresh(event)) for subject, event in generate(messages())]
    # Schedules go last, one per subject: a schedule put on a subject replaces the one
    # pending there (the roll-up lapse's store relies on), so one forged earlier, or one a
    # reaper puts while handling a forged due for that run, would never fire.
    direct = [(subject, event) for subject, event in batch if not is_schedule(subject)]
    schedules = {subject: event for subject, event in batch if is_schedule(subject)}
    due_ids = []
    refused = 0
    for subject, event in direct:
        headers, body = unmarked(event)
        if not await entrance.publish(subject, headers, body):
            assert stored_state(subject) and not entrance.writes_stored_state, subject
            refused += 1
        elif event.get_type() == EventType.CLEANUP_DUE:
            due_ids.append(event.get_id())
    await ended(world, due_ids)
    now = datetime.now(UTC)
    for subject, event in schedules.items():
        # A schedule that fires at once: its due message is the forged event.
        _, _, target, uid = subject.split(".", 3)
        headers, body = unmarked(event)
        headers = {**headers, **schedule_headers(now, due_subject(Target(target), uid))}
        headers.pop("Nats-Msg-Id", None)
        if await entrance.publish(subject, headers, body):
            assert entrance.writes_stored_state, subject
            due_ids.append(event.get_id())
        else:
            refused += 1
    ends = await settle(world, due_ids)
    ways = Counter(s.split(".")[1] for s, _ in direct)
    ways["sched"] = len(schedules)
    if not entrance.writes_stored_state:
        assert refused == ways["due"] + ways["sched"]
    print(f"\nnats ({entrance.name}): {dict(ways)}; due outcomes {dict(Counter(ends.values()))}")


async def moved_later(world: World, name: str) -> dict[Target, BaseCloudEvent]:
    """A run whose due events fired (object: rescheduled, its TTL extended; rows: kept,
    still running), and whose schedules then moved later (finished under a longer
    policy): the real due events, captured from the stream. A victim from then on."""
    js, ns = world.js, world.namespace
    run_id = str(uuid.uuid4())
    engine = create_engine(world.db.url)
    async with engine.begin() as conn:
        await insert_kfp_runs(conn, [run_id], namespace=ns)
        await conn.execute(
            update(run_details)
            .where(run_details.c["UUID"] == run_id)
            .values(FinishedAtInSec=0, State="RUNNING", Conditions="Running")
        )
    body = workflow_body(name, running=False, kfp_run_id=run_id, role="replay")
    created = await world.kube.workflows.create(ns, body)
    uid = created["metadata"]["uid"]
    # Planned from this version: both deadlines two seconds after it finished.
    await plan_as_the_watcher(js, created)
    # Then kept a week by its owner, and out of the short policy: the reaper finds this
    # version when the deadline fires (its DELETE held to the planned version gets a 409).
    kept = copy.deepcopy(created)
    kept["metadata"]["annotations"] = {"lapse.dev/ttl": "7d"}
    kept["metadata"]["labels"]["role"] = "victim"
    kept = await world.kube.workflows.replace(ns, name, kept)

    async def fired() -> dict[Target, BaseCloudEvent] | None:
        captured = {}
        records = await audit(js)
        for target in PLANNED:
            try:
                msg = await js.get_last_msg(STREAMS.schedule, due_subject(target, uid))
            except NotFoundError:
                return None
            event = from_nats(dict(msg.headers or {}), msg.data or b"")
            if ending(records, event.get_id()) is None:
                return None
            captured[target] = event
        return captured

    captured = await wait_for(fired, timeout=60, interval=0.2)
    records = await audit(js)
    assert ending(records, captured[Target.KUBERNETES].get_id()) == "rescheduled"
    assert ending(records, captured[Target.DATABASE].get_id()) == "kept"  # still running
    # The run finishes now, under the longer policy: its rows' deadline moves an hour on.
    async with engine.begin() as conn:
        await conn.execute(
            update(run_details)
            .where(run_details.c["UUID"] == run_id)
            .values(
                FinishedAtInSec=int(datetime.now(UTC).timestamp()),
                State="SUCCEEDED",
                Conditions="Succeeded",
            )
        )
    await engine.dispose()
    await plan_as_the_watcher(js, kept)
    store = NatsScheduleStore(js, STREAMS)

    async def moved() -> bool:
        for target in PLANNED:
            pending = await store.get(target, uid)
            if pending is None or pending.fired:
                return False
            world.stored[(target, uid)] = pending.deadline
        return True

    await wait_for(moved, timeout=30, interval=0.2)
    assert min(world.stored[(t, uid)] for t in PLANNED) > datetime.now(UTC) + timedelta(minutes=50)
    world.victims.append(Victim(ARGO_WORKFLOW, ns, name, uid, run_id, False, kept))

    return captured


async def test_replayed_due_events_after_the_schedule_moved_later_delete_nothing(
    world: World,
) -> None:
    """Real due events, captured from the stream after they fired, sent again once their
    schedule moved later: through the ingress, to each reaper over HTTP, and on their NATS
    due subjects (without lapse's mark). The object's TTL was extended and its rows' run
    finished later under a longer policy: nothing is due, and nothing is deleted."""
    js = world.js
    captured = await moved_later(world, "replayed")
    uid = captured[Target.KUBERNETES].get_data()["run"]["uid"]  # type: ignore[index]
    answers: Counter[tuple[str, int]] = Counter()
    due_ids = []
    async with httpx.AsyncClient() as http:
        for target, event in captured.items():
            for binary in (True, False):
                again = fresh(event)
                code = (await post(http, world.ingress_url, again, binary=binary)).status_code
                answers[("ingress", code)] += 1
                assert code // 100 == 4, code
                function = "object-reaper" if target is Target.KUBERNETES else "row-reaper"
                again = fresh(event)
                reply = await post(world.shells[function], "/", again, binary=binary)
                answers[(function, reply.status_code)] += 1
                assert reply.status_code == 202, reply.text
                due_ids.append(again.get_id())
    entrance = plain_nats(js)
    for target, event in captured.items():
        if target is Target.DATABASE and entrance.writes_stored_state:
            continue  # what this publisher writes there IS the stored proof: see below
        again = fresh(event)
        headers, body = unmarked(again)
        await entrance.publish(due_subject(target, uid), headers, body)
        due_ids.append(again.get_id())
    ends = await settle(world, due_ids)
    print(f"\nreplays: {dict(answers)}; outcomes {dict(Counter(ends.values()))}")


async def test_a_rows_due_event_replayed_on_its_subject_after_it_moved_later_deletes_nothing(
    world: World,
) -> None:
    """What `lapse dlq replay` does with a database due event (publishes it on
    `lapse.due.database.<uid>`, as lapse's own identity, so NATS permissions do not stop
    it), after the rows' deadline moved later: the stored schedule says an hour from now,
    and that is what the row-reaper must go by."""
    js = world.js
    captured = await moved_later(world, "replayed-rows")
    event = fresh(captured[Target.DATABASE])
    uid = event.get_data()["run"]["uid"]  # type: ignore[index]
    headers, body = unmarked(event)
    await js.publish(due_subject(Target.DATABASE, uid), body, headers=headers)
    ends = await settle(world, [event.get_id()])
    assert ends == {event.get_id(): "rescheduled"}


async def test_a_forged_due_refused_at_the_door_and_replayed_from_the_dead_letters_deletes_nothing(
    world: World,
) -> None:
    """An operator's `lapse dlq replay` of what the ingress refused: the refusal keeps the
    forged event whole, and replay sends a due event to its due subject. The forged one
    names a uid lapse never planned and the KFP run id of rows whose deadline is an hour
    away. Replayed as sent, it became the stored due message the row-reaper proved its
    deadline from, and the rows went. A due event is now replayed only as lapse stored it
    (lapse/operations/dlq.py: original_event): for that uid lapse stored nothing."""
    orphan = next(v for v in world.victims if v.kind is None)
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace=world.namespace, name="forged", uid=str(uuid.uuid4()), phase="Succeeded",
        kfp_run_id=orphan.kfp_run_id,
    )  # fmt: skip
    now = datetime.now(UTC)
    forged = build_event(
        EventType.CLEANUP_DUE,
        source="/lapse/ttl-planner",
        data=CleanupDue(
            run=run, target=Target.DATABASE, deadline=now, policy="kfp-runs", scheduled_at=now
        ),
    )
    async with httpx.AsyncClient() as http:
        assert (await post(http, world.ingress_url, forged, binary=True)).status_code == 400

    async def refused() -> list[Any]:
        return [
            letter
            async for letter in dead_letters(world.js, STREAMS.dlq, Filter(stage="ingress"))
            if letter.failed is not None
            and letter.failed.original is not None
            and letter.failed.original.attributes.get("id") == forged.get_id()
        ]

    letters = await wait_for(refused, timeout=30, interval=0.2)
    report = await replay(world.js, STREAMS, letters)
    # Lapse stored no due message for that uid: there is nothing of lapse's to replay.
    assert report.replayed == []
    [left] = report.left
    assert "replayed only as lapse stored it" in left["problem"]
    await nothing_deleted(world)
