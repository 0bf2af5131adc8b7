"""The uids this process's own DELETEs removed, remembered for a short while.

`lapse up` watches the objects its reaper deletes. Each deletion comes back as a DELETED
watch event, which the watcher would publish as `run.deleted` for the planner to cancel
the run's Kubernetes deadline; but a deletion lapse made was caused by that deadline, which
has fired, so there is nothing to cancel, and finding that out cost every deletion a
publish, a delivery and a schedule lookup. The watcher skips what is remembered here. A
deletion made by anyone else (or not remembered: the event came late, another lapse
process made it) is reported as before, and a `run.deleted` the planner did not need is
harmless.

A uid is remembered before its DELETE is sent (the watch event can overtake the DELETE's
answer) and forgotten when the DELETE fails. Bounded in time and size, so a process with
no watcher (a reaper on Knative) holds no more than the last minute of its deletions.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

KEEP_SECONDS = 60.0
CAPACITY = 20_000


class OwnDeletions:
    def __init__(
        self,
        *,
        keep_seconds: float = KEEP_SECONDS,
        capacity: int = CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keep = keep_seconds
        self._capacity = capacity
        self._clock = clock
        self._sent: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sent)

    def sending(self, uid: str) -> None:
        """A DELETE of `uid` is about to be sent."""
        now = self._clock()
        self._sent[uid] = now
        self._sent.move_to_end(uid)
        while self._sent:
            oldest, at = next(iter(self._sent.items()))
            if len(self._sent) <= self._capacity and now - at <= self._keep:
                break
            del self._sent[oldest]

    def failed(self, uid: str) -> None:
        """The DELETE of `uid` failed or its answer was lost: whoever removes the object,
        it was not (knowingly) this process."""
        self._sent.pop(uid, None)

    def take(self, uid: str) -> bool:
        """Whether this process deleted `uid` within the last `keep_seconds`; answers True
        once (an object is deleted once)."""
        at = self._sent.pop(uid, None)
        return at is not None and self._clock() - at <= self._keep
