"""The ttl-planner handler: run lifecycle events in, schedules and audit events out.

- `run.finished` (or an engine's own event, adapted first): one decision per target;
  a schedule is put (or replaced when the deadline moved), or withdrawn for keep/never.
  Re-planning an unchanged run touches nothing, so redelivery and re-listing are free.
- `run.deleted`: the Kubernetes schedule is withdrawn (nothing is left to delete there);
  the database deadline stands, because rows outlive objects by design.
- Input that cannot be used becomes a `cleanup.failed` event with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from cloudevents.core.base import BaseCloudEvent

from events.adapters import Ignored, NeedsFetch, adapt_cloudevent, adapt_object
from events.builder import build_event, parse_payload
from events.errors import InvalidEvent
from events.models import (
    CleanupCancelled,
    CleanupDue,
    CleanupFailed,
    CleanupScheduled,
    RunDeleted,
    RunFinished,
)
from events.original import capture_event
from events.run import RunRef, Target
from events.subjects import InvalidSubjectToken
from events.types import EventType
from functions.policy import Action, Decision, Policy, plan
from functions.ports import Emitter, ObjectFetcher, ScheduleStore

SOURCE = "/lapse/ttl-planner"
STAGE = "planner"


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Planner:
    schedules: ScheduleStore
    emitter: Emitter
    policies: Sequence[Policy] = ()
    fetcher: ObjectFetcher | None = None
    clock: Callable[[], datetime] = field(default=_utcnow)

    async def handle(self, event: BaseCloudEvent) -> list[BaseCloudEvent]:
        """Handle one incoming event; returns the events it emitted."""
        try:
            change = await self._run_change(event)
            if change is None:
                return []
            if isinstance(change, RunDeleted):
                cancelled = await self._cancel(
                    change.run, Target.KUBERNETES, "the run object was deleted"
                )
                return await self._emit([cancelled] if cancelled else [])
            decisions = plan(change.run, self.policies, self.clock())
            produced = [await self._apply(change.run, d) for d in decisions.values()]
            return await self._emit([e for e in produced if e is not None])
        except (InvalidEvent, InvalidSubjectToken) as exc:
            reason = exc.reason if isinstance(exc, InvalidEvent) else str(exc)
            failed = CleanupFailed(reason=reason, stage=STAGE, original=capture_event(event))
            return await self._emit(
                [build_event(EventType.CLEANUP_FAILED, source=SOURCE, data=failed)]
            )

    async def _run_change(self, event: BaseCloudEvent) -> RunFinished | RunDeleted | None:
        if event.get_type() in (EventType.RUN_FINISHED, EventType.RUN_DELETED):
            payload = parse_payload(event)
            assert isinstance(payload, RunFinished | RunDeleted)
            return payload
        result = adapt_cloudevent(event)
        if isinstance(result, NeedsFetch):
            result = await self._fetch(result)
        if isinstance(result, Ignored):
            return None
        return result

    async def _fetch(self, ref: NeedsFetch) -> RunFinished | RunDeleted | Ignored:
        if self.fetcher is None:
            raise InvalidEvent(
                f"{ref.kind} {ref.namespace}/{ref.name} is only referenced and this planner "
                "has no Kubernetes access to read it (use ApiServerSource Resource mode)"
            )
        obj = await self.fetcher.fetch(ref.api_version, ref.kind, ref.namespace, ref.name)
        if obj is None:
            return Ignored(f"{ref.kind} {ref.namespace}/{ref.name} no longer exists")
        result = adapt_object(obj, ref.deleted)
        if isinstance(result, NeedsFetch):
            raise InvalidEvent(f"fetched {ref.kind} {ref.namespace}/{ref.name} is a reference")
        return result

    async def _apply(self, run: RunRef, decision: Decision) -> BaseCloudEvent | None:
        if decision.action is Action.CANCEL:
            return await self._cancel(run, decision.target, decision.reason)
        if decision.action is Action.INVALID:
            # The pending schedule (if any) stays: the reaper re-decides from the fresh
            # object at the deadline and will not delete on an invalid annotation either.
            failed = CleanupFailed(
                run=run, target=decision.target, reason=decision.reason, stage=STAGE
            )
            return build_event(EventType.CLEANUP_FAILED, source=SOURCE, data=failed)
        assert decision.deadline is not None
        return await self._schedule(run, decision.target, decision.deadline, decision.source)

    async def _schedule(
        self, run: RunRef, target: Target, deadline: datetime, policy: str
    ) -> BaseCloudEvent | None:
        pending = await self.schedules.get(target, run.uid)
        if pending is not None and pending.deadline == deadline:
            return None
        due = CleanupDue(
            run=run, target=target, deadline=deadline, policy=policy, scheduled_at=self.clock()
        )
        await self.schedules.put(
            target, run.uid, deadline, build_event(EventType.CLEANUP_DUE, source=SOURCE, data=due)
        )
        scheduled = CleanupScheduled(
            run=run, target=target, deadline=deadline, policy=policy, replaced=pending is not None
        )
        return build_event(EventType.CLEANUP_SCHEDULED, source=SOURCE, data=scheduled)

    async def _cancel(self, run: RunRef, target: Target, reason: str) -> BaseCloudEvent | None:
        if not await self.schedules.cancel(target, run.uid):
            return None
        cancelled = CleanupCancelled(run=run, target=target, reason=reason)
        return build_event(EventType.CLEANUP_CANCELLED, source=SOURCE, data=cancelled)

    async def _emit(self, events: list[BaseCloudEvent]) -> list[BaseCloudEvent]:
        for event in events:
            await self.emitter.emit(event)
        return events

    async def apply(self, run: RunRef, decision: Decision) -> list[BaseCloudEvent]:
        """Carry out one decision made by the caller, e.g. `lapse reconcile`'s database
        deadline for rows whose run object is gone (planning both targets would schedule
        the deletion of an object that no longer exists). Idempotent like `handle`."""
        try:
            produced = await self._apply(run, decision)
        except InvalidSubjectToken as exc:
            failed = CleanupFailed(run=run, target=decision.target, reason=str(exc), stage=STAGE)
            produced = build_event(EventType.CLEANUP_FAILED, source=SOURCE, data=failed)
        return await self._emit([produced] if produced is not None else [])
