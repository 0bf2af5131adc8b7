"""W3C trace-context checks shared by the builder and the NATS binding.

An invalid `traceparent` must be ignored by receivers (W3C Trace Context, section 3.2),
so readers return None for it while writers refuse to emit one.
"""

from __future__ import annotations

import re

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})", re.ASCII)
_TRACESTATE_MAX = 512


def is_valid_traceparent(value: object) -> bool:
    if not isinstance(value, str):
        return False
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return False
    version, trace_id, parent_id, _flags = match.groups()
    return version != "ff" and trace_id != "0" * 32 and parent_id != "0" * 16


def is_valid_tracestate(value: object) -> bool:
    """Printable ASCII within the W3C size limit; member syntax is the tracer's business."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= _TRACESTATE_MAX
        and all(" " <= ch <= "~" for ch in value)
    )
