"""Durations as people write them (`90s`, `30m`, `12h`, `7d`, `1d12h`) and TTLs (`never`).

One parser for the whole project: annotations, configuration values and command-line
flags all go through `parse_duration` / `parse_ttl`, and pydantic models use
`DurationField` / `TtlField` / `PositiveDuration`. Strict like Go's and kubectl's parsers:
ASCII digits only, whole numbers, a unit on every number. A malformed value is an error,
never a guess - an annotation that reads as a shorter TTL than its owner meant would
delete the run early.
"""

from __future__ import annotations

import functools
import re
from datetime import timedelta
from enum import Enum
from typing import Annotated, Final, Literal, TypeAlias

from pydantic import AfterValidator, PlainSerializer, PlainValidator, WithJsonSchema

from lapse.functions.errors import FunctionError


class NeverType(Enum):
    """The TTL `never`: a singleton, so that "no TTL configured here" (None) stays distinct."""

    NEVER = "never"


NEVER: Final = NeverType.NEVER
Ttl: TypeAlias = timedelta | Literal[NeverType.NEVER]


UNIT_HINT: Final = "use s, m, h, d or w"
_UNITS: Final = {
    "w": timedelta(weeks=1),
    "d": timedelta(days=1),
    "h": timedelta(hours=1),
    "m": timedelta(minutes=1),
    "s": timedelta(seconds=1),
}
# ASCII only: `\d` would also take fullwidth or Arabic-Indic digits, which
# no Go or kubectl parser accepts.
_PART = re.compile(r"(\d+)(\D*)", re.ASCII)


class DurationError(FunctionError, ValueError):
    """A duration that does not parse; `problem` is the part after the value."""

    def __init__(self, what: str, text: str, problem: str) -> None:
        super().__init__(f"{what} {text!r}: {problem}")
        self.text = text
        self.problem = problem


@functools.lru_cache(maxsize=1024)  # pure; a fleet uses a handful of TTLs, parsed per event
def parse_duration(text: str, *, what: str = "duration") -> timedelta:
    """Parse `90s`, `30m`, `12h`, `7d`, `2w`, or a combination largest unit first (`1d12h`).

    Strict: no bare numbers, no fractions, no signs, no `never` (see `parse_ttl`). `what`
    names the value in the error message, e.g. `ttl '3x': unknown unit 'x'; use s, m, ...`.
    """
    value = text.strip()
    if value == NEVER.value:
        raise DurationError(what, text, "'never' is not allowed here; give a duration")
    if not value:
        raise DurationError(what, text, f"empty; {UNIT_HINT}, e.g. 12h")
    if value[0] in "+-":
        raise DurationError(what, text, f"no sign allowed; {UNIT_HINT}, e.g. 12h")
    if re.search(r"\d[.,]\d", value):
        raise DurationError(what, text, "whole numbers only; use a smaller unit (90m, not 1.5h)")
    parts = _PART.findall(value)
    if not value[0].isdigit() or "".join(n + u for n, u in parts) != value:
        raise DurationError(what, text, f"expected a number and a unit; {UNIT_HINT}, e.g. 12h")
    total = timedelta()
    previous = -1
    order = list(_UNITS)
    for number, unit in parts:
        if not unit:
            raise DurationError(what, text, f"missing unit; {UNIT_HINT}")
        if unit not in _UNITS:
            raise DurationError(what, text, f"unknown unit {unit!r}; {UNIT_HINT}")
        if order.index(unit) <= previous:
            raise DurationError(what, text, "units go largest first, each once (e.g. 1d12h)")
        previous = order.index(unit)
        if len(number) > 15:  # beyond ~30 million years; also keeps int() cheap
            raise DurationError(what, text, "too large; use 'never' to keep forever")
        try:
            total += int(number) * _UNITS[unit]
        except OverflowError:
            raise DurationError(what, text, "too large; use 'never' to keep forever") from None
    return total


def parse_ttl(text: str, *, what: str = "ttl") -> Ttl:
    """A duration (see `parse_duration`) or the literal `never`."""
    if text.strip() == NEVER.value:
        return NEVER
    return parse_duration(text, what=what)


def format_duration(value: Ttl) -> str:
    """The canonical text of a TTL (`30d`, `2w`, `1d12h`, `never`); for whole seconds
    `parse_ttl(format_duration(x)) == x`."""
    if not isinstance(value, timedelta):
        return NEVER.value
    seconds = value.days * 86_400 + value.seconds
    if seconds == 0:
        return "0s"
    week = 7 * 86_400
    if seconds % week == 0:
        return f"{seconds // week}w"
    text = ""  # weeks only when exact: "30d" reads better than "4w2d"
    for unit, size in list(_UNITS.items())[1:]:
        count, seconds = divmod(seconds, int(size.total_seconds()))
        if count:
            text += f"{count}{unit}"
    return text


def _coerce(value: object, *, allow_never: bool) -> Ttl:
    """Validate a config value; the messages are written to follow the key path."""
    if isinstance(value, timedelta):
        if value < timedelta() or value.microseconds:
            raise ValueError(f"{value} is not a duration (whole, non-negative seconds only)")
        return value
    if value is NEVER and allow_never:
        return NEVER
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # YAML `ttl: 30` is an int: report the missing unit, not the type
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a duration ({UNIT_HINT}, e.g. 12h)")
    try:
        return parse_ttl(value) if allow_never else parse_duration(value)
    except DurationError as exc:
        raise ValueError(f"{exc.text!r} is not a duration ({exc.problem})") from None


def _duration(value: object) -> timedelta:
    result = _coerce(value, allow_never=False)
    assert isinstance(result, timedelta)
    return result


def _ttl(value: object) -> Ttl:
    return _coerce(value, allow_never=True)


DurationField = Annotated[
    timedelta,
    PlainValidator(_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "examples": ["30s", "12h", "7d"]}),
]
"""A pydantic field type for durations written as text (`30s`); `never` is rejected."""

TtlField = Annotated[
    Ttl,
    PlainValidator(_ttl),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "examples": ["12h", "7d", "never"]}),
]
"""A pydantic field type for TTLs: a duration or `never`."""


def _positive(value: timedelta) -> timedelta:
    if value <= timedelta():
        raise ValueError("must be longer than 0s")
    return value


PositiveDuration = Annotated[DurationField, AfterValidator(_positive)]
"""A `DurationField` that must be longer than 0s (intervals, windows, waits)."""
