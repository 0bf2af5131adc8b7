"""The object reaper: `cleanup.due` (target kubernetes) in, at most one DELETE and one
outcome event out, for every configured kind (events/kinds.py) with one safety sequence.

The decision is `classify` / `as_planned` (pure, verdict.py) and the kind's gates (pure,
gates.py); this shell only does the I/O around them: a fresh GET (and a LIST of children
for kinds whose gates need it), the rate limiter and mass-deletion brake, the guarded
DELETE, re-scheduling through the ScheduleStore and emitting the outcome. Every branch is
safe to repeat: a second delivery of the same due event finds the object gone and
reports `already_gone`.

Outcomes (`cleanup.completed` unless noted):
- deleted       DELETE accepted (uid + resourceVersion preconditions held).
- already_gone  404 on GET or DELETE, or a deletion already in progress.
- replaced      the name now belongs to an object with another uid: never touched.
- kept          keep annotation, a TTL of never, a re-run that is not finished, or a
                namespace outside safety.namespaces (`detail` says which).
- rescheduled   not deleted yet, a new schedule was put: the deadline moved later, a gate
                (Argo archiving, KFP persistence, Tekton TaskRuns) is closed, or the brake
                is engaged.
- dry_run       safety.dry_run: everything checked, nothing deleted.
- cleanup.failed  a kind lapse is not configured for, invalid annotation or object, a gate
                still closed after max_wait, RBAC refusal (401/403) or another permanent
                API error; nothing deleted. When the brake trips, one cleanup.failed with
                stage "brake" is the alert.
Transient API failures (no response, 408, 429, 5xx) raise `RetryLater`.

Every event it makes carries the trace context it was made in (`creation_context`): an
outcome points at the reaper's span, a re-scheduled due event at the span that moved it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Literal, TypeAlias, assert_never

from cloudevents.core.base import BaseCloudEvent

from lapse.events.builder import as_outcome_of, build_event, parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.kinds import DEFAULT_KINDS, TEKTON_TASKRUN, KindSet, KindSpec, UnknownKind
from lapse.events.models import CleanupDue
from lapse.events.original import capture_event
from lapse.events.run import RunRef, Target
from lapse.events.subjects import InvalidSubjectToken
from lapse.events.types import EventType, Outcome
from lapse.functions.object_reaper.failures import judge_failure
from lapse.functions.object_reaper.gates import children_selector, needs_children, out_of_scope
from lapse.functions.object_reaper.ports import EventRecorder, ObjectAccess
from lapse.functions.object_reaper.verdict import (
    AlreadyGone,
    Delete,
    GaveUp,
    Invalid,
    Kept,
    Refused,
    Replaced,
    Reschedule,
    Verdict,
    Wait,
    as_planned,
    classify,
    counts,
)
from lapse.functions.outcomes import Outcomes
from lapse.functions.policy import Policy
from lapse.functions.ports import Emitter, RetryLater, ScheduleStore, emit_all
from lapse.functions.ratelimit import Brake, RateLimit, local_limits
from lapse.functions.safety import SafetyConfig
from lapse.functions.tracing import creation_context
from lapse.functions.trust import Provenance, Trust

SOURCE: Final = "/lapse/object-reaper"
STAGE: Final = "object-reaper"
BRAKE_STAGE: Final = "brake"
DELETED_EVENT_REASON: Final = "LapseDeleted"
# 409 means the object changed between GET and DELETE; a few re-reads settle it, more
# means something keeps writing it, and the event is better delivered again later.
MAX_CONFLICTS: Final = 3
CONFLICT_RETRY_DELAY: Final = 2.0


PropagationPolicy = Literal["Background", "Foreground", "Orphan"]

log = logging.getLogger(__name__)


def _utcnow() -> datetime:
    return datetime.now(UTC)


# --- the safety sequence's states (`ObjectReaper._reap`) --------------------------------


@dataclass(frozen=True, slots=True)
class _Scope:
    """1. Is the namespace in scope."""


@dataclass(frozen=True, slots=True)
class _Planned:
    """2'-3'. Judge the version the due event carries, without reading it."""


@dataclass(frozen=True, slots=True)
class _Read:
    """2-3. Read the object fresh and judge it."""


@dataclass(frozen=True, slots=True)
class _Admit:
    """4. Ask the brake and the rate limit before deleting what `verdict` judged.
    `provenance`: whether that version is one lapse read (a rescheduled due event says so)."""

    verdict: Delete
    provenance: Provenance


@dataclass(frozen=True, slots=True)
class _Remove:
    """5. DELETE, held to the uid and resourceVersion `verdict` judged."""

    verdict: Delete
    conflicts: int


@dataclass(frozen=True, slots=True)
class _Reread:
    """2-3 again after a 409, already admitted: read, judge, and DELETE or end."""

    conflicts: int


_State: TypeAlias = _Scope | _Planned | _Read | _Admit | _Remove | _Reread


@dataclass(frozen=True, slots=True)
class _Conflict:
    """409 on DELETE: the object changed since the version judged."""


@dataclass(frozen=True, slots=True)
class _Deleted:
    """The DELETE was accepted for this verdict."""

    verdict: Delete


@dataclass(frozen=True, slots=True)
class _Skipped:
    """Outside safety.namespaces: not read, not touched."""

    reason: str


@dataclass(frozen=True, slots=True)
class _Held:
    """The brake held the deletion back: these events say so (rescheduled, and the alert)."""

    events: tuple[BaseCloudEvent, ...]


# Where the sequence ends: one of these is concluded into the due event's outcome.
_End: TypeAlias = Verdict | _Deleted | _Skipped | _Held


@dataclass(frozen=True)
class ObjectReaper:
    """Constructed once per process; the rate limiter and brake live as long as it does.

    `kinds` are the kinds it may delete (anything else is refused, with the reason).
    `propagation_policy` applies where a kind sets none. `recorder`, when given
    (kubernetes.record_events), writes a Kubernetes Event in the object's namespace for
    each deletion. `request_timeout` bounds each API call. `rate_limit` and `brake` are
    shared with the deployment's other reapers when given; otherwise this process keeps its
    own (`safety.max_deletions_per_second`, `safety.mass_deletion_brake`).
    """

    objects: ObjectAccess
    schedules: ScheduleStore
    emitter: Emitter
    policies: Sequence[Policy] = ()
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    kinds: KindSet = DEFAULT_KINDS
    propagation_policy: PropagationPolicy = "Background"
    clock: Callable[[], datetime] = field(default=_utcnow)
    recorder: EventRecorder | None = None
    request_timeout: float = 30.0
    rate_limit: RateLimit | None = field(default=None, repr=False, compare=False)
    brake: Brake | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        rate_limit, brake = local_limits(self.safety, self.clock().timestamp())
        if self.rate_limit is None:
            object.__setattr__(self, "rate_limit", rate_limit)
        if self.brake is None:
            object.__setattr__(self, "brake", brake)

    @functools.cached_property
    def _outcomes(self) -> Outcomes:
        return Outcomes(SOURCE, Target.KUBERNETES, STAGE, self.clock)

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]:
        """Handle one due event; returns the events it emitted. May raise `RetryLater`.

        The one exit: every event it emits carries an id derived from the due event's, so a
        redelivery that ends the same way is dropped by the audit stream, never doubled."""
        produced = await self._outcome_of(event, trust)
        return await emit_all(self.emitter, [as_outcome_of(event, e) for e in produced])

    async def _outcome_of(self, event: BaseCloudEvent, trust: Trust) -> list[BaseCloudEvent]:
        # What a refusal quotes of its input is captured only for a refusal: on the way to
        # a deletion it was a copy of the whole event made and thrown away.
        try:
            due = parse_payload(event, CleanupDue)
        except InvalidEvent as exc:
            return [self._outcomes.failed(None, exc.reason, capture_event(event))]
        if due.target is not Target.KUBERNETES:
            return []  # the database deadline belongs to the row-reaper
        try:
            kind = self.kinds.of(due.run.api_version, due.run.kind)
        except UnknownKind as exc:
            failed = self._outcomes.failed(
                due.run, f"{exc}; nothing was deleted", capture_event(event)
            )
            return [failed]
        try:
            end = await self._reap(due, kind, self._trusts_planned(trust))
            return await self._conclude(due, kind, end, event)
        except InvalidSubjectToken as exc:
            reason = f"cannot reschedule: {exc}"
            return [self._outcomes.failed(due.run, reason, capture_event(event))]

    def _trusts_planned(self, trust: Trust) -> bool:
        """Whether the version the due event carries may be judged without reading it:
        always with read_before_delete false, never with true, and with auto only when
        lapse itself read that version from the API server (functions/trust.py)."""
        setting = self.safety.read_before_delete
        return setting is False or (setting == "auto" and trust.observed)

    async def _reap(self, due: CleanupDue, kind: KindSpec, trusted: bool) -> _End:
        """The safety sequence (docs/architecture.md, "How a deletion is made safe"), as a
        state machine: each state names the next step, and the loop ends in one `_End`.
        Every step is safe to repeat: redelivery finds the object gone."""
        state: _State = _Scope()
        while True:
            match state:
                case _Scope():
                    # 1. Outside safety.namespaces lapse does not even read (its RBAC may
                    #    rightly be missing there).
                    reason = out_of_scope(due.run.namespace, self.safety.namespaces)
                    if reason is not None:
                        return _Skipped(reason)
                    state = _Planned() if trusted else _Read()
                case _Planned():
                    # 2'-3'. The version the due event carries, judged as it is (it is one
                    #    lapse read, or read_before_delete is off): deletable now, or read.
                    planned = self._as_planned(due, kind)
                    # Lapse's own read, unless read_before_delete is off for a claim.
                    provenance = (
                        Provenance.READ_BY_LAPSE
                        if self.safety.read_before_delete == "auto"
                        else Provenance.CLAIMED
                    )
                    state = _Read() if planned is None else _Admit(planned, provenance)
                case _Read():
                    # 2. A fresh read (and the children the kind's gates look at), and
                    # 3. the pure verdict on the object as it is now (verdict.py).
                    verdict = await self._read_and_classify(due, kind)
                    if not isinstance(verdict, Delete) or verdict.dry_run:
                        return verdict
                    state = _Admit(verdict, Provenance.READ_BY_LAPSE)
                case _Admit(verdict=verdict, provenance=provenance):
                    # 4. The mass-deletion brake, then the rate limit: once per due event.
                    held = await self._admit(verdict, provenance)
                    if held is not None:
                        return held
                    state = _Remove(verdict, conflicts=0)
                case _Remove(verdict=verdict, conflicts=conflicts):
                    # 5. DELETE only if uid and resourceVersion are the ones judged.
                    result = await self._delete(verdict, kind)
                    if not isinstance(result, _Conflict):
                        return result
                    if conflicts + 1 >= MAX_CONFLICTS:
                        raise RetryLater(
                            f"{kind.kind} {due.run.subject} changed {MAX_CONFLICTS} times "
                            "between read and delete; trying again later",
                            CONFLICT_RETRY_DELAY,
                        )
                    state = _Reread(conflicts + 1)
                case _Reread(conflicts=conflicts):
                    # 409: the object changed since it was judged; read and judge again
                    # (already admitted: the brake counts a due event once).
                    verdict = await self._read_and_classify(due, kind)
                    if not isinstance(verdict, Delete) or verdict.dry_run:
                        return verdict
                    state = _Remove(verdict, conflicts)

    def _as_planned(self, due: CleanupDue, kind: KindSpec) -> Delete | None:
        return as_planned(due, kind, self.policies, self.safety, self.clock())

    async def _read_and_classify(self, due: CleanupDue, kind: KindSpec) -> Verdict:
        """GET (and the children its gates need), judge; and for a run of a keep_last group
        that its clocks do not make due yet, LIST the group and judge again with the count.
        A run missing from its group's list changed since the GET (deleted, most often,
        by another reaper's count): it is read again, once, rather than judged uncounted."""
        run = due.run
        for attempt in range(2):
            try:
                fresh = await self.objects.get(
                    kind, run.namespace, run.name, request_timeout=self.request_timeout
                )
            except Exception as exc:
                return self._call_failed(exc, "get", run, kind)
            children: list[dict[str, Any]] = []
            if fresh is not None and needs_children(kind):
                try:
                    children = await self.objects.list_items(
                        TEKTON_TASKRUN,
                        run.namespace,
                        label_selector=children_selector(run),
                        request_timeout=self.request_timeout,
                    )
                except Exception as exc:
                    return self._call_failed(exc, "list", run, TEKTON_TASKRUN)
            now = self.clock()
            verdict = classify(fresh, due, kind, self.policies, self.safety, now, children)
            selector = counts(verdict, self.policies)
            if selector is None:
                return verdict
            # Not due by its clocks, but in a keep_last group: count the group as it is
            # now (the DELETE is still held to the version of `fresh` judged here).
            try:
                group = await self.objects.list_items(
                    kind,
                    run.namespace,
                    label_selector=selector,
                    request_timeout=self.request_timeout,
                )
            except Exception as exc:
                return self._call_failed(exc, "list", run, kind)
            listed = any(obj.get("metadata", {}).get("uid") == run.uid for obj in group)
            if listed or attempt:
                break
        return classify(fresh, due, kind, self.policies, self.safety, now, children, group)

    async def _delete(self, verdict: Delete, kind: KindSpec) -> _Deleted | _Conflict | Verdict:
        """The guarded DELETE."""
        run = verdict.run
        try:
            await self.objects.delete(
                kind,
                run.namespace,
                run.name,
                uid=run.uid,
                resource_version=verdict.resource_version,
                propagation_policy=self._propagation(kind),
                request_timeout=self.request_timeout,
            )
        except Exception as exc:
            failure = self.objects.failure(exc)
            if failure is not None and failure.status == 404:
                return AlreadyGone(f"{kind.kind} {run.subject} was deleted by someone else")
            if failure is not None and failure.status == 409:
                return _Conflict()
            return self._call_failed(exc, "delete", run, kind)
        return _Deleted(verdict)

    def _propagation(self, kind: KindSpec) -> str:
        return kind.propagation or self.propagation_policy

    def _call_failed(self, exc: Exception, verb: str, run: RunRef, kind: KindSpec) -> Refused:
        failure = self.objects.failure(exc)
        if failure is None:
            raise exc  # not an API failure: a bug, let the runtime see it
        return judge_failure(failure, verb, run, kind)

    async def _admit(self, verdict: Delete, provenance: Provenance) -> _Held | None:
        """Brake, then rate limit. None: go ahead; otherwise the events of holding back.
        `provenance`: whether the verdict's version is one lapse read (kept on a rescheduled
        event)."""
        now = self.clock()
        assert self.brake is not None and self.rate_limit is not None  # set in __post_init__
        brake = await self.brake.admit(now.timestamp())
        if not brake.admitted:
            assert brake.until is not None
            until = datetime.fromtimestamp(brake.until, UTC)
            produced = []
            if brake.tripped:
                settings = self.safety.mass_deletion_brake
                window = int(settings.window.total_seconds())
                produced.append(
                    self._outcomes.failed(
                        verdict.run,
                        f"mass-deletion brake engaged: more than {settings.max_due} deletions "
                        f"within {window}s; deleting is paused until {until.isoformat()} "
                        "and due objects are rescheduled (check the policies; raise "
                        "safety.mass_deletion_brake.max_due if this volume is expected)",
                        stage=BRAKE_STAGE,
                    )
                )
            await self._put(
                verdict.run, verdict.deadline, verdict.policy, fire_at=until, provenance=provenance
            )
            detail = f"mass-deletion brake engaged: rescheduled for {until.isoformat()}"
            produced.append(
                self._outcomes.completed(verdict.run, Outcome.RESCHEDULED, verdict.deadline, detail)
            )
            return _Held(tuple(produced))
        # Delayed in arrival order, never dropped. The runtime must keep
        # (in-flight events / rate) well below the consumer's ack wait.
        wait = await self.rate_limit.reserve(now.timestamp())
        if wait > 0:
            await asyncio.sleep(wait)
        return None

    async def _conclude(
        self,
        due: CleanupDue,
        kind: KindSpec,
        verdict: _End,
        event: BaseCloudEvent,
    ) -> list[BaseCloudEvent]:
        ref = due.run
        match verdict:
            case _Skipped(reason=reason):
                return [self._outcomes.completed(ref, Outcome.SKIPPED, due.deadline, reason)]
            case _Held(events=events):
                return list(events)
            case _Deleted(verdict=done):
                detail = f"deleted ({done.policy}, propagation {self._propagation(kind)})"
                completed = self._outcomes.completed(
                    done.run, Outcome.DELETED, done.deadline, detail
                )
                await self._record_deletion(done, completed)
                return [completed]
            case AlreadyGone(detail=detail):
                return [self._outcomes.completed(ref, Outcome.ALREADY_GONE, due.deadline, detail)]
            case Replaced(current_uid=uid):
                detail = (
                    f"{ref.subject} is now a different {kind.kind} (uid {uid}); "
                    f"the run with uid {ref.uid} is gone and the new one is not touched"
                )
                return [self._outcomes.completed(ref, Outcome.REPLACED, due.deadline, detail)]
            case Kept(run=run, reason=reason):
                return [self._outcomes.completed(run, Outcome.KEPT, due.deadline, reason)]
            case Reschedule(run=run, deadline=deadline, policy=policy, reason=reason):
                # Every verdict but a planned Delete is judged on a fresh GET.
                await self._put(
                    run, deadline, policy, fire_at=deadline, provenance=Provenance.READ_BY_LAPSE
                )
                return [self._outcomes.completed(run, Outcome.RESCHEDULED, due.deadline, reason)]
            case Wait(run=run, deadline=deadline, policy=policy, retry_at=retry_at):
                await self._put(
                    run, deadline, policy, fire_at=retry_at, provenance=Provenance.READ_BY_LAPSE
                )
                return [
                    self._outcomes.completed(run, Outcome.RESCHEDULED, deadline, verdict.reason)
                ]
            case (
                GaveUp(run=run, reason=reason)
                | Invalid(run=run, reason=reason)
                | Refused(run=run, reason=reason)
            ):
                return [self._outcomes.failed(run, reason, capture_event(event))]
            case Delete(run=run, deadline=deadline, policy=policy):
                assert verdict.dry_run  # a real Delete is carried out by _reap
                detail = f"dry run: would delete ({policy})"
                return [
                    self._outcomes.completed(run, Outcome.DRY_RUN, deadline, detail, dry_run=True)
                ]
            case _:
                assert_never(verdict)

    async def _put(
        self,
        run: RunRef,
        deadline: datetime,
        policy: str,
        *,
        fire_at: datetime,
        provenance: Provenance,
    ) -> None:
        """A new due event for `deadline`, delivered at `fire_at`. `provenance`: whether `run`
        is a version lapse read (a fresh GET: every verdict but a planned Delete, which is
        one only when the due event it came in was `OBSERVED`)."""
        pending = await self.schedules.get(Target.KUBERNETES, run.uid)
        if pending is not None and pending.deadline == fire_at:
            return  # the planner (or an earlier delivery of this event) already did it
        due = CleanupDue(
            run=run,
            target=Target.KUBERNETES,
            deadline=deadline,
            policy=policy,
            scheduled_at=self.clock(),
        )
        event = build_event(EventType.CLEANUP_DUE, source=SOURCE, data=due, **creation_context())
        await self.schedules.put(Target.KUBERNETES, run.uid, fire_at, event, provenance=provenance)

    async def _record_deletion(self, done: Delete, completed: BaseCloudEvent) -> None:
        if self.recorder is None:
            return
        run = done.run
        latency = self.clock() - done.deadline
        message = (
            f"deleted by lapse ({done.policy}): deadline {done.deadline.isoformat()}, "
            f"{latency / timedelta(seconds=1):.1f}s later; event {completed.get_id()}"
        )
        try:
            await self.recorder.record(
                namespace=run.namespace,
                name=run.name,
                uid=run.uid,
                api_version=run.api_version,
                kind=run.kind,
                reason=DELETED_EVENT_REASON,
                message=message,
            )
        except Exception:
            # Best effort: the deletion happened and the outcome event is the record that
            # matters; a missing Kubernetes Event must not turn it into a retry.
            log.warning("could not record a Kubernetes Event for %s", run.subject, exc_info=True)
