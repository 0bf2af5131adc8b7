"""The ttl-planner handler: run lifecycle events in, schedules and audit events out.

- `run.finished` (or an engine's own event, adapted first): one decision per target;
  a schedule is put (or replaced when the deadline moved), or withdrawn for keep/never.
  Re-planning an unchanged run touches nothing, so redelivery and re-listing are free.
- `run.deleted`: the Kubernetes schedule is withdrawn (nothing is left to delete there);
  the database deadline stands, because rows outlive objects by design.
- Input that cannot be used becomes a `cleanup.failed` event with the reason.
- An event lapse did not read itself (`Trust.CLAIM`: over HTTP, a replay) is checked
  against the API server first: a finished run is planned from the object as read, a
  claim the API server contradicts (a Running run said to be finished, a run the API server
  does not have) is refused and recorded.
- A deletion claim (`run.deleted` as a `CLAIM`, any ApiServerSource `ref.delete`) withdraws
  nothing until the API server confirms the uid is gone, read where lapse stored the run,
  not where the claim says (`claims.py`); otherwise it is refused and recorded.

Each decision is a span (`schedule <target>`, `cancel <target>`); the due event is created
inside it, so its own `traceparent` names the span that scheduled it, and the reaper's
trace, days later, links back to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from cloudevents.core.base import BaseCloudEvent

from lapse.events.adapters import AdapterResult, Ignored, NeedsFetch, adapt_cloudevent, adapt_object
from lapse.events.artifacts import RunArtifacts
from lapse.events.builder import build_event, parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.kinds import DEFAULT_KINDS, KindSet, UnknownKind
from lapse.events.models import (
    CleanupCancelled,
    CleanupDue,
    CleanupFailed,
    CleanupScheduled,
    RunDeleted,
    RunFinished,
)
from lapse.events.original import capture_event
from lapse.events.run import ContractModel, RunRef, Target
from lapse.events.subjects import InvalidSubjectToken
from lapse.events.timeutil import format_rfc3339
from lapse.events.types import EventType
from lapse.functions.keep_last import listed_runs
from lapse.functions.policy import (
    KEEP_LAST_SOURCE,
    Action,
    Counted,
    Decision,
    Policy,
    counted_out,
    decide,
    keep_last_group,
    plan,
    with_count,
)
from lapse.functions.ports import (
    Emitter,
    ObjectFetcher,
    ObjectLister,
    RetryLater,
    ScheduleStore,
    emit_all,
)
from lapse.functions.tracing import (
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
from lapse.functions.trust import Provenance, Trust
from lapse.functions.ttl_planner.artifacts import ArtifactPlanning
from lapse.functions.ttl_planner.claims import Refusal, judge_deletion, where_to_read

SOURCE = "/lapse/ttl-planner"
# Without object stores configured, the artifacts target has nothing to delete.
_TARGETS = (Target.KUBERNETES, Target.DATABASE)
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
    # Lists a keep_last group; without it no run is counted out (only TTLs apply).
    lister: ObjectLister | None = None
    clock: Callable[[], datetime] = field(default=_utcnow)
    # The artifacts target: planned only where object stores are configured.
    artifacts: ArtifactPlanning | None = None

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]:
        """Handle one incoming event; returns the events it emitted.

        An event lapse did not read itself (`trust` is a `CLAIM`: anything over HTTP, a
        replay) is planned from a fresh read of the object it names, or not at all
        (docs/security.md, "What each handler believes")."""
        try:
            change = await self._run_change(event, trust)
            if isinstance(change, _Refused):
                failed = CleanupFailed(
                    run=change.run,
                    reason=f"refused: {change.reason}; {change.consequence}",
                    stage=STAGE,
                    original=capture_event(event),
                )
                return await emit_all(self.emitter, [_event(EventType.CLEANUP_FAILED, failed)])
            if change is None:
                return []
            if isinstance(change.payload, RunDeleted):
                cancelled = await self._cancel(
                    change.payload.run, Target.KUBERNETES, "the run object was deleted"
                )
                return await emit_all(self.emitter, [cancelled] if cancelled else [])
            self._check_kind(change.payload.run)
            run, first_seen = _with_reference_time(change.payload.run, self.clock())
            targets = _TARGETS if self.artifacts is None else tuple(Target)
            decisions = plan(run, self.policies, self.clock(), targets)
            recorded = change.payload.artifacts
            counted, others, gone = await self._count(run)
            k8s = Target.KUBERNETES
            decisions[k8s] = with_count(decisions[k8s], counted.get(run.uid), run.finished_at)
            if gone:
                # Counted out and deleted already (another process's count came first):
                # nothing is left to delete, and a TTL put now would wait for nothing.
                decisions[k8s] = Decision(
                    k8s, Action.CANCEL, None, decisions[k8s].policy, "the run object is gone"
                )
            produced = [
                await self._apply(
                    run, d, keep_pending=first_seen, provenance=change.provenance, recorded=recorded
                )
                for d in decisions.values()
            ]
            return await emit_all(self.emitter, [e for e in produced + others if e is not None])
        except InvalidEvent as exc:  # also a uid that cannot be a subject token
            failed = CleanupFailed(reason=exc.reason, stage=STAGE, original=capture_event(event))
            return await emit_all(self.emitter, [_event(EventType.CLEANUP_FAILED, failed)])

    async def _count(
        self, run: RunRef
    ) -> tuple[dict[str, Counted], list[BaseCloudEvent | None], bool]:
        """The keep_last count of `run`'s group, from a fresh list of the group: what is
        counted out (by uid), the schedules moved for the group's other runs that it
        counted out now (docs/architecture.md, "Keep the last N"), and whether `run` itself
        is gone (not listed, and a GET agrees). The reaper counts again from its own fresh
        list before it deletes one of them."""
        found = keep_last_group(run, self.policies)
        if found is None or self.lister is None:
            return {}, [], False
        group, _ = found
        kind = self.kinds.of(run.api_version, run.kind)
        now = self.clock()
        attributes = {RUN_NAMESPACE: run.namespace, RUN_NAME: run.name, RUN_UID: run.uid}
        with step_span("count keep_last", {**attributes, POLICY: group.policy}):
            # Only finished objects count: where the kind labels them (Argo), a field group
            # (selector "") lists the namespace's finished ones, not every running one too.
            selector = ",".join(s for s in (kind.finished_selector, group.selector) if s)
            try:
                objects = await self.lister.list_items(kind, run.namespace, label_selector=selector)
            except RetryLater:
                raise
            except Exception as exc:
                # The run's own TTLs still stand; the count waits for the group's next
                # finish, and this says loudly why it did not happen (RBAC, most likely).
                failed = CleanupFailed(
                    run=run,
                    target=Target.KUBERNETES,
                    reason=f"keep_last: cannot list {kind.kind} objects of {group.describe()} "
                    f"in {run.namespace!r}: {exc}; nothing was counted out",
                    stage=STAGE,
                )
                return {}, [_event(EventType.CLEANUP_FAILED, failed)], False
            gone = not any(_uid(obj) == run.uid for obj in objects) and await self._gone(run)
            members = listed_runs(objects, kind)
            counted = counted_out(members, self.policies, now)
            moved: list[BaseCloudEvent | None] = []
            for member in members:
                if member.uid == run.uid or member.uid not in counted:
                    continue
                own = decide(member, Target.KUBERNETES, self.policies, now)
                decision = with_count(own, counted[member.uid], member.finished_at)
                if decision.policy.startswith(f"{KEEP_LAST_SOURCE}:"):
                    moved.append(
                        await self._apply(member, decision, provenance=Provenance.READ_BY_LAPSE)
                    )
            return counted, moved, gone

    async def _gone(self, run: RunRef) -> bool:
        """Whether the API server no longer has `run` (a GET, not the group's list: the
        run's labels may have changed since)."""
        if self.fetcher is None:
            return False
        obj = await self.fetcher.fetch(run.api_version, run.kind, run.namespace, run.name)
        return obj is None or _uid(obj) != run.uid

    def _check_kind(self, run: RunRef) -> None:
        """Only configured kinds are planned: nothing would delete any other."""
        try:
            self.kinds.of(run.api_version, run.kind)
        except UnknownKind as exc:
            raise InvalidEvent(f"{exc}; not planned") from None

    async def _run_change(self, event: BaseCloudEvent, trust: Trust) -> _Change | _Refused | None:
        """The change the event reports, as lapse may plan it."""
        claimed: AdapterResult
        if event.get_type() in (EventType.RUN_FINISHED, EventType.RUN_DELETED):
            payload = parse_payload(event)
            assert isinstance(payload, RunFinished | RunDeleted)
            claimed = payload
        else:
            claimed = adapt_cloudevent(event, self.kinds)
        if isinstance(claimed, NeedsFetch):
            if claimed.deleted:
                return await self._reference_deleted(claimed)
            fetched = await self._fetch(claimed)
            return (
                None if isinstance(fetched, Ignored) else _Change(fetched, Provenance.READ_BY_LAPSE)
            )
        if isinstance(claimed, Ignored):
            return None
        if trust.observed:
            # A version lapse read itself (its watcher, reconcile): believed as it is.
            return _Change(claimed, Provenance.READ_BY_LAPSE)
        if isinstance(claimed, RunDeleted):
            return await self._confirm_deleted(claimed.run.uid, claimed.run)
        return await self._verify(claimed)

    def _checker(self, what: str) -> ObjectFetcher:
        if self.fetcher is None:
            raise InvalidEvent(
                f"{what}: this planner has no Kubernetes access to check an event lapse did "
                "not read itself; not planned"
            )
        return self.fetcher

    async def _reference_deleted(self, ref: NeedsFetch) -> _Change | _Refused | None:
        """An ApiServerSource `ref.delete`: a name, and at most a uid. Which uid's deletion
        it claims is the reference's own, or else that of the object now under the name;
        either is then confirmed like any deletion claim (`_confirm_deleted`). A reference
        to a name the API server no longer has, without a uid, says whose schedule to
        withdraw to no one: nothing is withdrawn (the object reaper finds the object gone
        at its deadline: `already_gone`)."""
        fetcher = self._checker(f"{ref.kind} {ref.namespace}/{ref.name}")
        obj = await fetcher.fetch(ref.api_version, ref.kind, ref.namespace, ref.name)
        named = adapt_object(obj, True, self.kinds) if obj is not None else None
        run = named.run if isinstance(named, RunDeleted) else None
        uid = ref.uid or (run.uid if run is not None else None)
        if uid is None:
            return None
        return await self._confirm_deleted(uid, run if run is not None and run.uid == uid else None)

    async def _confirm_deleted(self, uid: str, claimed: RunRef | None) -> _Change | _Refused | None:
        """A claim that the object with `uid` was deleted, believed only when the API server
        confirms it: the object is read by the namespace and name lapse stored with the
        schedule of `uid` (the claim's own only when nothing is stored, so nothing would be
        withdrawn), and it must be gone or another uid's now. A failed read raises: the
        event is delivered again, and nothing is withdrawn meanwhile."""
        stored = await self.schedules.get(Target.KUBERNETES, uid, with_due=True)
        read_at = where_to_read(uid, stored, claimed)
        if read_at is None:
            return None
        if isinstance(read_at, Refusal):
            return _Refused(claimed, read_at.reason, _NOT_WITHDRAWN)
        fetcher = self._checker(f"{read_at.kind} {read_at.subject}")
        obj = await fetcher.fetch(
            read_at.api_version, read_at.kind, read_at.namespace, read_at.name
        )
        refusal = judge_deletion(uid, read_at, claimed, obj)
        if refusal is not None:
            return _Refused(read_at, refusal.reason, _NOT_WITHDRAWN)
        return _Change(RunDeleted(run=read_at), Provenance.CLAIMED)

    async def _verify(self, claim: RunFinished) -> _Change | _Refused | None:
        """A claim checked against the API server: what it says of the object now."""
        run = claim.run
        fetcher = self._checker(f"{run.kind} {run.subject}")
        obj = await fetcher.fetch(run.api_version, run.kind, run.namespace, run.name)
        uid = (obj or {}).get("metadata", {}).get("uid")
        exists = obj is not None and uid == run.uid
        if not exists:
            # Gone (or the name is another run's now): nothing lapse can read says what the
            # run was. Its namespace and labels choose the policy, and its run ids choose
            # the rows, so believing them could delete another run's rows early: nothing
            # is planned. `lapse reconcile` schedules the rows of runs whose object is gone
            # from the database's own records.
            return _Refused(
                run,
                f"the API server has no {run.kind} {run.subject} with uid {run.uid}, and lapse "
                "plans nothing it cannot read (lapse reconcile schedules the rows of runs "
                "whose object is gone)",
            )
        fresh = adapt_object(obj, False, self.kinds)
        if isinstance(fresh, RunFinished):
            return _Change(fresh, Provenance.READ_BY_LAPSE)
        if isinstance(fresh, Ignored):
            return _Refused(run, f"the API server says {fresh.reason}")
        raise InvalidEvent(f"read {run.kind} {run.subject} is not a run object")

    async def _fetch(self, ref: NeedsFetch) -> RunFinished | RunDeleted | Ignored:
        if self.fetcher is None:
            raise InvalidEvent(
                f"{ref.kind} {ref.namespace}/{ref.name} is only referenced and this planner "
                "has no Kubernetes access to read it (use ApiServerSource Resource mode)"
            )
        obj = await self.fetcher.fetch(ref.api_version, ref.kind, ref.namespace, ref.name)
        if obj is None:
            return Ignored(f"{ref.kind} {ref.namespace}/{ref.name} no longer exists")
        result = adapt_object(obj, False, self.kinds)
        if isinstance(result, NeedsFetch):
            raise InvalidEvent(f"fetched {ref.kind} {ref.namespace}/{ref.name} is a reference")
        return result

    async def _apply(
        self,
        run: RunRef,
        decision: Decision,
        *,
        keep_pending: bool = False,
        provenance: Provenance,
        recorded: RunArtifacts | None = None,
    ) -> BaseCloudEvent | None:
        if decision.action is Action.CANCEL:
            if decision.target is Target.ARTIFACTS and self.artifacts is not None:
                # A kept run's artifacts stay referenced: another run that shares one (a
                # cached output) never takes it (functions/artifact_reaper/verdict.py).
                await self.artifacts.keep(run, recorded, self.kinds)
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
            provenance=provenance,
            recorded=recorded,
        )

    async def _schedule(
        self,
        run: RunRef,
        target: Target,
        deadline: datetime,
        policy: str,
        *,
        keep_pending: bool = False,
        provenance: Provenance,
        recorded: RunArtifacts | None = None,
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
            event = _event(EventType.CLEANUP_DUE, due)
            if target is Target.ARTIFACTS and self.artifacts is not None:
                # Captured now: the object is gone by the time its artifacts are due. The
                # capture is stored first, so a fired schedule always finds it.
                await self.artifacts.capture(run, recorded, self.kinds)
            await self.schedules.put(target, run.uid, deadline, event, provenance=provenance)
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

    async def apply(
        self, run: RunRef, decision: Decision, provenance: Provenance
    ) -> list[BaseCloudEvent]:
        """Carry out one decision made by the caller, e.g. `lapse reconcile`'s database
        deadline for rows whose run object is gone (planning both targets would schedule
        the deletion of an object that no longer exists). Idempotent like `handle`."""
        try:
            produced = await self._apply(run, decision, provenance=provenance)
        except InvalidSubjectToken as exc:
            failed = CleanupFailed(run=run, target=decision.target, reason=exc.reason, stage=STAGE)
            produced = _event(EventType.CLEANUP_FAILED, failed)
        return await emit_all(self.emitter, [produced] if produced is not None else [])


@dataclass(frozen=True, slots=True)
class _Change:
    """A run change to plan. `provenance`: whether its version is one lapse read from the API
    server (its schedules say so to the reaper)."""

    payload: RunFinished | RunDeleted
    provenance: Provenance


@dataclass(frozen=True, slots=True)
class _Refused:
    """A claim the API server contradicts: nothing is planned, and it is recorded. `run`:
    the run the refusal is about, if any can be named."""

    run: RunRef | None
    reason: str
    consequence: str = "nothing was planned"


_NOT_WITHDRAWN = "no schedule was withdrawn"


def _uid(obj: Mapping[str, Any]) -> object:
    metadata = obj.get("metadata")
    return metadata.get("uid") if isinstance(metadata, Mapping) else None


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
