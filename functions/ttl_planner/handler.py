"""The ttl-planner handler: run lifecycle events in, schedules and audit events out.

- `run.finished` (or an engine's own event, adapted first): one decision per target;
  a schedule is put (or replaced when the deadline moved), or withdrawn for keep/never.
  Re-planning an unchanged run touches nothing, so redelivery and re-listing are free.
- `run.deleted`: the Kubernetes schedule is withdrawn (nothing is left to delete there);
  the database deadline stands, because rows outlive objects by design.
- Input that cannot be used becomes a `cleanup.failed` event with the reason.

Each decision is a span (`schedule <target>`, `cancel <target>`); the due event is created
inside it, so its own `traceparent` names the span that scheduled it, and the reaper's
trace, days later, links back to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from cloudevents.core.base import BaseCloudEvent

from events.adapters import Ignored, NeedsFetch, adapt_cloudevent, adapt_object
from events.builder import build_event, parse_payload
from events.errors import InvalidEvent
from events.kinds import DEFAULT_KINDS, KindSet, UnknownKind
from events.models import (
    CleanupCancelled,
    CleanupDue,
    CleanupFailed,
    CleanupScheduled,
    RunDeleted,
    RunFinished,
)
from events.observed import is_observed, marked
from events.original import capture_event
from events.run import ContractModel, RunRef, Target
from events.subjects import InvalidSubjectToken
from events.timeutil import format_rfc3339
from events.types import EventType
from functions.policy import Action, Decision, Policy, plan
from functions.ports import Emitter, ObjectFetcher, ScheduleStore, emit_all
from functions.tracing import (
    DEADLINE,
    POLICY,
    RUN_NAME,
    RUN_NAMESPACE,
    RUN_UID,
    SCHEDULE_ACTION,
    TARGET,
    creation_context,
    step_span,
)

SOURCE = "/lapse/ttl-planner"
STAGE = "planner"


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Planner:
    schedules: ScheduleStore
    emitter: Emitter
    policies: Sequence[Policy] = ()
    kinds: KindSet = DEFAULT_KINDS
    fetcher: ObjectFetcher | None = None
    clock: Callable[[], datetime] = field(default=_utcnow)

    async def handle(self, event: BaseCloudEvent) -> list[BaseCloudEvent]:
        """Handle one incoming event; returns the events it emitted."""
        try:
            found = await self._run_change(event)
            if found is None:
                return []
            change, observed = found
            if isinstance(change, RunDeleted):
                cancelled = await self._cancel(
                    change.run, Target.KUBERNETES, "the run object was deleted"
                )
                return await emit_all(self.emitter, [cancelled] if cancelled else [])
            self._check_kind(change.run)
            run, first_seen = _with_reference_time(change.run, self.clock())
            decisions = plan(run, self.policies, self.clock())
            produced = [
                await self._apply(run, d, keep_pending=first_seen, observed=observed)
                for d in decisions.values()
            ]
            return await emit_all(self.emitter, [e for e in produced if e is not None])
        except InvalidEvent as exc:  # also a uid that cannot be a subject token
            failed = CleanupFailed(reason=exc.reason, stage=STAGE, original=capture_event(event))
            return await emit_all(self.emitter, [_event(EventType.CLEANUP_FAILED, failed)])

    def _check_kind(self, run: RunRef) -> None:
        """Only configured kinds are planned: nothing would delete any other."""
        try:
            self.kinds.of(run.api_version, run.kind)
        except UnknownKind as exc:
            raise InvalidEvent(f"{exc}; not planned") from None

    async def _run_change(
        self, event: BaseCloudEvent
    ) -> tuple[RunFinished | RunDeleted, bool] | None:
        """The change and whether it describes a version lapse read from the API server
        itself (the runtime's mark, or this planner's own fetch: events/observed.py)."""
        observed = is_observed(event)
        if event.get_type() in (EventType.RUN_FINISHED, EventType.RUN_DELETED):
            payload = parse_payload(event)
            assert isinstance(payload, RunFinished | RunDeleted)
            return payload, observed
        result = adapt_cloudevent(event, self.kinds)
        if isinstance(result, NeedsFetch):
            result, observed = await self._fetch(result), True
        if isinstance(result, Ignored):
            return None
        return result, observed

    async def _fetch(self, ref: NeedsFetch) -> RunFinished | RunDeleted | Ignored:
        if self.fetcher is None:
            raise InvalidEvent(
                f"{ref.kind} {ref.namespace}/{ref.name} is only referenced and this planner "
                "has no Kubernetes access to read it (use ApiServerSource Resource mode)"
            )
        obj = await self.fetcher.fetch(ref.api_version, ref.kind, ref.namespace, ref.name)
        if obj is None:
            return Ignored(f"{ref.kind} {ref.namespace}/{ref.name} no longer exists")
        result = adapt_object(obj, ref.deleted, self.kinds)
        if isinstance(result, NeedsFetch):
            raise InvalidEvent(f"fetched {ref.kind} {ref.namespace}/{ref.name} is a reference")
        return result

    async def _apply(
        self, run: RunRef, decision: Decision, *, keep_pending: bool = False, observed: bool = False
    ) -> BaseCloudEvent | None:
        if decision.action is Action.CANCEL:
            return await self._cancel(run, decision.target, decision.reason)
        if decision.action is Action.INVALID:
            # The pending schedule (if any) stays: the reaper re-decides from the fresh
            # object at the deadline and will not delete on an invalid annotation either.
            failed = CleanupFailed(
                run=run, target=decision.target, reason=decision.reason, stage=STAGE
            )
            return _event(EventType.CLEANUP_FAILED, failed)
        assert decision.deadline is not None
        return await self._schedule(
            run,
            decision.target,
            decision.deadline,
            decision.policy,
            keep_pending=keep_pending,
            observed=observed,
        )

    async def _schedule(
        self,
        run: RunRef,
        target: Target,
        deadline: datetime,
        policy: str,
        *,
        keep_pending: bool = False,
        observed: bool = False,
    ) -> BaseCloudEvent | None:
        attributes = {**_run_attributes(run, target), DEADLINE: format_rfc3339(deadline)}
        with step_span(f"schedule {target.value}", {**attributes, POLICY: policy}) as span:
            pending = await self.schedules.get(target, run.uid)
            if pending is not None and (pending.deadline == deadline or keep_pending):
                span.set_attribute(SCHEDULE_ACTION, "unchanged")
                return None
            due = CleanupDue(
                run=run, target=target, deadline=deadline, policy=policy, scheduled_at=self.clock()
            )
            event = marked(_event(EventType.CLEANUP_DUE, due), observed)
            await self.schedules.put(target, run.uid, deadline, event)
            span.set_attribute(SCHEDULE_ACTION, "replaced" if pending is not None else "created")
            scheduled = CleanupScheduled(
                run=run,
                target=target,
                deadline=deadline,
                policy=policy,
                replaced=pending is not None,
            )
            return _event(EventType.CLEANUP_SCHEDULED, scheduled)

    async def _cancel(self, run: RunRef, target: Target, reason: str) -> BaseCloudEvent | None:
        with step_span(f"cancel {target.value}", _run_attributes(run, target)) as span:
            if not await self.schedules.cancel(target, run.uid):
                span.set_attribute(SCHEDULE_ACTION, "none")
                return None
            span.set_attribute(SCHEDULE_ACTION, "cancelled")
            cancelled = CleanupCancelled(run=run, target=target, reason=reason)
            return _event(EventType.CLEANUP_CANCELLED, cancelled)

    async def apply(self, run: RunRef, decision: Decision) -> list[BaseCloudEvent]:
        """Carry out one decision made by the caller, e.g. `lapse reconcile`'s database
        deadline for rows whose run object is gone (planning both targets would schedule
        the deletion of an object that no longer exists). Idempotent like `handle`."""
        try:
            produced = await self._apply(run, decision)
        except InvalidSubjectToken as exc:
            failed = CleanupFailed(run=run, target=decision.target, reason=exc.reason, stage=STAGE)
            produced = _event(EventType.CLEANUP_FAILED, failed)
        return await emit_all(self.emitter, [produced] if produced is not None else [])


def _with_reference_time(run: RunRef, now: datetime) -> tuple[RunRef, bool]:
    """A run that finished without saying when (no finishedAt) is timed from when lapse
    first saw it finished: `now` the first time, and a pending schedule is then never moved
    by seeing it again (a re-list would otherwise push its deadline on and on). The reaper
    reads the same reference time back from the due event (verdict.py)."""
    if run.finished_at is not None:
        return run, False
    return run.model_copy(update={"finished_at": now}), True


def _event(event_type: EventType, data: ContractModel) -> BaseCloudEvent:
    """An event of this planner, carrying the trace context it is created in."""
    return build_event(event_type, source=SOURCE, data=data, **creation_context())


def _run_attributes(run: RunRef, target: Target) -> dict[str, str]:
    return {
        RUN_NAMESPACE: run.namespace,
        RUN_NAME: run.name,
        RUN_UID: run.uid,
        TARGET: target.value,
    }
