"""CloudEvents <-> NATS messages: examples, interop with the SDK, and property tests."""

from __future__ import annotations

import json
import string
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from cloudevents.core.bindings import http
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lapse.events import BindingError, EventType, InvalidEvent, build_event, parse_payload
from lapse.events.models import RunFinished
from lapse.events.nats_binding import (
    ContentMode,
    NatsMessage,
    decode_header_value,
    encode_header_value,
    from_nats,
    hop_trace_context,
    to_nats,
)
from tests.unit.test_events_builder import make_run

EVENT_TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
HOP_TRACE = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"
WHEN = datetime(2026, 3, 1, 12, 0, 0, 250000, tzinfo=UTC)


def lapse_event() -> CloudEvent:
    return build_event(
        EventType.RUN_FINISHED,
        source="/lapse/watcher",
        data=RunFinished(run=make_run()),
        traceparent=EVENT_TRACE,
        id="evt-42",
        time=WHEN,
    )


def same_event(left: CloudEvent, right: CloudEvent) -> bool:
    return left.get_attributes() == right.get_attributes() and left.get_data() == right.get_data()


def test_binary_mode_headers_and_body() -> None:
    message = to_nats(lapse_event(), hop_traceparent=HOP_TRACE)
    assert message.headers == {
        "ce-specversion": "1.0",
        "ce-type": "dev.lapse.run.finished.v1",
        "ce-source": "/lapse/watcher",
        "ce-id": "evt-42",
        "ce-time": "2026-03-01T12:00:00.250000Z",
        "ce-datacontenttype": "application/json",
        "ce-subject": "kubeflow/train-7xk2p",
        "ce-engine": "argo",
        "ce-traceparent": EVENT_TRACE,
        "Nats-Msg-Id": "evt-42",
        "traceparent": HOP_TRACE,
    }
    assert json.loads(message.body)["run"]["uid"] == "5d0c3c1e-8d0c-4b8e-9d54-3f1f6f0c2a11"


def test_binary_round_trip_keeps_event_trace_apart_from_hop_trace() -> None:
    message = to_nats(lapse_event(), hop_traceparent=HOP_TRACE, hop_tracestate="k=v")
    decoded = from_nats(message.headers, message.body)
    assert same_event(decoded, lapse_event())
    assert decoded.get_extension("traceparent") == EVENT_TRACE
    assert hop_trace_context(message.headers) == (HOP_TRACE, "k=v")
    assert parse_payload(decoded) == RunFinished(run=make_run())


def test_structured_mode_headers_and_round_trip() -> None:
    message = to_nats(lapse_event(), mode="structured")  # type: ignore[arg-type]
    assert message == to_nats(lapse_event(), mode=ContentMode.STRUCTURED)
    assert message.headers == {
        "Content-Type": "application/cloudevents+json",
        "Nats-Msg-Id": "evt-42",
    }
    document = json.loads(message.body)
    assert document["time"] == "2026-03-01T12:00:00.250000Z"
    assert document["data"]["run"]["name"] == "train-7xk2p"
    assert same_event(from_nats(message.headers, message.body), lapse_event())


def test_reads_what_the_sdk_writes() -> None:
    event = lapse_event()
    structured = http.to_structured_event(event)
    assert same_event(from_nats(structured.headers, structured.body), event)
    # The SDK's HTTP binary mode puts datacontenttype in Content-Type, not a ce- header.
    binary = http.to_binary_event(event)
    assert "ce-datacontenttype" not in binary.headers
    assert same_event(from_nats(binary.headers, binary.body), event)


def test_sdk_reads_what_we_write() -> None:
    message = to_nats(lapse_event(), mode=ContentMode.STRUCTURED)
    assert same_event(JSONFormat().read(CloudEvent, message.body), lapse_event())  # type: ignore[arg-type]
    binary = to_nats(lapse_event())
    via_sdk = http.from_binary_event(http.HTTPMessage(binary.headers, binary.body))
    assert same_event(via_sdk, lapse_event())  # type: ignore[arg-type]


def test_header_values_are_percent_encoded_as_the_spec_example() -> None:
    assert encode_header_value("Euro € 😀") == "Euro%20%E2%82%AC%20%F0%9F%98%80"
    assert encode_header_value('a"b%c') == "a%22b%25c"
    assert decode_header_value("Euro%20%e2%82%ac%20%F0%9F%98%80") == "Euro € 😀"
    assert decode_header_value('"quoted \\"value\\""') == 'quoted "value"'
    assert decode_header_value("%41%42") == "AB"  # needless encoding is accepted


@pytest.mark.parametrize("value", ["%C0%A0", "%E2%82", "100%", "%zz"])
def test_bad_percent_encoding_is_rejected(value: str) -> None:
    with pytest.raises(BindingError):
        decode_header_value(value)


def test_header_names_are_case_insensitive() -> None:
    headers = {k.upper(): v for k, v in to_nats(lapse_event()).headers.items()}
    assert same_event(from_nats(headers, to_nats(lapse_event()).body), lapse_event())


def test_typed_extensions_become_strings_in_binary_mode_only() -> None:
    attributes = {"type": "t", "source": "/s", "id": "1", "time": WHEN}
    attributes |= {"count": 3, "flag": True, "blob": b"\x00\x01"}
    event = CloudEvent(attributes, {"a": 1})
    binary = to_nats(event)
    assert binary.headers["ce-count"] == "3"
    assert binary.headers["ce-flag"] == "true"
    assert binary.headers["ce-blob"] == "AAE="
    assert from_nats(binary.headers, binary.body).get_extension("flag") == "true"
    structured = to_nats(event, mode=ContentMode.STRUCTURED)
    decoded = from_nats(structured.headers, structured.body)
    assert decoded.get_extension("count") == 3
    assert decoded.get_extension("flag") is True
    assert decoded.get_extension("blob") == "AAE="  # JSON format carries Binary as base64


def test_headerless_json_body_is_read_as_structured() -> None:
    # NATS before 2.2 had no headers: the 1.0 binding sent structured events bare.
    body = to_nats(lapse_event(), mode=ContentMode.STRUCTURED).body
    assert same_event(from_nats(None, body), lapse_event())
    assert same_event(from_nats({}, body), lapse_event())


def test_binary_text_and_octet_data() -> None:
    cases: list[tuple[str, str | bytes]] = [
        ("text/plain", "héllo"),
        ("application/octet-stream", b"\x00\xff"),
    ]
    for content_type, data in cases:
        event = CloudEvent(
            {"type": "t", "source": "/s", "id": "1", "time": WHEN, "datacontenttype": content_type},
            data,
        )
        message = to_nats(event)
        assert message.body == (data.encode() if isinstance(data, str) else data)
        assert from_nats(message.headers, message.body).get_data() == data


def test_time_offsets_with_seconds_are_written_in_utc() -> None:
    odd = datetime(1937, 1, 1, 12, 0, tzinfo=timezone(timedelta(minutes=19, seconds=32)))
    event = CloudEvent({"type": "t", "source": "/s", "id": "1", "time": odd})
    message = to_nats(event)
    assert message.headers["ce-time"] == "1937-01-01T11:40:28Z"
    assert from_nats(message.headers, message.body).get_time() == odd


BASE = {"ce-specversion": "1.0", "ce-type": "t", "ce-source": "/s", "ce-id": "1"}


@pytest.mark.parametrize(
    ("headers", "body", "reason"),
    [
        ({k: v for k, v in BASE.items() if k != "ce-id"}, b"", "missing required attribute 'id'"),
        ({**BASE, "ce-specversion": "0.3"}, b"", "unsupported specversion '0.3'"),
        ({**BASE, "ce-time": "yesterday"}, b"", "not an RFC 3339"),
        ({**BASE, "ce-time": "2026-03-01T12:00:00"}, b"", "not an RFC 3339"),
        ({**BASE, "ce-subject": ""}, b"", "subject"),
        ({**BASE, "ce-data": "x"}, b"", "reserved"),
        ({**BASE, "ce-Bad_Name": "x"}, b"", "not a CloudEvents attribute name"),
        ({**BASE, "ce-": "x"}, b"", "not a CloudEvents attribute name"),
        ({**BASE, "ce-id": "a", "CE-ID": "b"}, b"", "appears twice"),
        ({**BASE, "ce-datacontenttype": "application/json"}, b"{no", "not valid JSON"),
        ({**BASE, "ce-datacontenttype": "application/json"}, b"NaN", "not a JSON number"),
        ({"Content-Type": "application/cloudevents-batch+json"}, b"[]", "unsupported structured"),
        ({"Content-Type": "application/cloudevents+json"}, b"[1]", "must be a JSON object"),
        ({"Content-Type": "application/cloudevents+json"}, b"\xff", "not valid JSON"),
        ({}, b"", "no ce- headers and not a structured CloudEvent"),
        ({"subject": "x"}, b"hello", "no ce- headers"),
    ],
)
def test_malformed_messages_raise_binding_error(
    headers: dict[str, str], body: bytes, reason: str
) -> None:
    with pytest.raises(BindingError, match=reason) as caught:
        from_nats(headers, body)
    assert isinstance(caught.value, InvalidEvent)


def structured(document: dict[str, Any]) -> bytes:
    return json.dumps(document).encode()


VALID = {"specversion": "1.0", "type": "t", "source": "/s", "id": "1"}


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        ({**VALID, "data": {}, "data_base64": "AA=="}, "both data and data_base64"),
        ({**VALID, "data_base64": "***"}, "not valid base64"),
        ({**VALID, "data_base64": 5}, "must be a string"),
        ({**VALID, "time": 1700000000}, "RFC 3339 string"),
        ({**VALID, "ext": {"nested": 1}}, "string, integer or boolean"),
        ({**VALID, "ext": 1.5}, "string, integer or boolean"),
        ({**VALID, "id": 7}, "id"),
        ({"type": "t", "source": "/s", "id": "1"}, "missing required attribute 'specversion'"),
    ],
)
def test_malformed_structured_events(document: dict[str, Any], reason: str) -> None:
    with pytest.raises(BindingError, match=reason):
        from_nats({"content-type": "application/cloudevents+json"}, structured(document))


def test_structured_nulls_are_absent_attributes() -> None:
    event = from_nats(None, structured({**VALID, "subject": None, "data": None}))
    assert event.get_subject() is None
    assert event.get_data() is None


@pytest.mark.parametrize(
    ("event", "kwargs", "reason"),
    [
        (CloudEvent({"type": "t", "source": "/s"}, {"x": float("nan")}), {}, "JSON-serializable"),
        (
            CloudEvent({"type": "t", "source": "/s", "datacontenttype": "text/plain"}, {"a": 1}),
            {},
            "needs a JSON datacontenttype",
        ),
        (CloudEvent({"type": "t", "source": "/s", "ext": 1.5}), {}, "not a CloudEvents type"),
        (CloudEvent({"type": "t", "source": "/s"}), {"hop_traceparent": "nope"}, "W3C"),
        (CloudEvent({"type": "t", "source": "/s"}), {"hop_tracestate": "a=b"}, "needs a hop"),
    ],
)
def test_unencodable_events_raise_binding_error(
    event: CloudEvent, kwargs: dict[str, Any], reason: str
) -> None:
    with pytest.raises(BindingError, match=reason):
        to_nats(event, **kwargs)


def test_invalid_hop_trace_context_is_ignored_on_read() -> None:
    assert hop_trace_context({"traceparent": "garbage", "tracestate": "a=b"}) == (None, None)
    assert hop_trace_context({"TraceParent": HOP_TRACE, "tracestate": "\n"}) == (HOP_TRACE, None)
    assert hop_trace_context(None) == (None, None)


# --- property tests ----------------------------------------------------------------------

RESERVED = {"id", "source", "type", "specversion", "datacontenttype", "dataschema"}
RESERVED |= {"subject", "time", "data"}
extension_names = st.from_regex(r"[a-z0-9]{1,12}", fullmatch=True).filter(
    lambda name: name not in RESERVED
)
offsets = st.builds(
    timezone,
    st.timedeltas(min_value=-timedelta(hours=23, minutes=59), max_value=timedelta(hours=23)),
)
times = st.datetimes(
    min_value=datetime(1900, 1, 1), max_value=datetime(2200, 1, 1), timezones=offsets
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
    ),
    max_leaves=12,
)
content = st.one_of(
    st.tuples(st.just("application/json"), json_values),
    st.tuples(st.just("application/cloudevents+json; charset=utf-8"), json_values),
    st.tuples(st.none(), st.dictionaries(st.text(), json_values, max_size=4)),
    st.tuples(st.just("text/plain"), st.text(min_size=1)),
    st.tuples(st.just("application/octet-stream"), st.binary(min_size=1)),
    st.tuples(st.sampled_from(["application/json", "text/plain"]), st.none()),
)


@st.composite
def cloudevents(draw: st.DrawFn) -> CloudEvent:
    attributes: dict[str, Any] = {
        "specversion": "1.0",
        "id": draw(st.text(min_size=1)),
        "source": draw(st.text(min_size=1)),
        "type": draw(st.text(min_size=1)),
        "time": draw(times),
    }
    for name in ("subject", "dataschema"):
        value = draw(st.none() | st.text(min_size=1))
        if value is not None:
            attributes[name] = value
    attributes.update(draw(st.dictionaries(extension_names, st.text(), max_size=4)))
    content_type, data = draw(content)
    if content_type is not None:
        attributes["datacontenttype"] = content_type
    return CloudEvent(attributes, data)


@settings(max_examples=300, deadline=None)
@given(cloudevents(), st.sampled_from(list(ContentMode)))
def test_any_event_round_trips_unchanged(event: CloudEvent, mode: ContentMode) -> None:
    message = to_nats(event, hop_traceparent=HOP_TRACE, mode=mode)
    assert all(
        c in string.printable and c not in "\r\n" for v in message.headers.values() for c in v
    )
    decoded = from_nats(message.headers, message.body)
    assert decoded.get_attributes() == event.get_attributes()
    assert decoded.get_data() == event.get_data()
    assert message.headers["traceparent"] == HOP_TRACE


def only_binding_errors(headers: Any, body: Any) -> None:
    try:
        event = from_nats(headers, body)
    except BindingError as exc:
        assert exc.reason
    else:
        assert isinstance(event, CloudEvent)
        assert event.get_specversion() == "1.0"


header_names = st.sampled_from(
    [*BASE, "ce-time", "ce-datacontenttype", "ce-subject", "ce-data", "Content-Type"]
) | st.text(max_size=12)
header_values = st.sampled_from(
    ["1.0", "0.3", "application/json", "application/cloudevents+json", "2026-03-01T12:00:00Z"]
) | st.text(max_size=20)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(header_names, header_values, max_size=8), st.binary(max_size=64))
@example({}, b"[" * 100_000)
@example({"content-type": "application/cloudevents+json"}, b'{"specversion":"1.0","time":"x"}')
def test_arbitrary_messages_raise_only_binding_error(headers: dict[str, str], body: bytes) -> None:
    only_binding_errors(headers, body)


structured_documents = st.dictionaries(
    st.sampled_from([*VALID, "time", "data", "data_base64", "subject", "datacontenttype", "x"])
    | st.text(max_size=8),
    json_values,
    max_size=8,
).map(lambda d: {**VALID, **d} if len(d) % 2 else d)


@settings(max_examples=300, deadline=None)
@given(structured_documents, st.booleans())
def test_arbitrary_structured_documents_raise_only_binding_error(
    document: dict[str, Any], with_content_type: bool
) -> None:
    headers = {"Content-Type": "application/cloudevents+json"} if with_content_type else None
    only_binding_errors(headers, json.dumps(document).encode())


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.none(), st.integers(), st.lists(st.text()), st.text()), st.binary())
def test_non_mapping_headers_raise_only_binding_error(headers: Any, body: bytes) -> None:
    only_binding_errors(headers, body)


def test_non_bytes_body_is_a_binding_error() -> None:
    with pytest.raises(BindingError, match="body must be bytes"):
        from_nats(BASE, "text")  # type: ignore[arg-type]


def test_message_is_immutable() -> None:
    message = NatsMessage(headers={}, body=b"")
    with pytest.raises(AttributeError):
        message.body = b"x"  # type: ignore[misc]
