"""RFC 3339 timestamps, strictly.

`datetime.fromisoformat` alone accepts ISO 8601 shapes that are not RFC 3339 (date-only,
basic format, naive times); CloudEvents `time` and Kubernetes timestamps are RFC 3339, so
anything else is treated as malformed rather than guessed at.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

_RFC3339 = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})",
    re.ASCII,
)


def parse_rfc3339(value: str) -> datetime:
    """Parse an RFC 3339 date-time into an aware datetime; `ValueError` if it is not one."""
    if not isinstance(value, str) or _RFC3339.fullmatch(value) is None:
        raise ValueError(f"not an RFC 3339 date-time: {value!r:.80}")
    return datetime.fromisoformat(value.upper())


def format_rfc3339(value: datetime) -> str:
    """Render an aware datetime as RFC 3339, `Z` for UTC.

    Python allows UTC offsets with seconds, which RFC 3339 cannot express; such times are
    written in UTC (same instant) instead of as text no peer could parse.
    """
    text = rfc3339_offset(value).isoformat()
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def rfc3339_offset(value: datetime) -> datetime:
    """The same instant with an offset RFC 3339 can write (whole minutes); ValueError if naive."""
    offset = value.utcoffset()
    if offset is None:
        raise ValueError("naive datetime has no RFC 3339 form")
    if not offset % timedelta(minutes=1):
        return value
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"{value!r} has no UTC form within years 1..9999") from None
