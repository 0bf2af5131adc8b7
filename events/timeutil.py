"""RFC 3339 timestamps, strictly.

`datetime.fromisoformat` alone accepts ISO 8601 shapes that are not RFC 3339 (date-only,
basic format, naive times); CloudEvents `time` and Kubernetes timestamps are RFC 3339, so
anything else is treated as malformed rather than guessed at.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

_DATE = r"\d{4}-\d{2}-\d{2}"
_TIME = r"\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:[Zz]|[+-]\d{2}:\d{2})"
# RFC 3339 lets applications separate date and time with a space (section 5.6, NOTE);
# Go's time.RFC3339, and so kubectl and annotations read by Go tools, accept only `T`.
_RFC3339 = re.compile(rf"{_DATE}[Tt ]{_TIME}", re.ASCII)
_RFC3339_T = re.compile(rf"{_DATE}[Tt]{_TIME}", re.ASCII)


def parse_rfc3339(value: str, *, allow_space: bool = True) -> datetime:
    """Parse an RFC 3339 date-time into an aware datetime; `ValueError` if it is not one.

    `allow_space=False` insists on the `T` separator, as Go's parser does: for values a
    person wrote (the `lapse.dev/expires` annotation) that other tools must read alike."""
    pattern = _RFC3339 if allow_space else _RFC3339_T
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise ValueError(f"not an RFC 3339 date-time: {value!r:.80}")
    try:
        return datetime.fromisoformat(value.upper())
    except ValueError as exc:  # the right shape, an impossible date or time (day 32)
        raise ValueError(f"not a valid RFC 3339 date-time ({exc}): {value!r:.80}") from None


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
