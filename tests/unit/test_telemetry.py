"""lapse.telemetry without servers: the trace-shape rules, the handler's span and metrics,
the tree printout, and configuration from the environment."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cloudevents.core.base import BaseCloudEvent
from opentelemetry import context as otel_context
from opentelemetry.sdk.metrics.export import HistogramDataPoint, NumberDataPoint
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from lapse import telemetry
from lapse.events.builder import build_event
from lapse.events.models import CleanupCompleted, CleanupDue, CleanupFailed, RunFinished
from lapse.events.run import Engine, RunRef, Target
from lapse.events.types import EventType
from lapse.events.types import Outcome as CleanupOutcome
from lapse.functions import tracing
from lapse.functions.ports import RetryLater
from lapse.functions.row_reaper import (
    Counted,
    RowReaper,
    RunResult,
    RunRows,
    TargetSpec,
    Unavailable,
)
from lapse.functions.row_reaper.targets import kfp_target
from lapse.functions.trust import Trust
from lapse.telemetry import names
from lapse.telemetry.spans import delivery_parent, span_context_of, subject_template
from tests.fakes import FakeSchedules

DEADLINE = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def memory() -> Iterator[telemetry.InMemoryTelemetry]:
    recorded = telemetry.install_in_memory()
    yield recorded
    recorded.handle.shutdown()
    telemetry.reset()


def points(recorded: telemetry.InMemoryTelemetry, name: str) -> list[Any]:
    data = recorded.reader.get_metrics_data()
    assert data is not None
    return [
        point
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]


def context(trace_id: int, span_id: int) -> SpanContext:
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(1))


def traceparent(ids: SpanContext) -> str:
    return f"00-{ids.trace_id:032x}-{ids.span_id:016x}-{int(ids.trace_flags):02x}"


def run(uid: str = "0a0b0c0d-0000-4000-8000-000000000001") -> RunRef:
    return RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="team-a", name="wf-1", uid=uid, phase="Succeeded",
        finished_at=DEADLINE - timedelta(hours=1),
        labels={"pipeline/runid": "11111111-2222-4333-8444-555555555555"},
    )  # fmt: skip


def due_event(target: Target = Target.DATABASE, **trace: str) -> BaseCloudEvent:
    due = CleanupDue(run=run(), target=target, deadline=DEADLINE, policy="p", scheduled_at=DEADLINE)
    return build_event(EventType.CLEANUP_DUE, source="/test", data=due, **trace)  # type: ignore[arg-type]


# --- where a delivered event's span hangs -------------------------------------------------


def test_a_due_event_starts_a_new_trace_linked_to_where_it_was_scheduled() -> None:
    creation = context(1, 10)
    hop = context(1, 11)  # the schedule's publish, same trace as the planner's decision
    parent, links = delivery_parent("dev.lapse.cleanup.due.v1", hop, creation)
    assert parent is None
    assert [(link.context, dict(link.attributes or {})) for link in links] == [
        (hop, {names.LINK_KIND: "hop"}),
        (creation, {names.LINK_KIND: "creation"}),
    ]


def test_a_due_event_forwarded_after_the_delay_keeps_its_fresh_hop_as_parent() -> None:
    creation = context(1, 10)
    forwarder = context(2, 20)  # e.g. a NATS source that started a trace at due time
    parent, links = delivery_parent("dev.lapse.cleanup.due.v1", forwarder, creation)
    assert parent == forwarder
    assert [link.context for link in links] == [creation]


def test_other_events_continue_the_hop_and_link_their_creation() -> None:
    creation, hop = context(1, 10), context(1, 11)
    assert delivery_parent("dev.lapse.run.finished.v1", hop, creation)[0] == hop
    assert [link.context for link in delivery_parent("x", hop, creation)[1]] == [creation]
    # No hop context on the transport: the event's own context is the best parent.
    assert delivery_parent("dev.lapse.run.finished.v1", None, creation) == (creation, [])
    assert delivery_parent(None, None, None) == (None, [])


def test_invalid_traceparents_are_ignored() -> None:
    assert span_context_of(None) is None
    assert span_context_of("00-" + "0" * 32 + "-" + "1" * 16 + "-01") is None
    assert span_context_of("not a traceparent") is None
    parsed = span_context_of("00-" + "a" * 32 + "-" + "b" * 16 + "-01", "k=v")
    assert parsed is not None
    assert (parsed.trace_id, parsed.span_id) == (int("a" * 32, 16), int("b" * 16, 16))
    assert parsed.trace_state.get("k") == "v"


def test_subjects_with_a_uid_become_templates() -> None:
    assert subject_template("lapse.due.kubernetes.abc-123") == "lapse.due.kubernetes.*"
    assert subject_template("lapse.sched.database.abc-123") == "lapse.sched.database.*"
    audit = "lapse.audit.dev.lapse.cleanup.completed.v1"
    assert subject_template(audit) == audit


# --- creation context and the hop spans ---------------------------------------------------


def test_events_created_in_a_span_carry_it_and_outside_carry_nothing(
    memory: telemetry.InMemoryTelemetry,
) -> None:
    assert tracing.creation_context() == {}
    with telemetry.tracer().start_as_current_span("planner") as span:
        fields = tracing.creation_context()
    ids = span.get_span_context()
    assert fields["traceparent"] == traceparent(ids)
    event = build_event(EventType.RUN_FINISHED, source="/t", data=RunFinished(run=run()), **fields)
    assert event.get_extension("traceparent") == fields["traceparent"]


def test_send_span_hands_its_own_context_to_the_transport(
    memory: telemetry.InMemoryTelemetry,
) -> None:
    event = due_event(Target.KUBERNETES)
    with telemetry.send_span("lapse.sched.kubernetes.0a0b", event) as hop:
        pass
    (span,) = memory.spans()
    assert span.name == "send lapse.sched.kubernetes.*"
    assert span.kind is SpanKind.PRODUCER
    assert span.context is not None
    assert hop.traceparent == traceparent(span.context)
    attributes = dict(span.attributes or {})
    assert attributes[names.MESSAGING_SYSTEM] == "nats"
    assert attributes[names.MESSAGING_DESTINATION] == "lapse.sched.kubernetes.0a0b"
    assert attributes[names.MESSAGING_OPERATION_TYPE] == "send"
    assert attributes[names.CE_ID] == event.get_id()
    assert attributes[names.CE_SUBJECT] == "team-a/wf-1"
    assert attributes[names.CE_SPEC_VERSION] == "1.0"


def test_without_an_sdk_spans_are_no_ops_and_nothing_is_propagated() -> None:
    telemetry.reset()
    with telemetry.send_span("lapse.audit.x", due_event()) as hop:
        assert tracing.creation_context() == {}
    assert hop == telemetry.HopContext()
    assert not telemetry.metrics_enabled()


# --- a handler call -----------------------------------------------------------------------


class Rows:
    """An in-memory RowStore: the database edge is tested against real servers elsewhere."""

    def __init__(self, result: RunResult) -> None:
        self.result = result

    @property
    def targets(self) -> Sequence[TargetSpec]:
        return [kfp_target()]

    async def delete(self, runs: Sequence[RunRows], *, dry_run: bool) -> list[RunResult]:
        for _ in runs:  # what the SQL store's statements would count, one per table
            for _ in range(4):
                telemetry.count_database_statement("DELETE")
        return [self.result for _ in runs]


class Emitted:
    def __init__(self) -> None:
        self.events: list[BaseCloudEvent] = []

    async def emit(self, event: BaseCloudEvent) -> None:
        self.events.append(event)


async def test_a_deletion_is_one_span_with_its_outcome_and_metrics(
    memory: telemetry.InMemoryTelemetry,
) -> None:
    late = DEADLINE + timedelta(seconds=2.5)
    stored = FakeSchedules()
    reaper = RowReaper(
        rows=Rows(Counted((("kfp", "run_details", 1),))),
        schedules=stored,
        emitter=Emitted(),
        clock=lambda: late,
    )
    handler = telemetry.InstrumentedHandler("row-reaper", reaper)
    (completed,) = await handler.handle(stored.fired(due_event()))

    (span,) = memory.spans()
    attributes = dict(span.attributes or {})
    assert span.name == "row-reaper"
    assert attributes[names.RUN_NAMESPACE] == "team-a"
    assert attributes[names.RUN_NAME] == "wf-1"
    assert attributes[names.RUN_UID] == run().uid
    assert attributes[names.TARGET] == "database"
    assert attributes[names.OUTCOME] == "deleted"
    assert attributes[names.LATENESS] == pytest.approx(2.5)
    # The outcome event names the reaper's span as where it was created.
    assert span.context is not None
    assert completed.get_extension("traceparent").split("-")[2] == f"{span.context.span_id:016x}"

    (deletion,) = points(memory, names.DELETIONS.name)
    assert isinstance(deletion, NumberDataPoint)
    assert (dict(deletion.attributes or {}), deletion.value) == (
        {names.TARGET: "database", names.OUTCOME: "deleted"},
        1,
    )
    (lateness,) = points(memory, names.LATENESS_SECONDS.name)
    assert isinstance(lateness, HistogramDataPoint)
    assert (lateness.count, lateness.sum) == (1, pytest.approx(2.5))
    (calls,) = points(memory, names.DELETION_CALLS.name)
    assert (calls.count, calls.sum) == (1, 4)
    assert dict(calls.attributes or {})[names.API] == "database"
    (duration,) = points(memory, names.HANDLER_DURATION.name)
    assert dict(duration.attributes or {})[names.HANDLER_RESULT] == "ok"


async def test_a_retry_is_neither_an_error_nor_an_outcome(
    memory: telemetry.InMemoryTelemetry,
) -> None:
    stored = FakeSchedules()
    reaper = RowReaper(
        rows=Rows(Unavailable("connection refused")),
        schedules=stored,
        emitter=Emitted(),
        clock=lambda: DEADLINE,
    )
    handler = telemetry.InstrumentedHandler("row-reaper", reaper)
    with pytest.raises(RetryLater):
        await handler.handle(stored.fired(due_event()))
    (span,) = memory.spans()
    assert span.status.is_unset
    assert [event.name for event in span.events] == ["retry later"]
    assert names.OUTCOME not in (span.attributes or {})
    assert points(memory, names.DELETIONS.name) == []
    (duration,) = points(memory, names.HANDLER_DURATION.name)
    assert dict(duration.attributes or {})[names.HANDLER_RESULT] == "retry"


async def test_a_bug_marks_the_span_as_failed(memory: telemetry.InMemoryTelemetry) -> None:
    class Broken:
        async def handle(
            self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
        ) -> list[BaseCloudEvent]:
            raise KeyError("oops")

    with pytest.raises(KeyError):
        await telemetry.InstrumentedHandler("ttl-planner", Broken()).handle(due_event())
    (span,) = memory.spans()
    assert not span.status.is_ok and not span.status.is_unset
    assert dict(span.attributes or {})[names.ERROR_TYPE] == "KeyError"
    assert [event.name for event in span.events] == ["exception"]


def test_the_outcome_of_a_due_event_is_its_last_completion() -> None:
    r = run()
    alert = CleanupFailed(run=r, target=Target.KUBERNETES, reason="brake", stage="brake")
    brake = build_event(EventType.CLEANUP_FAILED, source="/t", data=alert)
    moved = CleanupCompleted.of(
        run=r, target=Target.KUBERNETES, outcome=CleanupOutcome.RESCHEDULED,
        completed_at=DEADLINE, deadline=DEADLINE,
    )  # fmt: skip
    completed = build_event(EventType.CLEANUP_COMPLETED, source="/t", data=moved)
    assert telemetry.handled_outcome([brake, completed]) == telemetry.HandledOutcome(
        "kubernetes", "rescheduled", 0.0
    )
    assert telemetry.handled_outcome([brake]) == telemetry.HandledOutcome(
        "kubernetes", "failed", None
    )
    assert telemetry.handled_outcome([]) is None


# --- the tree -----------------------------------------------------------------------------


def test_render_trace_tree_draws_each_trace_and_its_links(
    memory: telemetry.InMemoryTelemetry,
) -> None:
    tracer = telemetry.tracer()
    with tracer.start_as_current_span("ttl-planner"):
        with tracer.start_as_current_span("schedule kubernetes") as decision:
            decision.set_attribute(names.SCHEDULE_ACTION, "created")
        with tracer.start_as_current_span("send lapse.audit.x", kind=SpanKind.PRODUCER):
            pass
    _, links = telemetry.delivery_parent(
        "dev.lapse.cleanup.due.v1", None, decision.get_span_context()
    )
    due = tracer.start_as_current_span(
        "process lapse.due.kubernetes.*", kind=SpanKind.CONSUMER, links=links,
        context=otel_context.Context(),
    )  # fmt: skip
    with due, tracer.start_as_current_span("object-reaper") as reaper:
        reaper.set_attribute(names.OUTCOME, "deleted")

    lines = telemetry.render_trace_tree(memory.spans()).splitlines()
    planner_trace = decision.get_span_context().trace_id
    assert lines[0] == f"trace {planner_trace:032x}"
    assert lines[1].startswith("└─ ttl-planner ")
    assert lines[2].startswith("   ├─ schedule kubernetes ") and "action=created" in lines[2]
    assert lines[3].startswith("   └─ send lapse.audit.x [producer] ")
    assert lines[4].startswith("trace ") and lines[4] != lines[0]
    assert lines[5].startswith("└─ process lapse.due.kubernetes.* [consumer] ")
    assert f"↪ creation: 'schedule kubernetes' in trace {planner_trace:032x}" in lines[5]
    assert lines[6].startswith("   └─ object-reaper ") and "outcome=deleted" in lines[6]
    assert len(lines) == 7


def test_spans_of_run_keeps_the_traces_that_name_the_run(
    memory: telemetry.InMemoryTelemetry,
) -> None:
    tracer = telemetry.tracer()
    for uid in ("uid-1", "uid-2"):
        with tracer.start_as_current_span("ttl-planner") as planner:
            planner.set_attribute(names.RUN_UID, uid)
            with tracer.start_as_current_span("send lapse.audit.x"):
                pass
    mine = telemetry.spans_of_run(memory.spans(), "uid-1")
    assert sorted(span.name for span in mine) == ["send lapse.audit.x", "ttl-planner"]
    assert {dict(span.attributes or {}).get(names.RUN_UID) for span in mine} == {"uid-1", None}


# --- configuration ------------------------------------------------------------------------


def test_nothing_configured_installs_nothing() -> None:
    telemetry.reset()
    handle = telemetry.configure(env={})
    assert not handle.active
    assert not telemetry.metrics_enabled()
    handle.shutdown()  # harmless when there is nothing to flush


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER: unknown exporter 'zipkin'"),
        ({"OTEL_METRICS_EXPORTER": "statsd"}, "OTEL_METRICS_EXPORTER: unknown exporter"),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
            },
            "over http/protobuf .* or grpc",
        ),
        ({"LAPSE_PROMETHEUS_PORT": "ninety"}, "LAPSE_PROMETHEUS_PORT='ninety' is not a TCP port"),
    ],
)
def test_bad_settings_fail_with_the_variable_named(env: dict[str, str], message: str) -> None:
    telemetry.reset()
    with pytest.raises(telemetry.TelemetryError, match=message.replace("(", r"\(")):
        telemetry.configure(env=env)


def test_configure_keeps_what_the_process_already_installed(
    memory: telemetry.InMemoryTelemetry,
) -> None:
    handle = telemetry.configure(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    assert handle.tracer_provider is memory.handle.tracer_provider
    assert not handle.owned  # the Pipeline's shutdown will only flush it


def run_python(code: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_standard_environment_selects_the_exporters() -> None:
    # A process of its own: the OpenTelemetry API lets a process set its providers once.
    code = (
        "from opentelemetry import trace\n"
        "from lapse import telemetry\n"
        "h = telemetry.configure('lapse-x')\n"
        "p = h.tracer_provider\n"
        "print(type(p._active_span_processor._span_processors[0].span_exporter).__name__,\n"
        "      p.resource.attributes['service.name'], type(p.sampler).__name__,\n"
        "      trace.get_tracer_provider() is p, h.meter_provider is not None)\n"
        "h.shutdown()\n"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces",
        "OTEL_TRACES_SAMPLER": "traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.5",
    }
    assert run_python(code, env) == "OTLPSpanExporter lapse-x TraceIdRatioBased True False"
    env_named = {**env, "OTEL_SERVICE_NAME": "reaper-7"}
    assert run_python(code, env_named).split()[1] == "reaper-7"


def test_metrics_listen_no_further_than_the_process_unless_told() -> None:
    from lapse.runtime.asgi import host_of
    from lapse.telemetry.providers import metrics_host_of

    # `lapse up --listen 127.0.0.1:8080` (the default): loopback, not every address.
    assert metrics_host_of({}, None, host_of("127.0.0.1:8080")) == "127.0.0.1"
    assert metrics_host_of({}, None, host_of("[::1]:8080")) == "::1"
    assert metrics_host_of({}, None, host_of("0.0.0.0:8080")) == "0.0.0.0"
    # LAPSE_PROMETHEUS_HOST still says; the flag says over it.
    env = {"LAPSE_PROMETHEUS_HOST": "0.0.0.0"}
    assert metrics_host_of(env, None, "127.0.0.1") == "0.0.0.0"
    assert metrics_host_of(env, "10.0.0.5", "127.0.0.1") == "10.0.0.5"
    # A process without an endpoint of its own (the policy watcher's pod): every address.
    assert metrics_host_of({}, None, None) == "0.0.0.0"
    assert host_of("") is None and host_of("unix:/run/lapse.sock") is None
