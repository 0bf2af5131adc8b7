"""The contract layer's exceptions: `ContractError`, and below it `InvalidEvent` for input
lapse cannot use.

Handlers catch `InvalidEvent` to route bad input to the dead-letter queue with its reason,
so every parse, binding, adapter and subject failure in `events` is one of these, never a
bare `KeyError` or `ValueError` that would look like a bug and be retried forever. (The
other layers' bases: `lapse.functions.errors.FunctionError`, `lapse.errors.LapseError`.)
"""

from __future__ import annotations

from pydantic import ValidationError


class ContractError(Exception):
    """Raised by the event contract (events/)."""


class InvalidEvent(ContractError):
    """Input that is not a usable lapse event; `reason` says why in one line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BindingError(InvalidEvent):
    """A transport message (NATS headers + body) that does not carry a valid CloudEvent."""


def describe_validation_error(exc: ValidationError, limit: int = 5) -> str:
    """One line naming the first few bad fields by their wire (camelCase) path."""
    problems = [
        f"{'.'.join(str(part) for part in error['loc']) or '(data)'}: {error['msg']}"
        for error in exc.errors(include_url=False, include_input=False)[:limit]
    ]
    more = exc.error_count() - len(problems)
    return "; ".join(problems) + (f"; and {more} more" if more > 0 else "")
