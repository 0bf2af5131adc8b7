"""One workflow through the whole pipeline, seen through its telemetry.

Real NATS, kube-apiserver and PostgreSQL; the Pipeline runs in this process with in-memory
exporters. The traces must form one connected picture (the planner's decision, the
schedule, the due processing linked back to it, both reapers with their client calls), and
the metrics must equal what really happened on the API server and in the database.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, SpanKind

from lapse import telemetry
from lapse.config import Streams, load_config
from lapse.edges.database import create_engine
from lapse.edges.nats import connect
from lapse.edges.publishing import NatsPublisher
from lapse.edges.streams import count_messages
from lapse.embedded.nats import EmbeddedNats
from lapse.events.adapters import adapt_workflow
from lapse.events.builder import build_event
from lapse.events.models import RunFinished
from lapse.events.subjects import SCHEDULE_PREFIX
from lapse.events.types import EventType
from lapse.functions.trust import Provenance
from lapse.operations.audit import audit_events
from lapse.runtime.pipeline import Pipeline
from lapse.telemetry import names
from tests.conftest import KubeStack
from tests.e2e.test_lapse_up import finished_workflow
from tests.kfp_schema import create_kfp_tables, insert_kfp_runs, kfp_counts
from tests.stack import Database, scratch_database, wait_for

STREAMS = Streams()
GET_ONE = "GET /apis/argoproj.io/v1alpha1/namespaces/{namespace}/workflows/{name}"
DELETE_ONE = "DELETE /apis/argoproj.io/v1alpha1/namespaces/{namespace}/workflows/{name}"


@pytest.fixture(scope="module")
async def kfp_database() -> AsyncIterator[Database]:
    async with scratch_database("postgresql") as db:
        engine = create_engine(db.url)
        await create_kfp_tables(engine)
        await engine.dispose()
        yield db


@pytest.fixture
def memory() -> Iterator[telemetry.InMemoryTelemetry]:
    recorded = telemetry.install_in_memory()
    yield recorded
    recorded.handle.shutdown()
    telemetry.reset()


class Metrics:
    def __init__(self, recorded: telemetry.InMemoryTelemetry) -> None:
        self.points: dict[str, list[Any]] = {}
        data = recorded.reader.get_metrics_data()
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    self.points.setdefault(metric.name, []).extend(metric.data.data_points)

    def value(self, name: str, **attributes: object) -> Any:
        """The one point of `name` whose attributes include these (dots as underscores)."""
        wanted = {key.replace("_", "."): value for key, value in attributes.items()}
        matching = [
            point
            for point in self.points.get(name, [])
            if all(dict(point.attributes or {}).get(k) == v for k, v in wanted.items())
        ]
        assert len(matching) == 1, f"{name} {attributes}: {matching}"
        return matching[0]


class Picture:
    """The finished spans, indexed the way the assertions read them."""

    def __init__(self, spans: tuple[ReadableSpan, ...]) -> None:
        self.spans = spans

    def named(self, name: str, **attributes: object) -> list[ReadableSpan]:
        wanted = {key.replace("__", "."): value for key, value in attributes.items()}
        return [
            span
            for span in self.spans
            if span.name == name
            and all(dict(span.attributes or {}).get(k) == v for k, v in wanted.items())
        ]

    def one(self, name: str, **attributes: object) -> ReadableSpan:
        (span,) = self.named(name, **attributes)
        return span

    def trace(self, span: ReadableSpan) -> list[ReadableSpan]:
        assert span.context is not None
        return [s for s in self.spans if s.context and s.context.trace_id == span.context.trace_id]

    def children(self, span: ReadableSpan) -> list[ReadableSpan]:
        assert span.context is not None
        return [s for s in self.spans if s.parent and s.parent.span_id == span.context.span_id]

    def assert_connected(self, root: ReadableSpan) -> None:
        """One root, and every other span of its trace hangs under a span of that trace."""
        spans = self.trace(root)
        ids = {s.context.span_id for s in spans if s.context}
        assert [s for s in spans if s.parent is None] == [root]
        assert all(s.parent is not None and s.parent.span_id in ids for s in spans if s is not root)


def same(child_parent: SpanContext | None, span: ReadableSpan) -> bool:
    """Whether `child_parent` (a parent or link context) names `span`."""
    return (
        child_parent is not None
        and span.context is not None
        and (child_parent.trace_id, child_parent.span_id)
        == (span.context.trace_id, span.context.span_id)
    )


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def write_config(path: Path, kube: KubeStack, db: Database) -> Path:
    path.write_text(
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        f"database: {{url: '{db.url}', targets: {{kfp: {{enabled: true}}}}}}\n"
        "policies:\n"
        "  - name: kfp-runs\n"
        "    match: {has_labels: [pipeline/runid]}\n"
        "    kubernetes: {ttl: 3s}\n"
        "    database: {ttl: 6s}\n"
        "safety: {namespaces: {include: ['*']}}\n"
    )
    return path


async def test_one_workflow_is_one_connected_picture_and_the_metrics_are_true(
    tmp_path: Path,
    own_nats: EmbeddedNats,
    kube: KubeStack,
    kfp_database: Database,
    memory: telemetry.InMemoryTelemetry,
) -> None:
    config = load_config(write_config(tmp_path / "lapse.yaml", kube, kfp_database), env={})
    # No watcher: the session's cluster holds other tests' workflows; this one is
    # published the way the watcher publishes it.
    pipeline = Pipeline(config, nats_url=own_nats.url, watch=False, backlog_interval=0.2)
    stop = asyncio.Event()
    running = asyncio.create_task(pipeline.run(stop))
    await asyncio.wait_for(pipeline.ready.wait(), timeout=60)
    nc = await connect(own_nats.url)
    js = nc.jetstream()
    engine = create_engine(kfp_database.url)
    try:
        ns = kube.namespace(f"otel-{uuid.uuid4().hex[:6]}")
        run_id = str(uuid.uuid4())
        async with engine.begin() as conn:
            await insert_kfp_runs(conn, [run_id], namespace=ns)
        labels = {"pipeline/runid": run_id, "pipeline/persistedFinalState": "true"}
        created = await kube.workflows.create(ns, finished_workflow("traced", labels=labels))
        uid = created["metadata"]["uid"]
        finished = adapt_workflow(created)
        assert isinstance(finished, RunFinished)
        await NatsPublisher(js, STREAMS, provenance=Provenance.CLAIMED).publish(
            build_event(EventType.RUN_FINISHED, source="/lapse/watcher", data=finished)
        )

        async def pending_seen() -> bool:
            gauge = Metrics(memory).points.get(names.PENDING.name, [])
            return {(p.attributes[names.TARGET], p.value) for p in gauge} >= {
                ("kubernetes", 1),
                ("database", 1),
            }

        await wait_for(pending_seen, timeout=10, interval=0.1)

        async def object_gone() -> bool:
            return await kube.workflows.get(ns, "traced") is None

        async def rows_gone() -> bool:
            async with engine.connect() as conn:
                return sum((await kfp_counts(conn, run_id)).values()) == 0

        await wait_for(object_gone, timeout=60, interval=0.2)
        await wait_for(rows_gone, timeout=60, interval=0.2)

        async def both_outcomes_recorded() -> bool:
            done = Picture(memory.spans())
            return all(
                done.named(function, lapse__run__uid=uid, lapse__outcome="deleted")
                for function in ("object-reaper", "row-reaper")
            )

        await wait_for(both_outcomes_recorded, timeout=10, interval=0.1)

        async def backlog_drained() -> bool:
            gauge = Metrics(memory).points.get(names.PENDING.name, [])
            return bool(gauge) and all(point.value == 0 for point in gauge)

        await wait_for(backlog_drained, timeout=10, interval=0.1)
        pending_now = {
            target: await count_messages(js, STREAMS.schedule, f"{SCHEDULE_PREFIX}.{target}.>")
            for target in ("kubernetes", "database")
        }
        dead_letters = (await js.stream_info(STREAMS.dlq)).state.messages
        outcomes = [
            e async for e in audit_events(js, STREAMS.audit, event_type=EventType.CLEANUP_COMPLETED)
        ]
    finally:
        stop.set()
        await asyncio.wait_for(running, timeout=60)  # also flushes the spans
        await engine.dispose()
        await nc.close()

    picture = Picture(memory.spans())
    print("\n" + telemetry.render_trace_tree(picture.spans))

    # The planner's trace: from the publish to the decisions and the schedules they put.
    planner = picture.one("ttl-planner", lapse__run__uid=uid)
    assert attrs(planner)[names.RUN_NAMESPACE] == ns
    assert attrs(planner)[names.CE_TYPE] == EventType.RUN_FINISHED
    consumed = picture.one("process lapse.events.dev.lapse.run.finished.v1")
    assert consumed.kind is SpanKind.CONSUMER and same(planner.parent, consumed)
    published = picture.one("send lapse.events.dev.lapse.run.finished.v1")
    assert same(consumed.parent, published)
    picture.assert_connected(published)
    decisions = {}
    for target in ("kubernetes", "database"):
        decision = picture.one(f"schedule {target}", lapse__run__uid=uid)
        assert same(decision.parent, planner)
        assert attrs(decision)[names.SCHEDULE_ACTION] == "created"
        (put,) = [s for s in picture.children(decision) if s.kind is SpanKind.PRODUCER]
        assert put.name == f"send lapse.sched.{target}.*"
        assert attrs(put)[names.MESSAGING_DESTINATION] == f"lapse.sched.{target}.{uid}"
        assert attrs(put)[names.MESSAGING_SYSTEM] == "nats"
        decisions[target] = (decision, put)

    # Each due deadline: a new trace, linked to the decision (the due event's own
    # traceparent) and to the publish that put it (the NATS traceparent header).
    reapers = {"kubernetes": "object-reaper", "database": "row-reaper"}
    for target, function in reapers.items():
        decision, put = decisions[target]
        due = picture.one(f"process lapse.due.{target}.*")
        assert due.kind is SpanKind.CONSUMER and due.parent is None
        assert due.context is not None and decision.context is not None
        assert due.context.trace_id != decision.context.trace_id
        assert {
            (link.context.span_id, (link.attributes or {})[names.LINK_KIND]) for link in due.links
        } == {
            (decision.context.span_id, "creation"),
            (put.context.span_id, "hop"),  # type: ignore[union-attr]
        }
        assert attrs(due)[names.MESSAGING_DESTINATION] == f"lapse.due.{target}.{uid}"
        assert attrs(due)[names.MESSAGING_OPERATION_TYPE] == "process"
        assert attrs(due)[names.CE_TYPE] == EventType.CLEANUP_DUE
        assert attrs(due)[names.CE_SUBJECT] == f"{ns}/traced"
        reaper = picture.one(function, lapse__run__uid=uid)
        assert same(reaper.parent, due)
        expected = {
            names.RUN_NAMESPACE: ns, names.RUN_NAME: "traced", names.RUN_UID: uid,
            names.TARGET: target, names.OUTCOME: "deleted",
        }  # fmt: skip
        assert {key: attrs(reaper).get(key) for key in expected} == expected
        assert 0 <= attrs(reaper)[names.LATENESS] < 5
        picture.assert_connected(due)

    # The run event came without lapse's mark (a claim): the planner read the Workflow
    # before planning it, so the version its schedule carries is lapse's own read and the
    # reaper's one call is the DELETE held to it.
    planner_calls = [
        s for s in picture.children(picture.one("ttl-planner")) if s.kind is SpanKind.CLIENT
    ]
    assert [(s.name, attrs(s)[names.HTTP_STATUS]) for s in planner_calls] == [(GET_ONE, 200)]
    kube_calls = [
        s for s in picture.children(picture.one("object-reaper")) if s.kind is SpanKind.CLIENT
    ]
    assert [(s.name, attrs(s)[names.HTTP_STATUS]) for s in kube_calls] == [(DELETE_ONE, 200)]
    db_calls = [s for s in picture.children(picture.one("row-reaper")) if s.kind is SpanKind.CLIENT]
    assert {attrs(s)[names.DB_SYSTEM] for s in db_calls} == {"postgresql"}
    deleted_tables = {
        attrs(s).get(names.DB_COLLECTION) for s in db_calls if s.name.startswith("DELETE")
    }
    assert {"run_details", "run_metrics", "tasks", "resource_references"} <= deleted_tables

    # The outcome events name the reaper spans that made them: outcome -> trace.
    for outcome in outcomes:
        if outcome.get_subject() == f"{ns}/traced":
            trace_id, span_id = outcome.get_extension("traceparent").split("-")[1:3]
            (maker,) = [
                s for s in picture.spans if s.context and f"{s.context.span_id:016x}" == span_id
            ]
            assert maker.name in reapers.values()
            assert f"{maker.context.trace_id:032x}" == trace_id  # type: ignore[union-attr]
    assert len([o for o in outcomes if o.get_subject() == f"{ns}/traced"]) == 2

    # Metrics equal the ground truth.
    metrics = Metrics(memory)
    gone = {"kubernetes": 1, "database": 1}  # the object and the run's rows, checked above
    for target, count in gone.items():
        assert (
            metrics.value(names.DELETIONS.name, lapse_target=target, lapse_outcome="deleted").value
            == count
        )
        lateness = metrics.value(names.LATENESS_SECONDS.name, lapse_target=target)
        assert lateness.count == count
        assert 0 <= lateness.sum < 5 * count
    assert sum(p.value for p in metrics.points[names.DELETIONS.name]) == 2  # nothing else happened
    kube_per_deletion = metrics.value(
        names.DELETION_CALLS.name, lapse_target="kubernetes", lapse_api="kubernetes"
    )
    assert (kube_per_deletion.count, kube_per_deletion.sum) == (1, 1)  # the DELETE alone
    db_per_deletion = metrics.value(
        names.DELETION_CALLS.name, lapse_target="database", lapse_api="database"
    )
    assert db_per_deletion.sum == len(db_calls)
    created = [
        metrics.value(
            names.SCHEDULE_CHANGES.name, lapse_target=t, lapse_schedule_action="created"
        ).value
        for t in gone
    ]
    assert created == [1, 1]
    assert {
        p.attributes[names.TARGET]: p.value for p in metrics.points[names.PENDING.name]
    } == pending_now
    assert metrics.value(names.DLQ_DEPTH.name).value == dead_letters == 0
    assert metrics.value(names.KUBERNETES_REQUESTS.name, http_request_method="DELETE").value == 1
    durations = {
        p.attributes[names.FUNCTION]: p.count
        for p in metrics.points[names.HANDLER_DURATION.name]
        if p.attributes[names.HANDLER_RESULT] == "ok"
    }
    assert durations == {"ttl-planner": 1, "object-reaper": 1, "row-reaper": 1}
