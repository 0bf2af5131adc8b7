"""Capture the input that failed, for `cleanup.failed.original`.

The DLQ entry must let a person see what went wrong without access to the original
message, but a bad producer must not be able to turn the DLQ into a copy of its payloads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from cloudevents.core.base import BaseCloudEvent

from lapse.events.models import (
    MAX_ORIGINAL_ATTRIBUTES,
    MAX_ORIGINAL_DATA_CHARS,
    MAX_ORIGINAL_VALUE_CHARS,
    OriginalEvent,
)
from lapse.events.timeutil import format_rfc3339

# Only CloudEvents headers and message identity are kept: an HTTP edge may hand over its
# request headers, and credentials (Authorization, cookies) have no place in a DLQ.
_KEPT_HEADERS = frozenset({"content-type", "nats-msg-id", "traceparent", "tracestate"})


def capture_event(event: BaseCloudEvent) -> OriginalEvent:
    """Attributes and data of a parsed CloudEvent whose payload was unusable."""
    attributes = ((name, _text(value)) for name, value in event.get_attributes().items())
    return _bounded(attributes, _data_text(event.get_data()))


def capture_message(headers: Mapping[str, str] | None, body: bytes | None) -> OriginalEvent:
    """Headers and body of a message that could not be read as a CloudEvent at all."""
    kept = (
        (str(name), str(value))
        for name, value in (headers or {}).items()
        if str(name).lower().startswith("ce-") or str(name).lower() in _KEPT_HEADERS
    )
    return _bounded(kept, _data_text(body))


def _bounded(attributes: Iterable[tuple[str, str]], data: str | None) -> OriginalEvent:
    truncated = False
    kept: dict[str, str] = {}
    for name, value in attributes:
        if len(kept) == MAX_ORIGINAL_ATTRIBUTES:
            truncated = True
            break
        if len(value) > MAX_ORIGINAL_VALUE_CHARS:
            value, truncated = value[:MAX_ORIGINAL_VALUE_CHARS], True
        kept[name[:MAX_ORIGINAL_VALUE_CHARS]] = value
    if data is not None and len(data) > MAX_ORIGINAL_DATA_CHARS:
        data, truncated = data[:MAX_ORIGINAL_DATA_CHARS], True
    return OriginalEvent(attributes=kept, data=data, truncated=truncated)


def _text(value: Any) -> str:
    if isinstance(value, datetime) and value.utcoffset() is not None:
        return format_rfc3339(value)
    return str(value)


def _data_text(data: Any) -> str | None:
    if data is None:
        return None
    if isinstance(data, bytes | bytearray):
        return bytes(data).decode("utf-8", errors="replace")
    if isinstance(data, str):
        return data
    try:
        return json.dumps(data, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):
        return f"<unprintable {type(data).__name__}>"
