"""Event types, payload models, the event builder and payload parsing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from cloudevents.core.v1.event import CloudEvent

from lapse.events import EventType, InvalidEvent, Outcome, build_event, parse_payload
from lapse.events.models import (
    EVENT_TYPES,
    PAYLOAD_MODELS,
    CleanupCancelled,
    CleanupCompleted,
    CleanupDue,
    CleanupFailed,
    CleanupScheduled,
    OriginalEvent,
    RunDeleted,
    RunFinished,
    model_for,
)
from lapse.events.original import capture_event, capture_message
from lapse.events.run import ArgoTTLStrategy, Engine, RunRef, Target

FINISHED = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def make_run(**changes: object) -> RunRef:
    fields: dict[str, object] = {
        "engine": Engine.ARGO,
        "api_version": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "namespace": "kubeflow",
        "name": "train-7xk2p",
        "uid": "5d0c3c1e-8d0c-4b8e-9d54-3f1f6f0c2a11",
        "resource_version": "184467",
        "phase": "Succeeded",
        "finished_at": FINISHED,
        "labels": {"pipeline/runid": "0b8a6f3e-1c1a-4f0e-a3c2-2b7b6c1d9e00"},
        "annotations": {"lapse.dev/ttl": "30m"},
        "ttl_strategy": ArgoTTLStrategy(seconds_after_success=3600),
        "kfp_run_id": "0b8a6f3e-1c1a-4f0e-a3c2-2b7b6c1d9e00",
    }
    fields.update(changes)
    return RunRef.model_validate(fields)


def sample_payloads() -> list[tuple[EventType, object]]:
    run = make_run()
    deadline = FINISHED + timedelta(minutes=30)
    return [
        (EventType.RUN_FINISHED, RunFinished(run=run)),
        (EventType.RUN_DELETED, RunDeleted(run=run.model_copy(update={"phase": "Running"}))),
        (
            EventType.CLEANUP_SCHEDULED,
            CleanupScheduled(
                run=run,
                target=Target.KUBERNETES,
                deadline=deadline,
                policy="annotation:lapse.dev/ttl",
            ),
        ),
        (
            EventType.CLEANUP_CANCELLED,
            CleanupCancelled(run=run, target=Target.KUBERNETES, reason="lapse.dev/keep"),
        ),
        (
            EventType.CLEANUP_DUE,
            CleanupDue(
                run=run,
                target=Target.DATABASE,
                deadline=deadline,
                policy="policy:kfp-90d",
                scheduled_at=FINISHED + timedelta(seconds=2),
            ),
        ),
        (
            EventType.CLEANUP_COMPLETED,
            CleanupCompleted.of(
                run=run,
                target=Target.KUBERNETES,
                outcome=Outcome.DELETED,
                deadline=deadline,
                completed_at=deadline + timedelta(milliseconds=250),
            ),
        ),
        (
            EventType.CLEANUP_FAILED,
            CleanupFailed(
                reason="data is not valid JSON",
                stage="adapter",
                original=OriginalEvent(attributes={"type": "x"}, data="{"),
            ),
        ),
    ]


def test_event_type_values_are_the_contract() -> None:
    assert {t.value for t in EventType} == {
        "dev.lapse.run.finished.v1",
        "dev.lapse.run.deleted.v1",
        "dev.lapse.cleanup.scheduled.v1",
        "dev.lapse.cleanup.cancelled.v1",
        "dev.lapse.cleanup.due.v1",
        "dev.lapse.cleanup.completed.v1",
        "dev.lapse.cleanup.failed.v1",
    }
    assert {o.value for o in Outcome} == {
        "deleted",
        "already_gone",
        "dry_run",
        "kept",
        "rescheduled",
        "replaced",
        "skipped",
        "refused",
    }


def test_every_type_has_exactly_one_model() -> None:
    assert set(PAYLOAD_MODELS) == set(EventType)
    assert len(set(PAYLOAD_MODELS.values())) == len(EventType)
    assert all(EVENT_TYPES[model] is t for t, model in PAYLOAD_MODELS.items())
    assert model_for("dev.lapse.cleanup.due.v1") is CleanupDue
    assert model_for("com.example.other") is None


def test_payloads_are_camel_case_on_the_wire() -> None:
    wire = RunFinished(run=make_run()).model_dump(mode="json", by_alias=True)["run"]
    assert wire["apiVersion"] == "argoproj.io/v1alpha1"
    assert wire["finishedAt"] == "2026-03-01T12:00:00Z"
    assert wire["kfpRunId"] == "0b8a6f3e-1c1a-4f0e-a3c2-2b7b6c1d9e00"
    assert wire["ttlStrategy"]["secondsAfterSuccess"] == 3600
    due = CleanupDue.model_validate(
        {
            "run": wire,
            "target": "database",
            "deadline": "2026-03-01T12:30:00Z",
            "policy": "default",
            "scheduledAt": "2026-03-01T12:00:02+00:00",
        }
    )
    assert due.scheduled_at == FINISHED + timedelta(seconds=2)


def test_models_reject_unknown_fields_and_naive_times() -> None:
    wire = RunFinished(run=make_run()).model_dump(mode="json", by_alias=True)
    with pytest.raises(ValueError, match="Extra inputs"):
        RunFinished.model_validate({**wire, "surprise": 1})
    with pytest.raises(ValueError, match="timezone"):
        CleanupScheduled(
            run=make_run(),
            target=Target.KUBERNETES,
            deadline=datetime(2026, 3, 1, 12, 30),
            policy="default",
        )


def test_completed_latency_is_done_minus_deadline() -> None:
    deadline = FINISHED + timedelta(hours=1)
    late = CleanupCompleted.of(
        run=make_run(),
        target=Target.KUBERNETES,
        outcome=Outcome.DELETED,
        deadline=deadline,
        completed_at=deadline + timedelta(seconds=1, milliseconds=500),
    )
    assert late.latency_seconds == 1.5
    early = CleanupCompleted.of(
        run=make_run(),
        target=Target.KUBERNETES,
        outcome=Outcome.DELETED,
        deadline=deadline,
        completed_at=deadline - timedelta(seconds=2),
    )
    assert early.latency_seconds == -2.0
    unscheduled = CleanupCompleted.of(
        run=make_run(),
        target=Target.DATABASE,
        outcome=Outcome.ALREADY_GONE,
        completed_at=deadline,
    )
    assert unscheduled.latency_seconds is None


@pytest.mark.parametrize(("event_type", "payload"), sample_payloads())
def test_build_then_parse_returns_the_same_payload(event_type: EventType, payload: object) -> None:
    event = build_event(event_type, source="/lapse/test", data=payload)  # type: ignore[arg-type]
    assert isinstance(event, CloudEvent)
    assert event.get_type() == event_type.value
    assert event.get_specversion() == "1.0"
    assert event.get_datacontenttype() == "application/json"
    assert isinstance(event.get_data(), dict)
    assert parse_payload(event) == payload
    assert parse_payload(event, type(payload)) == payload


def test_attributes_default_from_the_payload() -> None:
    _, due = sample_payloads()[4]
    event = build_event(EventType.CLEANUP_DUE, source="/lapse/scheduler", data=due)  # type: ignore[arg-type]
    assert event.get_subject() == "kubeflow/train-7xk2p"
    assert event.get_extension("target") == "database"
    assert event.get_extension("engine") == "argo"
    assert event.get_extension("traceparent") is None
    time = event.get_time()
    assert time is not None and time.tzinfo is not None
    assert len(event.get_id()) == 36


def test_explicit_attributes_are_kept() -> None:
    when = datetime(2026, 3, 1, 12, 0, 1, tzinfo=UTC)
    event = build_event(
        "dev.lapse.run.finished.v1",
        source="/lapse/watcher",
        data=RunFinished(run=make_run()),
        subject="custom/subject",
        engine="argo",
        traceparent=TRACEPARENT,
        tracestate="vendor=abc",
        id="evt-1",
        time=when,
    )
    assert event.get_id() == "evt-1"
    assert event.get_time() == when
    assert event.get_subject() == "custom/subject"
    assert event.get_extension("traceparent") == TRACEPARENT
    assert event.get_extension("tracestate") == "vendor=abc"
    assert event.get_extension("target") is None  # run.finished concerns no single target


def test_failed_without_run_has_no_subject_or_engine() -> None:
    _, failed = sample_payloads()[6]
    event = build_event(EventType.CLEANUP_FAILED, source="/lapse/dispatcher", data=failed)  # type: ignore[arg-type]
    assert event.get_subject() is None
    assert event.get_extension("engine") is None
    assert event.get_extension("target") is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"type": "dev.lapse.run.exploded.v1"}, "not a lapse event type"),
        ({"type": EventType.CLEANUP_DUE}, "carries CleanupDue, not RunFinished"),
        ({"engine": "tekton"}, "engine 'tekton' disagrees"),
        ({"engine": "nomad"}, "unknown engine"),
        ({"target": "kubernetes"}, None),  # run.finished has no target: explicit one is fine
        ({"traceparent": "00-abc-def-01"}, "not a W3C traceparent"),
        ({"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"}, "not a W3C traceparent"),
        ({"tracestate": "vendor=abc"}, "tracestate needs a traceparent"),
        ({"time": datetime(2026, 3, 1)}, "timezone aware"),
        ({"source": ""}, "source"),
    ],
)
def test_build_refuses_contradictions(changes: dict[str, object], message: str | None) -> None:
    arguments: dict[str, object] = {
        "type": EventType.RUN_FINISHED,
        "source": "/lapse/test",
        "data": RunFinished(run=make_run()),
    }
    arguments.update(changes)
    if message is None:
        event = build_event(**arguments)  # type: ignore[arg-type]
        assert event.get_extension("target") == "kubernetes"
        return
    with pytest.raises(ValueError, match=message):
        build_event(**arguments)  # type: ignore[arg-type]


def test_build_refuses_a_target_that_disagrees_with_the_payload() -> None:
    _, due = sample_payloads()[4]
    with pytest.raises(ValueError, match="target 'kubernetes' disagrees"):
        build_event(EventType.CLEANUP_DUE, source="/x", data=due, target="kubernetes")  # type: ignore[arg-type]


def raw_event(event_type: str, data: object, **attributes: object) -> CloudEvent:
    return CloudEvent(
        {"type": event_type, "source": "/test", "id": "1", **attributes},
        data,  # type: ignore[arg-type]
    )


def test_parse_accepts_json_text_data() -> None:
    wire = RunFinished(run=make_run()).model_dump_json(by_alias=True)
    parsed = parse_payload(raw_event(EventType.RUN_FINISHED, wire.encode()))
    assert parsed == RunFinished(run=make_run())


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (raw_event("com.example.thing", {}), "unknown event type 'com.example.thing'"),
        (raw_event(EventType.RUN_FINISHED, None), "has no data"),
        (raw_event(EventType.RUN_FINISHED, b"{nope"), "not valid JSON"),
        (raw_event(EventType.RUN_FINISHED, "[" * 100_000), "nested too deeply"),
        (raw_event(EventType.RUN_FINISHED, {"run": 7}), "run: Input should be"),
        (raw_event(EventType.RUN_FINISHED, []), r"\(data\): Input should be"),
        (
            raw_event(EventType.RUN_FINISHED, {}, datacontenttype="application/xml"),
            "is not JSON",
        ),
    ],
)
def test_parse_reports_a_clear_reason(event: CloudEvent, message: str) -> None:
    with pytest.raises(InvalidEvent, match=message) as caught:
        parse_payload(event)
    assert caught.value.reason == str(caught.value)


def test_parse_names_the_bad_field_by_its_wire_path() -> None:
    wire = RunFinished(run=make_run()).model_dump(mode="json", by_alias=True)
    wire["run"]["uid"] = ""
    wire["run"]["finishedAt"] = "yesterday"
    with pytest.raises(InvalidEvent) as caught:
        parse_payload(raw_event(EventType.RUN_FINISHED, wire))
    assert "run.uid: String should have at least 1 character" in caught.value.reason
    assert "run.finishedAt" in caught.value.reason


def test_parse_checks_target_attribute_against_payload() -> None:
    _, due = sample_payloads()[4]
    event = build_event(EventType.CLEANUP_DUE, source="/x", data=due)  # type: ignore[arg-type]
    event.get_attributes()["target"] = "kubernetes"
    with pytest.raises(InvalidEvent, match="disagrees with payload target 'database'"):
        parse_payload(event)


def test_parse_with_expected_model_rejects_other_types() -> None:
    event = build_event(EventType.RUN_FINISHED, source="/x", data=RunFinished(run=make_run()))
    with pytest.raises(InvalidEvent, match="expected a CleanupDue event"):
        parse_payload(event, CleanupDue)


def test_capture_event_bounds_what_goes_to_the_dlq() -> None:
    event = raw_event("com.example.big", {"blob": "x" * 20_000}, subject="s" * 600)
    original = capture_event(event)
    assert original.truncated is True
    assert original.data is not None and len(original.data) == 8192
    assert original.data.startswith('{"blob": "xxx')
    assert len(original.attributes["subject"]) == 512
    assert original.attributes["type"] == "com.example.big"
    # The capture must itself be a valid payload part (it lands in a CleanupFailed).
    failed = CleanupFailed(reason="too big", stage="adapter", original=original)
    assert CleanupFailed.model_validate(failed.model_dump(by_alias=True)) == failed


def test_capture_message_keeps_only_cloudevents_headers() -> None:
    original = capture_message(
        {
            "ce-id": "1",
            "Content-Type": "application/json",
            "Authorization": "Bearer secret",
            "Cookie": "session=1",
        },
        b"\xff\xfe not utf-8",
    )
    assert original.attributes == {"ce-id": "1", "Content-Type": "application/json"}
    assert original.data is not None and original.data.endswith("not utf-8")
    assert original.truncated is False
