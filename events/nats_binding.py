"""CloudEvents over NATS messages, as (headers, body) pairs; no NATS client needed.

Written in binary content mode (CloudEvents NATS binding 1.0.3: every attribute as a
percent-encoded `ce-<name>` header, data as the body) because JetStream message
schedules copy headers and body verbatim onto the due subject, and headers can be read
without parsing the body. Structured mode (`Content-Type: application/cloudevents+json`)
is read too, as is a header-less JSON body (NATS before 2.2 had no headers, so the 1.0
binding was structured only).

Everything a peer can get wrong surfaces as `BindingError`, so a consumer has exactly one
exception to route to the dead-letter queue.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Final
from urllib.parse import unquote_to_bytes

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.exceptions import BaseCloudEventException
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent

from lapse.events.errors import BindingError
from lapse.events.jsontext import is_json_media_type, parse_json
from lapse.events.timeutil import format_rfc3339, parse_rfc3339, rfc3339_offset
from lapse.events.tracecontext import is_valid_traceparent, is_valid_tracestate

CE_PREFIX: Final = "ce-"
STRUCTURED_CONTENT_TYPE: Final = "application/cloudevents+json"
CONTENT_TYPE_HEADER: Final = "Content-Type"
MSG_ID_HEADER: Final = "Nats-Msg-Id"
TRACEPARENT_HEADER: Final = "traceparent"
TRACESTATE_HEADER: Final = "tracestate"

_REQUIRED: Final = ("specversion", "id", "source", "type")
_ATTRIBUTE_NAME = re.compile(r"[a-z0-9]+", re.ASCII)
_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")
# Printable ASCII stays as is, except the three characters the binding reserves.
_HEADER_SAFE: Final = frozenset(chr(code) for code in range(0x21, 0x7F)) - {'"', "%"}
# Nearly every value (ids, types, times, uids) is all safe: one match instead of a loop.
_ALL_SAFE: Final = re.compile(r"[\x21\x23-\x24\x26-\x7e]*")


class ContentMode(StrEnum):
    BINARY = "binary"
    STRUCTURED = "structured"


@dataclass(frozen=True, slots=True)
class NatsMessage:
    headers: dict[str, str]
    body: bytes


def to_nats(
    event: BaseCloudEvent,
    *,
    hop_traceparent: str | None = None,
    hop_tracestate: str | None = None,
    mode: ContentMode = ContentMode.BINARY,
) -> NatsMessage:
    """Encode a CloudEvent as a NATS message.

    `Nats-Msg-Id` is the event id so JetStream drops a re-published duplicate.
    `hop_traceparent`/`hop_tracestate` are this hop's W3C context; the event's own
    `traceparent` extension (where it was created) travels untouched as `ce-traceparent`.
    """
    if ContentMode(mode) is ContentMode.BINARY:
        headers = {
            CE_PREFIX + name: encode_header_value(
                # Most attributes are strings already: their canonical form is themselves.
                value if type(value) is str else _canonical_string(name, value)
            )
            for name, value in event.get_attributes().items()
            if value is not None
        }
        body = _encode_data(event.get_data(), event.get_datacontenttype())
    else:
        headers = {CONTENT_TYPE_HEADER: STRUCTURED_CONTENT_TYPE}
        body = _structured_body(event)
    headers[MSG_ID_HEADER] = encode_header_value(str(event.get_id()))
    if hop_tracestate is not None and hop_traceparent is None:
        raise BindingError("a hop tracestate needs a hop traceparent")
    if hop_traceparent is not None:
        if not is_valid_traceparent(hop_traceparent):
            raise BindingError(f"hop traceparent is not W3C trace context: {hop_traceparent!r}")
        headers[TRACEPARENT_HEADER] = hop_traceparent
        if hop_tracestate is not None:
            if not is_valid_tracestate(hop_tracestate):
                raise BindingError("hop tracestate must be printable ASCII of at most 512 chars")
            headers[TRACESTATE_HEADER] = hop_tracestate
    return NatsMessage(headers=headers, body=body)


def from_nats(headers: Mapping[str, str] | None, body: bytes) -> CloudEvent:
    """Decode a NATS message (binary or structured mode) into a CloudEvent."""
    if not isinstance(body, bytes | bytearray):
        raise BindingError(f"message body must be bytes, not {type(body).__name__}")
    fields = _lowercased(headers)
    content_type = fields.get("content-type")
    if content_type is not None:
        media = content_type.split(";", 1)[0].strip().lower()
        if media.startswith("application/cloudevents"):
            if media != STRUCTURED_CONTENT_TYPE:
                raise BindingError(f"unsupported structured format {media!r}")
            return _from_structured(bytes(body))
    ce_fields = {
        name[len(CE_PREFIX) :]: value
        for name, value in fields.items()
        if name.startswith(CE_PREFIX)
    }
    if not ce_fields:
        try:
            return _from_structured(bytes(body))
        except BindingError as exc:
            raise BindingError(
                f"no ce- headers and not a structured CloudEvent either: {exc.reason}"
            ) from None
    return _from_binary(ce_fields, content_type, bytes(body))


def hop_trace_context(headers: Mapping[str, str] | None) -> tuple[str | None, str | None]:
    """This hop's W3C (traceparent, tracestate); (None, None) if absent or invalid."""
    try:
        fields = _lowercased(headers)
    except BindingError:
        return None, None
    traceparent = fields.get(TRACEPARENT_HEADER)
    if not is_valid_traceparent(traceparent):
        return None, None
    tracestate = fields.get(TRACESTATE_HEADER)
    return traceparent, tracestate if is_valid_tracestate(tracestate) else None


def encode_header_value(value: str) -> str:
    """Percent-encode space, `"`, `%` and everything outside printable ASCII, as UTF-8."""
    if _ALL_SAFE.fullmatch(value):
        return value
    try:
        return "".join(
            ch if ch in _HEADER_SAFE else "".join(f"%{byte:02X}" for byte in ch.encode())
            for ch in value
        )
    except UnicodeEncodeError:
        raise BindingError(f"header value is not encodable as UTF-8: {value!r:.80}") from None


def decode_header_value(value: str) -> str:
    """Undo `encode_header_value`; also accepts the quoted-string form older peers send."""
    if _ALL_SAFE.fullmatch(value):
        # No quote, percent sign, space or non-ASCII: nothing to undo (nearly every value).
        return value
    value = value.strip(" \t")
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = re.sub(r"\\(.)", r"\1", value[1:-1], flags=re.DOTALL)
    if _BAD_PERCENT.search(value):
        raise BindingError(f"bad percent-encoding in header value {value!r:.80}")
    try:
        return unquote_to_bytes(value).decode("utf-8")
    except UnicodeError:
        raise BindingError(f"header value is not percent-encoded UTF-8: {value!r:.80}") from None


def _lowercased(headers: Mapping[str, str] | None) -> dict[str, str]:
    # NATS header names are case-insensitive (ADR-4); two spellings of one name with
    # different values cannot be resolved without guessing.
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise BindingError(f"headers must be a mapping, not {type(headers).__name__}")
    fields: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise BindingError("header names and values must be strings")
        key = name.lower()
        if key in fields and fields[key] != value:
            raise BindingError(f"header {name!r} appears twice with different values")
        fields[key] = value
    return fields


def _from_binary(ce_fields: dict[str, str], content_type: str | None, body: bytes) -> CloudEvent:
    attributes: dict[str, Any] = {}
    for name, raw in ce_fields.items():
        if not _ATTRIBUTE_NAME.fullmatch(name):
            raise BindingError(f"header ce-{name}: not a CloudEvents attribute name")
        attributes[name] = decode_header_value(raw)
    _check_required(attributes)
    if "time" in attributes:
        attributes["time"] = _time(attributes["time"])
    # Producers that follow the HTTP convention put the data's type in Content-Type.
    if "datacontenttype" not in attributes and content_type is not None:
        attributes["datacontenttype"] = content_type
    return _event(attributes, _decode_data(body, attributes.get("datacontenttype")))


def _from_structured(body: bytes) -> CloudEvent:
    try:
        document = parse_json(body)
    except ValueError as exc:
        raise BindingError(f"structured body is {exc}") from None
    if not isinstance(document, dict):
        raise BindingError("structured body must be a JSON object")
    # JSON format: an attribute whose value is null is absent.
    attributes = {name: value for name, value in document.items() if value is not None}
    if "data" in attributes and "data_base64" in attributes:
        raise BindingError("structured event has both data and data_base64")
    data: Any = attributes.pop("data", None)
    if "data_base64" in attributes:
        data = _base64(attributes.pop("data_base64"))
    for name, value in attributes.items():
        if not _ATTRIBUTE_NAME.fullmatch(name):
            raise BindingError(f"{name!r} is not a CloudEvents attribute name")
        if not isinstance(value, str | int):
            raise BindingError(f"attribute {name!r} must be a string, integer or boolean")
    _check_required(attributes)
    if "time" in attributes:
        attributes["time"] = _time(attributes["time"])
    return _event(attributes, data)


def _check_required(attributes: dict[str, Any]) -> None:
    for name in _REQUIRED:
        if name not in attributes:
            raise BindingError(f"missing required attribute {name!r}")
    if attributes["specversion"] != "1.0":
        raise BindingError(f"unsupported specversion {attributes['specversion']!r}; expected 1.0")


def _event(attributes: dict[str, Any], data: Any) -> CloudEvent:
    try:
        return CloudEvent(attributes, data)
    except BaseCloudEventException as exc:
        raise BindingError(str(exc)) from None


def _time(value: object) -> datetime:
    if not isinstance(value, str):
        raise BindingError("attribute 'time' must be an RFC 3339 string")
    try:
        return parse_rfc3339(value)
    except ValueError as exc:
        raise BindingError(f"attribute 'time': {exc}") from None


def _base64(value: object) -> bytes:
    if not isinstance(value, str):
        raise BindingError("data_base64 must be a string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BindingError("data_base64 is not valid base64") from None


def _canonical_string(name: str, value: object) -> str:
    """The CloudEvents type system's canonical string form of an attribute value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int):
        return str(value)
    if isinstance(value, datetime):
        try:
            return format_rfc3339(value)
        except ValueError as exc:
            raise BindingError(f"attribute {name!r}: {exc}") from None
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    raise BindingError(f"attribute {name!r} has a {type(value).__name__}, not a CloudEvents type")


def _encode_data(data: Any, content_type: str | None) -> bytes:
    if data is None:
        return b""
    if isinstance(data, bytes | bytearray):
        return bytes(data)
    # Absent datacontenttype means JSON (CloudEvents JSON format, section 3.1), so a str
    # is a JSON string there and is quoted, the same as structured mode would carry it.
    if content_type is None or is_json_media_type(content_type):
        return _json_bytes(data)
    if isinstance(data, str):
        try:
            return data.encode("utf-8")
        except UnicodeEncodeError:
            raise BindingError("text data is not encodable as UTF-8") from None
    raise BindingError(
        f"{type(data).__name__} data needs a JSON datacontenttype, not {content_type!r}"
    )


def _decode_data(body: bytes, content_type: str | None) -> Any:
    if not body:
        return None
    if content_type is None:
        try:
            return parse_json(body)
        except ValueError:
            return body
    if is_json_media_type(content_type):
        try:
            return parse_json(body)
        except ValueError as exc:
            raise BindingError(
                f"body is {exc} though datacontenttype is {content_type!r}"
            ) from None
    if content_type.lower().startswith("text/"):
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError:
            return body
    return body


def _json_bytes(data: Any) -> bytes:
    try:
        text = json.dumps(data, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
        return text.encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise BindingError(f"data is not JSON-serializable: {exc}") from None


def _structured_body(event: BaseCloudEvent) -> bytes:
    attributes: dict[str, Any] = {}
    for name, value in event.get_attributes().items():
        if value is None:
            continue
        if isinstance(value, datetime):
            try:
                value = rfc3339_offset(value)
            except ValueError as exc:
                raise BindingError(f"attribute {name!r}: {exc}") from None
        elif isinstance(value, bytes):
            value = base64.b64encode(value).decode("ascii")  # CloudEvents Binary in JSON
        elif not isinstance(value, str | int):
            raise BindingError(f"attribute {name!r} has a {type(value).__name__}")
        attributes[name] = value
    data = event.get_data()
    content_type = event.get_datacontenttype()
    if data is not None and not isinstance(data, str | bytes | bytearray):
        if content_type is not None and not is_json_media_type(content_type):
            raise BindingError(
                f"{type(data).__name__} data needs a JSON datacontenttype, not {content_type!r}"
            )
        _json_bytes(data)  # refuse what the SDK would write as invalid JSON (NaN, sets)
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            raise BindingError("text data is not encodable as UTF-8") from None
    try:
        return JSONFormat().write(CloudEvent(attributes, data))
    except (BaseCloudEventException, TypeError, ValueError) as exc:
        raise BindingError(f"cannot write structured event: {exc}") from None
