"""One failure hierarchy for every target: what a call to the thing being cleaned (the API
server, a database, an object store) can end in, besides success.

Each edge maps its library's errors into these at the edge (as httpx maps httpcore's), so
the reaping sequence (sequence.py) never catches a library's exception, nor `Exception`:

- `Unavailable`: no answer, or asked to come back (a timeout, a refused connection, 408,
  429, 5xx, a deadlock, throttling). Nothing happened; it is a `RetryLater`, so the
  runtime delivers the same due event again after its back-off: waited out, never
  dead-lettered (docs/architecture.md, "Transient is not failed").
- `Refused`: the target will refuse again (401/403, a bucket that does not exist, a key
  its column cannot hold): a `cleanup.failed` that names the target, nothing deleted.
- `Gone`: what was to be removed is not there (404 on a DELETE).
- `Conflict`: the precondition failed: it changed since it was judged (409, 412).
"""

from __future__ import annotations

from typing import Final

from lapse.functions.errors import FunctionError
from lapse.functions.ports import RetryLater

DEFAULT_RETRY_DELAY: Final = 5.0
MIN_RETRY_DELAY: Final = 1.0
# Retry-After comes from the server; a huge value must not park the message for hours.
MAX_RETRY_DELAY: Final = 300.0
# Statuses below 500 that mean "come back later" rather than "no".
TRANSIENT_STATUSES: Final = frozenset({408, 429})


class TargetFailure(FunctionError):
    """A call to a target failed; `reason` is one line an operator can act on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Unavailable(TargetFailure, RetryLater):
    """No answer, or asked to come back: nothing happened, deliver again after `delay`."""

    def __init__(self, reason: str, delay: float = DEFAULT_RETRY_DELAY) -> None:
        RetryLater.__init__(self, reason, delay)


class Refused(TargetFailure):
    """The target refused for a reason retrying will not change."""


class Gone(TargetFailure):
    """What was to be removed is not there."""


class Conflict(TargetFailure):
    """The precondition failed: it changed since it was judged."""


def transient(status: int | None) -> bool:
    """Whether an HTTP answer (None: no answer at all) means "come back later"."""
    return status is None or status in TRANSIENT_STATUSES or status >= 500


def retry_delay(retry_after: float | None) -> float:
    """How long to wait before the next try: the server's Retry-After, within bounds."""
    delay = retry_after if retry_after is not None else DEFAULT_RETRY_DELAY
    return min(max(delay, MIN_RETRY_DELAY), MAX_RETRY_DELAY)


def of_http(
    status: int | None,
    message: str,
    *,
    what: str,
    retry_after: float | None = None,
    forbidden: str = "",
    server: str = "the server",
) -> TargetFailure:
    """The failure an HTTP answer (`status` None: none came back) to "`what`" means.
    `forbidden`: what to check when the answer is 403 (the RBAC, the bucket policy);
    `server`: who answered, as the reason names it."""
    if transient(status):
        code = "no response" if status is None else f"HTTP {status}"
        return Unavailable(f"cannot {what} yet ({code}): {message}", retry_delay(retry_after))
    if status == 404:
        return Gone(f"cannot {what}: not found ({message})")
    if status in (409, 412):
        return Conflict(f"cannot {what}: it changed since it was read ({message})")
    if status == 401:
        return Refused(
            f"unauthorized: {server} rejected lapse's credentials when trying to {what} "
            f"({message}); nothing was deleted"
        )
    if status == 403:
        hint = f" - {forbidden}" if forbidden else ""
        return Refused(f"forbidden: {message}{hint}; nothing was deleted")
    return Refused(f"{server} refused to {what} (HTTP {status}): {message}")
