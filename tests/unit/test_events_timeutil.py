"""RFC 3339 parsing and formatting, and W3C trace-context checks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from lapse.events.timeutil import format_rfc3339, parse_rfc3339
from lapse.events.tracecontext import is_valid_traceparent, is_valid_tracestate


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-03-01T12:00:00Z", datetime(2026, 3, 1, 12, tzinfo=UTC)),
        ("2026-03-01t12:00:00z", datetime(2026, 3, 1, 12, tzinfo=UTC)),
        ("2026-03-01 12:00:00+00:00", datetime(2026, 3, 1, 12, tzinfo=UTC)),
        ("2026-03-01T12:00:00.123456789Z", datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)),
        ("2026-03-01T13:30:00+01:30", datetime(2026, 3, 1, 12, tzinfo=UTC)),
    ],
)
def test_parses_rfc3339(text: str, expected: datetime) -> None:
    parsed = parse_rfc3339(text)
    assert parsed == expected
    assert parsed.utcoffset() is not None


@pytest.mark.parametrize(
    "text",
    [
        "2026-03-01",
        "2026-03-01T12:00:00",  # no offset: a naive time is not RFC 3339
        "20260301T120000Z",  # ISO 8601 basic format
        "2026-03-01T12:00Z",
        "2026-02-30T12:00:00Z",
        "2026-03-01T23:59:60Z",
        "2026-03-01T12:00:00+2400",
        " 2026-03-01T12:00:00Z",
        "",
    ],
)
def test_rejects_everything_else_with_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        parse_rfc3339(text)


def test_formats_utc_as_z_and_keeps_minute_offsets() -> None:
    assert format_rfc3339(datetime(2026, 3, 1, 12, tzinfo=UTC)) == "2026-03-01T12:00:00Z"
    plus_90 = timezone(timedelta(minutes=90))
    assert format_rfc3339(datetime(2026, 3, 1, 12, tzinfo=plus_90)) == "2026-03-01T12:00:00+01:30"


def test_offsets_with_seconds_are_written_in_utc() -> None:
    odd = datetime(2026, 3, 1, 12, tzinfo=timezone(timedelta(seconds=30)))
    assert format_rfc3339(odd) == "2026-03-01T11:59:30Z"
    assert parse_rfc3339(format_rfc3339(odd)) == odd


@pytest.mark.parametrize(
    "value",
    [
        datetime(2026, 3, 1, 12),
        datetime(1, 1, 1, tzinfo=timezone(timedelta(seconds=30))),
    ],
)
def test_unformattable_times_raise_value_error(value: datetime) -> None:
    with pytest.raises(ValueError):
        format_rfc3339(value)


def test_traceparent_validation_follows_w3c() -> None:
    assert is_valid_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    assert not is_valid_traceparent("00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01")
    assert not is_valid_traceparent("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    assert not is_valid_traceparent("00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01")
    assert not is_valid_traceparent(None)
    assert is_valid_tracestate("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")
    assert not is_valid_tracestate("a=b\r\nx: y")
    assert not is_valid_tracestate("x" * 513)
