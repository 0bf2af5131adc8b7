"""The object reaper: `cleanup.due` (target kubernetes) in, at most one DELETE and one
outcome event out, for every configured kind (events/kinds.py).

It runs the one reaping sequence (functions/reaping/sequence.py); this file is its port,
the Kubernetes half of the TTL-after-finished controller's `processJob`:

1. prove   the run is what the API server says under its name and uid; a version lapse
           itself read (delivered `OBSERVED`, read_before_delete auto) may be judged as
           it is, the DELETE held to its resourceVersion (functions/trust.py)
3. read    GET fresh (and the TaskRuns a gate looks at, and the keep_last group the
           count looks at)
4. judge   `classify` / `as_planned` (pure, verdict.py) and the kind's gates (gates.py)
6. remove  DELETE with uid and resourceVersion preconditions: 409 reads and judges again,
           404 is `already_gone`

Outcomes (`cleanup.completed` unless noted): deleted, already_gone (404, or being deleted),
replaced (the name is another uid's now: never touched), kept (keep annotation, a TTL of
never, a re-run), rescheduled (the deadline moved, a gate is closed, the brake engaged),
skipped (outside safety.namespaces), dry_run. `cleanup.failed`: a kind lapse is not
configured for, an invalid object or annotation, a gate still closed after max_wait, an
API server that refuses (401/403, a request it will never accept). An API server that does
not answer raises `RetryLater` (failures.Unavailable): waited out, never dead-lettered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, ClassVar, Final, Literal, TypeAlias, assert_never

from cloudevents.core.base import BaseCloudEvent

from lapse.events.kinds import DEFAULT_KINDS, TEKTON_TASKRUN, KindSet, KindSpec, UnknownKind
from lapse.events.models import CleanupDue
from lapse.events.run import Target
from lapse.events.types import EventType, Outcome
from lapse.functions.object_reaper.gates import children_selector, needs_children
from lapse.functions.object_reaper.ports import EventRecorder, ObjectAccess
from lapse.functions.object_reaper.verdict import (
    AlreadyGone,
    Delete,
    GaveUp,
    Invalid,
    Kept,
    Replaced,
    Reschedule,
    Verdict,
    Wait,
    as_planned,
    classify,
    counts,
)
from lapse.functions.policy import Policy
from lapse.functions.reaping.ends import End, Ended, Failed, Later
from lapse.functions.reaping.failures import Refused
from lapse.functions.reaping.ports import Proven, Removal
from lapse.functions.reaping.sequence import Reaper
from lapse.functions.safety import SafetyConfig
from lapse.functions.trust import Provenance, Trust

SOURCE: Final = "/lapse/object-reaper"
STAGE: Final = "object-reaper"
DELETED_EVENT_REASON: Final = "LapseDeleted"

PropagationPolicy = Literal["Background", "Foreground", "Orphan"]


@dataclass(frozen=True, slots=True)
class Planned:
    """The version the due event carries, judged deletable as it is (not read again)."""

    verdict: Delete


@dataclass(frozen=True, slots=True)
class Read:
    """The object as the API server returned it a moment ago (None: 404), the children its
    gates look at, and its keep_last group when the count must decide (None: not listed)."""

    fresh: Mapping[str, Any] | None
    children: Sequence[Mapping[str, Any]] = ()
    group: Sequence[Mapping[str, Any]] | None = None


Found: TypeAlias = Planned | Read


@dataclass(frozen=True, kw_only=True)
class ObjectReaper(Reaper):
    """`kinds`: the kinds it may delete (anything else is refused, with the reason).
    `propagation_policy` applies where a kind sets none. `recorder`, when given
    (kubernetes.record_events), writes a Kubernetes Event in the object's namespace for
    each deletion. `request_timeout` bounds each API call."""

    SOURCE: ClassVar[str] = SOURCE
    STAGE: ClassVar[str] = STAGE
    TARGET: ClassVar[Target] = Target.KUBERNETES

    objects: ObjectAccess
    policies: Sequence[Policy] = ()
    kinds: KindSet = DEFAULT_KINDS
    propagation_policy: PropagationPolicy = "Background"
    recorder: EventRecorder | None = None
    request_timeout: float = 30.0

    @functools.cached_property
    def _port(self) -> KubernetesPort:
        return KubernetesPort(
            objects=self.objects,
            policies=self.policies,
            kinds=self.kinds,
            safety=self.safety,
            clock=self.clock,
            propagation_policy=self.propagation_policy,
            request_timeout=self.request_timeout,
        )

    def port(self) -> KubernetesPort:
        return self._port

    async def concluded(self, end: End, emitted: Sequence[BaseCloudEvent]) -> None:
        """A Kubernetes Event in the run's namespace for each deletion (best effort: the
        recorder never raises)."""
        if (
            self.recorder is None
            or not isinstance(end, Ended)
            or end.outcome is not Outcome.DELETED
        ):
            return
        run = end.run
        completed = next(e for e in emitted if e.get_type() == EventType.CLEANUP_COMPLETED)
        late = (self.clock() - end.deadline) / timedelta(seconds=1)
        message = (
            f"{end.detail} by lapse: deadline {end.deadline.isoformat()}, {late:.1f}s later; "
            f"event {completed.get_id()}"
        )
        await self.recorder.record(
            namespace=run.namespace,
            name=run.name,
            uid=run.uid,
            api_version=run.api_version,
            kind=run.kind,
            reason=DELETED_EVENT_REASON,
            message=message,
        )


@dataclass(frozen=True)
class KubernetesPort:
    """The object reaper's port: the steps of the sequence that are the API server's."""

    objects: ObjectAccess
    policies: Sequence[Policy]
    kinds: KindSet
    safety: SafetyConfig
    clock: Callable[[], datetime]
    propagation_policy: str
    request_timeout: float
    target: ClassVar[Target] = Target.KUBERNETES
    units: ClassVar[str] = "deletions"

    # 1. Prove ---------------------------------------------------------------------------

    async def prove(self, claim: CleanupDue, trust: Trust) -> Proven:
        """The object proves itself: its uid is checked at the read (or, for a version lapse
        read, by the DELETE's precondition). Without `OBSERVED`, it is read first."""
        self._kind(claim)  # a kind lapse is not configured for is refused before any read
        setting = self.safety.read_before_delete
        believed = setting is False or (setting == "auto" and trust.observed)
        # Lapse's own read, unless read_before_delete is off for a claim.
        provenance = Provenance.READ_BY_LAPSE if setting == "auto" else Provenance.CLAIMED
        return Proven(claim, provenance, read=not believed)

    # 3. Read ----------------------------------------------------------------------------

    async def read(self, proof: Proven, *, again: bool) -> Found:
        due, kind = proof.due, self._kind(proof.due)
        if not proof.read and not again:
            planned = as_planned(due, kind, self.policies, self.safety, self.clock())
            if planned is not None:
                return Planned(planned)
        run = due.run
        # A run missing from its group's list changed since the GET (deleted, most often,
        # by another reaper's count): it is read again, once, rather than judged uncounted.
        for attempt in range(2):
            fresh = await self.objects.get(
                kind, run.namespace, run.name, request_timeout=self.request_timeout
            )
            children: list[dict[str, Any]] = []
            if fresh is not None and needs_children(kind):
                children = await self.objects.list_items(
                    TEKTON_TASKRUN,
                    run.namespace,
                    label_selector=children_selector(run),
                    request_timeout=self.request_timeout,
                )
            verdict = classify(fresh, due, kind, self.policies, self.safety, self.clock(), children)
            selector = counts(verdict, self.policies)
            if selector is None:
                return Read(fresh, children)
            # Not due by its clocks, but in a keep_last group: count the group as it is now
            # (the DELETE is still held to the version of `fresh` judged).
            group = await self.objects.list_items(
                kind, run.namespace, label_selector=selector, request_timeout=self.request_timeout
            )
            if attempt or any(obj.get("metadata", {}).get("uid") == run.uid for obj in group):
                return Read(fresh, children, group)
        raise AssertionError("unreachable: the second attempt returns")

    # 4. Judge (pure) --------------------------------------------------------------------

    def judge(self, proof: Proven, found: Found, now: datetime) -> Removal[Delete] | End:
        due, kind = proof.due, self._kind(proof.due)
        if isinstance(found, Planned):
            verdict: Verdict = found.verdict
            provenance = proof.provenance
        else:
            verdict = classify(
                found.fresh, due, kind, self.policies, self.safety, now, found.children, found.group
            )
            provenance = Provenance.READ_BY_LAPSE  # every verdict but a planned one is a GET's
        return self._end_of(verdict, due, kind, provenance, now)

    def _end_of(
        self,
        verdict: Verdict,
        due: CleanupDue,
        kind: KindSpec,
        provenance: Provenance,
        now: datetime,
    ) -> Removal[Delete] | End:
        ref = due.run
        match verdict:
            case Delete(run=run, deadline=deadline, policy=policy):
                again = CleanupDue(
                    run=run, target=Target.KUBERNETES, deadline=deadline, policy=policy,
                    scheduled_at=now,
                )  # fmt: skip
                return Removal(again, verdict, provenance)
            case AlreadyGone(detail=detail):
                return Ended(ref, Outcome.ALREADY_GONE, due.deadline, detail)
            case Replaced(current_uid=uid):
                detail = (
                    f"{ref.subject} is now a different {kind.kind} (uid {uid}); "
                    f"the run with uid {ref.uid} is gone and the new one is not touched"
                )
                return Ended(ref, Outcome.REPLACED, due.deadline, detail)
            case Kept(run=run, reason=reason):
                return Ended(run, Outcome.KEPT, due.deadline, reason)
            case Reschedule(run=run, deadline=deadline, policy=policy, reason=reason):
                again = CleanupDue(
                    run=run, target=Target.KUBERNETES, deadline=deadline, policy=policy,
                    scheduled_at=now,
                )  # fmt: skip
                return Later(again, deadline, reason, provenance, reported=due.deadline)
            case Wait(run=run, deadline=deadline, policy=policy, retry_at=retry_at, reason=reason):
                # The deadline stays the original one, so the wait stays bounded.
                again = CleanupDue(
                    run=run, target=Target.KUBERNETES, deadline=deadline, policy=policy,
                    scheduled_at=now,
                )  # fmt: skip
                return Later(again, retry_at, reason, provenance)
            case GaveUp(run=run, reason=reason) | Invalid(run=run, reason=reason):
                return Failed(run, reason)
            case _:
                assert_never(verdict)

    # 6. Remove, held to the version judged ------------------------------------------------

    async def dry_run(self, removal: Removal[Delete]) -> End:
        done = removal.what
        detail = f"dry run: would delete ({done.policy})"
        return Ended(done.run, Outcome.DRY_RUN, done.deadline, detail, dry_run=True)

    async def remove(self, removal: Removal[Delete], part: int) -> End | None:
        """DELETE only if uid and resourceVersion are the ones judged: the API server
        refuses otherwise (failures.Conflict, and the sequence reads and judges again)."""
        done = removal.what
        run, kind = done.run, self._kind(removal.due)
        await self.objects.delete(
            kind,
            run.namespace,
            run.name,
            uid=run.uid,
            resource_version=done.resource_version,
            propagation_policy=self.propagation(kind),
            request_timeout=self.request_timeout,
        )
        return None

    async def removed(self, removal: Removal[Delete], done: int) -> End:
        verdict, kind = removal.what, self._kind(removal.due)
        detail = f"deleted ({verdict.policy}, propagation {self.propagation(kind)})"
        return Ended(verdict.run, Outcome.DELETED, verdict.deadline, detail)

    def _kind(self, due: CleanupDue) -> KindSpec:
        try:
            return self.kinds.of(due.run.api_version, due.run.kind)
        except UnknownKind as exc:
            raise Refused(f"{exc}; nothing was deleted") from exc

    def propagation(self, kind: KindSpec) -> str:
        return kind.propagation or self.propagation_policy
