"""What a failed Kubernetes API call means for a due event (pure).

Transient (no response, 408, 429, 5xx): `RetryLater` is raised, nothing happened and the
same event is delivered again. Everything else the server will refuse again on retry, so it
is reported at once: above all 401/403, because a reaper without the right RBAC deletes
nothing and must say so loudly instead of retrying quietly into the dead-letter queue.
(404 and 409 on DELETE never get here: the handler treats them as gone / changed.)
"""

from __future__ import annotations

from typing import Final

from lapse.events.kinds import KindSpec
from lapse.events.run import RunRef
from lapse.functions.object_reaper.ports import CallFailure
from lapse.functions.object_reaper.verdict import Refused
from lapse.functions.ports import RetryLater

DEFAULT_RETRY_DELAY: Final = 5.0
MIN_RETRY_DELAY: Final = 1.0
# Retry-After comes from the server; a huge value must not park the message for hours.
MAX_RETRY_DELAY: Final = 300.0
TRANSIENT_STATUSES: Final = frozenset({408, 429})


def judge_failure(failure: CallFailure, verb: str, run: RunRef, kind: KindSpec) -> Refused:
    """The refusal a failed call ends in; raises `RetryLater` when it is transient."""
    what = f"{verb} {kind.kind} {run.subject}"
    status = failure.status
    if status is None or status in TRANSIENT_STATUSES or status >= 500:
        delay = failure.retry_after if failure.retry_after is not None else DEFAULT_RETRY_DELAY
        code = "no response" if status is None else f"HTTP {status}"
        raise RetryLater(
            f"cannot {what} yet ({code}): {failure.message}",
            min(max(delay, MIN_RETRY_DELAY), MAX_RETRY_DELAY),
        )
    if status == 403:
        return Refused(
            run,
            f"forbidden: {failure.message} - lapse needs the '{verb}' verb on "
            f"{kind.resource}.{kind.group} in namespace {run.namespace!r} (check its RBAC); "
            "nothing was deleted",
        )
    if status == 401:
        return Refused(
            run,
            f"unauthorized: the API server rejected lapse's credentials when trying to {what} "
            f"({failure.message}); nothing was deleted",
        )
    return Refused(run, f"the API server refused to {what} (HTTP {status}): {failure.message}")
