"""What the handlers need from the outside world, as Protocols.

Handlers are written against these and never import NATS, Kubernetes or SQLAlchemy, so the
decision logic stays testable and the runtimes (`lapse up`, a Knative function, a test)
plug in the real edges from `lapse/`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from cloudevents.core.base import BaseCloudEvent

from lapse.events.kinds import KindSpec
from lapse.events.models import CleanupDue
from lapse.events.run import Target
from lapse.functions.errors import FunctionError
from lapse.functions.trust import Provenance, Trust


@dataclass(frozen=True)
class PendingSchedule:
    """A deadline the scheduler holds for one (target, uid).

    `fired`: the deadline has come and the server stored its due message, whose content
    lapse wrote when it put the schedule (`due`). That stored content, not a due event's
    claim, is what a reaper that cannot read its target's owner judges from
    (the row-reaper: functions/row_reaper/verdict.py). A pending schedule carries it when
    asked for (`ScheduleStore.get(with_due=True)`): the planner reads a run where lapse
    stored it, not where a deletion claim says (functions/ttl_planner/claims.py).
    """

    target: Target
    uid: str
    deadline: datetime
    fired: bool = False
    due: CleanupDue | None = None


class ScheduleStore(Protocol):
    """Durable delayed delivery: at `deadline` the due event is delivered to the reapers.

    One pending schedule per (target, uid): `put` replaces, `cancel` withdraws.
    """

    async def get(
        self, target: Target, uid: str, *, with_due: bool = False
    ) -> PendingSchedule | None:
        """The schedule held for (target, uid), pending or fired. `with_due`: a pending one
        carries the due event lapse stored in it too (a fired one always does); reading it
        back is a parse, paid only where it is needed."""
        ...

    async def put(
        self,
        target: Target,
        uid: str,
        deadline: datetime,
        due_event: BaseCloudEvent,
        *,
        provenance: Provenance,
    ) -> None:
        """`provenance`: whether the version `due_event` carries is one lapse read from the
        API server itself; the due message then says so to the runtime that delivers it
        (functions/trust.py). Every caller states it: there is no default."""
        ...

    async def cancel(self, target: Target, uid: str) -> bool:
        """Withdraw the schedule; True if one was pending."""
        ...


class Emitter(Protocol):
    """Where handlers send the events they produce (audit trail, dead letters)."""

    async def emit(self, event: BaseCloudEvent) -> None: ...


async def emit_all(emitter: Emitter, events: list[BaseCloudEvent]) -> list[BaseCloudEvent]:
    """Emit `events` and return them: what every handler returns.

    The emits start in order and their acknowledgements are awaited together (pipelined):
    an emitter that sends before it first waits (NATS: the message is queued on the
    connection, then the ack awaited) keeps their order, at one round trip's wait for all.
    Every emit is awaited before this returns or raises (the first failure), so a caller
    that acks its input only afterwards still loses nothing; what was emitted before a
    failure is emitted again on redelivery, under the same ids where they are derived."""
    if len(events) <= 1:
        for event in events:
            await emitter.emit(event)
        return events
    results = await asyncio.gather(*(emitter.emit(e) for e in events), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return events


class ObjectFetcher(Protocol):
    """A fresh read of a Kubernetes object, for inputs that only reference it."""

    async def fetch(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None: ...


class ObjectLister(Protocol):
    """A fresh list of one kind's objects in one namespace by label selector, paged: the
    runs of a keep_last group (functions/keep_last.py), a gate's children. The planner's
    raises `RetryLater` for a transient failure (no response, 408, 429, 5xx); the object
    reaper's (`ObjectAccess`) has it judged by `failure`."""

    async def list_items(
        self,
        kind: KindSpec,
        namespace: str,
        *,
        label_selector: str,
        request_timeout: float | None = None,
    ) -> list[dict[str, Any]]: ...


class Handler(Protocol):
    """One function's logic. Returns the events it emitted (for tests and replies).

    Raises `RetryLater` for a transient failure: the runtime redelivers the same event
    after the delay, and dead-letters it when the tries run out. Any other exception is a
    bug and is treated like `RetryLater` with the runtime's default delay.

    `trust` is what the runtime established about where the event came from
    (functions/trust.py); `CLAIM` unless the runtime says otherwise.
    """

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]: ...


class RetryLater(FunctionError):
    """Not done yet, not failed either: deliver this event again after `delay` seconds.

    Raised for transient conditions (database unreachable, 429/5xx from the API server, a
    gate such as Argo archiving still pending). Nothing has been acknowledged.
    """

    def __init__(self, reason: str, delay: float = 5.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.delay = delay
