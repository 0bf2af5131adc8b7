"""The one place lapse CloudEvents are made, and the one place their payloads are read.

Building and parsing in one module keeps the attribute conventions (subject, target and
engine extensions, JSON data) from drifting between the functions that emit and consume.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, Final, TypeVar, overload

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.exceptions import BaseCloudEventException
from cloudevents.core.v1.event import CloudEvent
from pydantic import ValidationError

from lapse.events.errors import InvalidEvent, describe_validation_error
from lapse.events.jsontext import is_json_media_type, parse_json
from lapse.events.models import PAYLOAD_MODELS, Payload, model_for
from lapse.events.run import ContractModel, Engine, RunRef, Target
from lapse.events.tracecontext import is_valid_traceparent, is_valid_tracestate
from lapse.events.types import EventType

JSON_CONTENT_TYPE: Final = "application/json"

P = TypeVar("P", bound=ContractModel)


def build_event(
    type: EventType | str,
    *,
    source: str,
    data: ContractModel,
    target: Target | str | None = None,
    engine: Engine | str | None = None,
    subject: str | None = None,
    traceparent: str | None = None,
    tracestate: str | None = None,
    id: str | None = None,
    time: datetime | None = None,
) -> CloudEvent:
    """Make a lapse CloudEvent; `ValueError` if the arguments contradict the contract.

    `subject`, `target` and `engine` default to what the payload says (its run's
    `<namespace>/<name>`, its target, its run's engine); passing a different value than
    the payload's is refused, because Triggers route on the attributes while handlers read
    the payload, and the two must never disagree.
    """
    event_type = _event_type(type)
    model = PAYLOAD_MODELS[event_type]
    if not isinstance(data, model):
        raise ValueError(f"{event_type} carries {model.__name__}, not {data.__class__.__name__}")
    run = getattr(data, "run", None)
    run = run if isinstance(run, RunRef) else None

    attributes: dict[str, Any] = {
        "specversion": "1.0",
        "type": event_type.value,
        "source": source,
        "id": id if id is not None else str(uuid.uuid4()),
        "time": time if time is not None else datetime.now(UTC),
        "datacontenttype": JSON_CONTENT_TYPE,
    }
    subject = subject if subject is not None else (run.subject if run else None)
    if subject is not None:
        attributes["subject"] = subject
    resolved_target = _agreeing("target", target, getattr(data, "target", None), Target)
    if resolved_target is not None:
        attributes["target"] = resolved_target.value
    resolved_engine = _agreeing("engine", engine, run.engine if run else None, Engine)
    if resolved_engine is not None:
        attributes["engine"] = resolved_engine.value
    if traceparent is not None:
        if not is_valid_traceparent(traceparent):
            raise ValueError(f"not a W3C traceparent: {traceparent!r}")
        attributes["traceparent"] = traceparent
    if tracestate is not None:
        if traceparent is None or not is_valid_tracestate(tracestate):
            raise ValueError("tracestate needs a traceparent and printable ASCII ≤ 512 chars")
        attributes["tracestate"] = tracestate

    try:
        return CloudEvent(attributes, data.model_dump(mode="json", by_alias=True))
    except BaseCloudEventException as exc:
        raise ValueError(str(exc)) from None


@overload
def parse_payload(event: BaseCloudEvent) -> Payload: ...
@overload
def parse_payload(event: BaseCloudEvent, expected: type[P]) -> P: ...
def parse_payload(event: BaseCloudEvent, expected: type[ContractModel] | None = None) -> Any:
    """Validate an incoming event's data against the model for its type.

    With `expected`, the event must also be of that model's type (a handler subscribed to
    one type says so and gets the concrete model back). Raises `InvalidEvent`.
    """
    event_type = event.get_type()
    model = model_for(event_type)
    if model is None:
        raise InvalidEvent(f"unknown event type {event_type!r}")
    if expected is not None and model is not expected:
        raise InvalidEvent(f"expected a {expected.__name__} event, got {event_type}")
    content_type = event.get_datacontenttype()
    if content_type is not None and not is_json_media_type(content_type):
        raise InvalidEvent(f"{event_type}: datacontenttype {content_type!r} is not JSON")

    data = event.get_data()
    if data is None:
        raise InvalidEvent(f"{event_type}: event has no data")
    if isinstance(data, str | bytes):
        try:
            data = parse_json(data)
        except ValueError as exc:
            raise InvalidEvent(f"{event_type}: data is {exc}") from None
    try:
        payload = model.model_validate(data)
    except ValidationError as exc:
        raise InvalidEvent(f"{event_type}: {describe_validation_error(exc)}") from None

    attribute_target = event.get_extension("target")
    payload_target = getattr(payload, "target", None)
    if (
        attribute_target is not None
        and payload_target is not None
        and str(attribute_target) != payload_target.value
    ):
        raise InvalidEvent(
            f"{event_type}: target attribute {attribute_target!r} "
            f"disagrees with payload target {payload_target.value!r}"
        )
    return payload


def _event_type(value: EventType | str) -> EventType:
    try:
        return EventType(value)
    except ValueError:
        raise ValueError(f"not a lapse event type: {value!r}") from None


E = TypeVar("E", Target, Engine)


def _agreeing(name: str, given: E | str | None, from_payload: object, kind: type[E]) -> E | None:
    """The attribute value: the caller's if given (it must match the payload's), else the
    payload's."""
    payload_value = from_payload if isinstance(from_payload, kind) else None
    if given is None:
        return payload_value
    try:
        value = kind(given)
    except ValueError:
        raise ValueError(f"unknown {name} {given!r}") from None
    if payload_value is not None and value != payload_value:
        raise ValueError(f"{name} {value.value!r} disagrees with payload {name} {payload_value}")
    return value


def outcome_id(due_id: str, event_type: EventType | str) -> str:
    """The id of the outcome (`cleanup.completed` or `cleanup.failed`) of the due event
    `due_id`: derived, not random, so that a second outcome for the same due event (a
    retry after a DELETE whose answer was lost) is the same event, which the audit stream's
    duplicate window drops. Each due event ends in exactly one outcome of each type."""
    return f"{due_id}/{str(event_type).removeprefix('dev.lapse.')}"


OUTCOME_TYPES: Final = frozenset({EventType.CLEANUP_COMPLETED, EventType.CLEANUP_FAILED})


def as_outcome_of(due: BaseCloudEvent, event: BaseCloudEvent) -> BaseCloudEvent:
    """`event` as the outcome of the due event `due`: an outcome's id is derived from the
    due event's (`outcome_id`); any other event is returned as it is."""
    if event.get_type() in OUTCOME_TYPES:
        return with_id(event, outcome_id(due.get_id(), event.get_type()))
    return event


def with_id(event: BaseCloudEvent, id: str) -> CloudEvent:
    """The same event under another id."""
    return CloudEvent(attributes={**event.get_attributes(), "id": id}, data=event.get_data())
