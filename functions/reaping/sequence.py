"""The reaping sequence, written once for every target (docs/architecture.md, "How a
deletion is made safe"); each target supplies a port (ports.py):

1. **prove**   what the due event is about, from what the tenant cannot write
2. **scope**   outside `safety.namespaces`: skipped, nothing read
3. **read**    what the judgement needs, now
4. **judge**   pure: remove (with the precondition the store is to enforce), or end
5. **admit**   the mass-deletion brake, then the rate limit, a part at a time
6. **remove**  held to the precondition; a conflict reads and judges again
7. **conclude** one end, one outcome, with an id derived from the due event's

`Reaper` is the machinery every reaper shares: its limits, its outcome events, the one
exit (`handle`), rescheduling and the brake's alert. The Kubernetes TTL-after-finished
controller's `processJob` is the model: one read of the sequence says what is safe.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, Final

from cloudevents.core.base import BaseCloudEvent

from lapse.events.builder import as_outcome_of, build_event, parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.models import CleanupDue
from lapse.events.original import capture_event
from lapse.events.run import Target
from lapse.events.subjects import InvalidSubjectToken
from lapse.events.types import EventType, Outcome
from lapse.functions.outcomes import Outcomes
from lapse.functions.ports import Emitter, RetryLater, ScheduleStore, emit_all
from lapse.functions.ratelimit import Brake, RateLimit, local_limits
from lapse.functions.reaping.ends import End, Ended, Failed, Held, Later
from lapse.functions.reaping.failures import Conflict, Gone, Refused
from lapse.functions.reaping.ports import Proven, Removal, TargetPort
from lapse.functions.safety import SafetyConfig, out_of_scope
from lapse.functions.tracing import creation_context
from lapse.functions.trust import Provenance, Trust

BRAKE_STAGE: Final = "brake"
# A conflict means it changed between the judgement and the removal; a few re-reads settle
# it, more means something keeps writing it, and the event is better delivered again later.
MAX_CONFLICTS: Final = 3
CONFLICT_RETRY_DELAY: Final = 2.0


def utcnow() -> datetime:
    return datetime.now(UTC)


async def reap(port: TargetPort[Any, Any], claim: CleanupDue, trust: Trust, reaper: Reaper) -> End:
    """The sequence (the module's docstring), top to bottom. Every step is safe to repeat:
    a second delivery of the same due event finds it removed and ends `already_gone`."""
    # 1. Prove.
    try:
        proof = await port.prove(claim, trust)
    except Refused as exc:
        return Failed(claim.run, exc.reason)
    if not isinstance(proof, Proven):
        return proof
    due = proof.due
    # 2. Scope: the proved run's namespace, never the event's.
    if (outside := out_of_scope(due.run.namespace, reaper.safety.namespaces)) is not None:
        return Ended(due.run, Outcome.SKIPPED, due.deadline, f"{outside}; nothing was read")
    admitted = False
    for conflicts in range(MAX_CONFLICTS):
        try:
            # 3. Read, and 4. judge (pure).
            found = await port.read(proof, again=conflicts > 0)
            judged = port.judge(proof, found, reaper.clock())
            if not isinstance(judged, Removal):
                return judged
            if reaper.safety.dry_run:
                return await port.dry_run(judged)
            # 5-6. Admitted a part at a time (once per due event), and removed held to the
            # precondition.
            for part, units in enumerate(judged.parts):
                first_again = admitted and part == 0  # counted before the conflict
                if not first_again and (held := await reaper.admit(judged, units, part)):
                    return held
                admitted = True
                if (end := await port.remove(judged, part)) is not None:
                    return end
            return await port.removed(judged, len(judged.parts))
        except Conflict:
            continue  # it changed since it was judged: read and judge again
        except Gone as exc:
            return Ended(due.run, Outcome.ALREADY_GONE, due.deadline, exc.reason)
        except Refused as exc:
            return Failed(due.run, exc.reason)
    raise RetryLater(
        f"{due.run.subject} changed {MAX_CONFLICTS} times between its judgement and its "
        "removal; trying again later",
        CONFLICT_RETRY_DELAY,
    )


@dataclass(frozen=True, kw_only=True)
class Reaper:
    """What every reaper shares; a target's reaper adds its port (`port`) and its own edges.

    Constructed once per process. `rate_limit` and `brake` are shared with the deployment's
    other processes when given; otherwise this process keeps its own
    (`safety.max_deletions_per_second`, `safety.mass_deletion_brake`)."""

    SOURCE: ClassVar[str]
    STAGE: ClassVar[str]
    TARGET: ClassVar[Target]

    schedules: ScheduleStore
    emitter: Emitter
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    clock: Callable[[], datetime] = field(default=utcnow)
    rate_limit: RateLimit | None = field(default=None, repr=False, compare=False)
    brake: Brake | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        rate_limit, brake = local_limits(self.safety, self.clock().timestamp())
        if self.rate_limit is None:
            object.__setattr__(self, "rate_limit", rate_limit)
        if self.brake is None:
            object.__setattr__(self, "brake", brake)

    @property
    def dry_run(self) -> bool:
        return self.safety.dry_run

    def port(self) -> TargetPort[Any, Any]:
        raise NotImplementedError

    @functools.cached_property
    def outcomes(self) -> Outcomes:
        return Outcomes(self.SOURCE, self.TARGET, self.STAGE, self.clock)

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]:
        """Handle one due event; returns the events it emitted. May raise `RetryLater`.

        The one exit: every event it emits carries an id derived from the due event's, so a
        redelivery that ends the same way is dropped by the audit stream, never doubled."""
        end, produced = await self.outcome_of(event, trust)
        emitted = await emit_all(self.emitter, [as_outcome_of(event, e) for e in produced])
        if end is not None:
            await self.concluded(end, emitted)
        return emitted

    async def outcome_of(
        self, event: BaseCloudEvent, trust: Trust
    ) -> tuple[End | None, list[BaseCloudEvent]]:
        """Where one due event ends (None: before the sequence) and the events that says."""
        try:
            claim = parse_payload(event, CleanupDue)
        except InvalidEvent as exc:
            return None, [self.outcomes.failed(None, exc.reason, capture_event(event))]
        if claim.target is not self.TARGET:
            return None, []  # another target's deadline: a subscription without a filter
        try:
            end = await reap(self.port(), claim, trust, self)
            return end, await self.conclude(end, event)
        except InvalidSubjectToken as exc:
            reason = f"cannot reschedule: {exc}"
            return None, [self.outcomes.failed(claim.run, reason, capture_event(event))]

    async def concluded(self, end: End, emitted: Sequence[BaseCloudEvent]) -> None:
        """After the outcome is emitted: what a target does besides (a Kubernetes Event)."""

    async def conclude(self, end: End, event: BaseCloudEvent) -> list[BaseCloudEvent]:
        """The outcome events of `end`, putting the schedule it asks for first."""
        match end:
            case Ended(run=run, outcome=outcome, deadline=deadline, detail=detail):
                return [
                    self.outcomes.completed(run, outcome, deadline, detail, dry_run=end.dry_run)
                ]
            case Failed(run=run, reason=reason):
                # What a refusal quotes of its input is captured only for a refusal.
                return [self.outcomes.failed(run, reason, capture_event(event))]
            case Later(due=due, fire_at=fire_at, reason=reason):
                await self.put(due, fire_at, end.provenance)
                reported = end.reported or due.deadline
                return [self.outcomes.completed(due.run, Outcome.RESCHEDULED, reported, reason)]
            case Held(due=due, until=until):
                await self.put(due, until, end.provenance)
                produced = [self._brake_alert(end)] if end.tripped else []
                after = f" after {end.done} {self.port().units}" if end.done else ""
                detail = f"mass-deletion brake engaged{after}: rescheduled for {until.isoformat()}"
                produced.append(
                    self.outcomes.completed(due.run, Outcome.RESCHEDULED, due.deadline, detail)
                )
                return produced

    async def admit(self, removal: Removal[Any], units: int, part: int) -> Held | None:
        """Brake, then rate limit, each counting `units`: None to go ahead (after the rate
        limit's wait: delayed in arrival order, never dropped), else held back."""
        assert self.brake is not None and self.rate_limit is not None  # set in __post_init__
        wait = 0.0
        for _ in range(units):
            now = self.clock().timestamp()
            decision = await self.brake.admit(now)
            if not decision.admitted:
                assert decision.until is not None
                until = datetime.fromtimestamp(decision.until, UTC)
                done = sum(removal.parts[:part])
                return Held(removal.due, until, decision.tripped, removal.provenance, done)
            wait = await self.rate_limit.reserve(now)  # the last place is the longest wait
        if wait > 0:
            await asyncio.sleep(wait)
        return None

    async def put(self, due: CleanupDue, fire_at: datetime, provenance: Provenance) -> None:
        """`due` again, delivered at `fire_at`, unless that very schedule is pending already
        (the planner, or an earlier delivery of this event, put it)."""
        pending = await self.schedules.get(self.TARGET, due.run.uid)
        if pending is not None and not pending.fired and pending.deadline == fire_at:
            return
        moved = due.model_copy(update={"scheduled_at": self.clock()})
        event = build_event(
            EventType.CLEANUP_DUE, source=self.SOURCE, data=moved, **creation_context()
        )
        await self.schedules.put(self.TARGET, due.run.uid, fire_at, event, provenance=provenance)

    def _brake_alert(self, held: Held) -> BaseCloudEvent:
        settings = self.safety.mass_deletion_brake
        window = int(settings.window.total_seconds())
        units = self.port().units
        return self.outcomes.failed(
            held.due.run,
            f"mass-deletion brake engaged for {self.TARGET.value}: more than "
            f"{settings.max_due} {units} within {window}s; deleting is paused until "
            f"{held.until.isoformat()} and due runs are rescheduled (check the policies; raise "
            "safety.mass_deletion_brake.max_due if this volume is expected)",
            stage=BRAKE_STAGE,
        )
