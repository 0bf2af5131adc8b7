"""The artifact reaper: `cleanup.due` (target artifacts) in, at most one pass of deletes in
object storage and one outcome event out, with the row-reaper's safety sequence shape.

The run object is gone by the time its artifacts are due, so nothing a due event says is
believed (docs/architecture.md, "How a deletion is made safe"; docs/security.md):

1. **Proof.** The schedule lapse stored for this (artifacts, uid) says which run and which
   deadline (`verdict.prove`). Nothing stored: `refused`. Later: `rescheduled`.
2. **Scope.** Outside `safety.namespaces`: `skipped`, nothing read.
3. **Capture.** What lapse captured when it planned the run (kept beside the schedule),
   with ML Metadata's account of a KFP run's artifacts when the row-reaper recorded it.
   None: `already_gone`. Artifacts Argo collects itself (its artifactGC): `skipped`, left
   to Argo, whose finalizer lapse never touches. A KFP run whose account is still to be
   recorded (its database deadline to come): `rescheduled` until just after it, then every
   `safety.gate_retry.backoff` up to `max_wait`, then a `cleanup.failed`.
4. **Judgement**, per item, against the configuration this reaper runs with: configured
   store serving the run's namespace and kind, under its prefix root, inside one of the
   run's roots rendered from its identity (what a run's status names is its tenant's
   word: functions/artifact_reaper/ownership.py), at least `min_prefix_depth` deep, no
   other run's capture holds it (`shared`, kept). Refused items are said in the outcome,
   never deleted.
5. **List** what is under each item; only objects that belong to it (`verdict.belongs`),
   and none another run records: the keys other runs' captures hold above, at or under
   the item, and what the runs still in the API server record now (Running ones
   included), read just before deleting. Each is named in the outcome (`shared, kept`).
6. **Dry run** counts them. Otherwise the **brake and the rate limit count objects**, a
   batch at a time (the brake engaged: `rescheduled`, the rest waits).
7. **Delete** in batches; then the capture is forgotten. An object already gone is no
   error, so a second delivery deletes what is left and nothing twice.
8. **Outcome**, with an id derived from the due event's: one due event, one outcome.

A store that does not answer (timeouts, 5xx, throttling) raises `RetryLater`: waited out
like the API server, never dead-lettered. A store that refuses (403, no such bucket) is a
`cleanup.failed` naming the store: misconfigured credentials must be loud.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final, TypeAlias, assert_never

from cloudevents.core.base import BaseCloudEvent

from lapse.events.builder import as_outcome_of, build_event, parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.models import CleanupDue, OriginalEvent, clip
from lapse.events.original import capture_event
from lapse.events.run import RunRef, Target
from lapse.events.subjects import InvalidSubjectToken
from lapse.events.types import EventType, Outcome
from lapse.functions.artifact_reaper.capture import CapturedItem, KeptItem, RunCapture
from lapse.functions.artifact_reaper.ownership import Protection, guarded, live_protections
from lapse.functions.artifact_reaper.ports import (
    Captures,
    LiveRuns,
    LiveRunsRefused,
    ObjectStores,
    StoredObject,
    StoreRefused,
    StoreUnavailable,
)
from lapse.functions.artifact_reaper.stores import ArtifactsConfig
from lapse.functions.artifact_reaper.verdict import (
    Allowed,
    GiveUp,
    NotYet,
    Proven,
    Refused,
    Shared,
    Unbacked,
    Wait,
    awaits_metadata,
    belongs,
    judge,
    prove,
    shielded,
)
from lapse.functions.outcomes import Outcomes
from lapse.functions.ports import Emitter, RetryLater, ScheduleStore, emit_all
from lapse.functions.ratelimit import Brake, RateLimit, local_limits
from lapse.functions.safety import SafetyConfig, out_of_scope
from lapse.functions.tracing import creation_context
from lapse.functions.trust import Provenance, Trust

SOURCE: Final = "/lapse/artifact-reaper"
STAGE: Final = "artifact-reaper"
BRAKE_STAGE: Final = "brake"
# What one DeleteObjects request takes (S3's limit); the brake and rate limit count a
# batch at a time.
BATCH: Final = 1000
# The first wait for a store that does not answer; the runtime's back-off takes it from
# there (lapse/runtime/outages.py: doubling to 60 s).
RETRY_DELAY: Final = 1.0


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class Tally:
    """What one pass found and did."""

    objects: int = 0
    bytes: int = 0
    refused: tuple[Refused, ...] = ()
    shared: tuple[Shared, ...] = ()
    outside: tuple[str, ...] = ()
    unrendered: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Done:
    due: CleanupDue
    tally: Tally


@dataclass(frozen=True, slots=True)
class _Ended:
    """Nothing deleted, by design: the outcome and its reason are the record."""

    run: RunRef
    outcome: Outcome
    deadline: datetime
    reason: str


@dataclass(frozen=True, slots=True)
class _Failed:
    run: RunRef
    reason: str


@dataclass(frozen=True, slots=True)
class _Held:
    due: CleanupDue
    until: datetime
    tripped: bool
    deleted: int


@dataclass(frozen=True, slots=True)
class _Waiting:
    """Not yet: delivered again at `until` (the deadline stays)."""

    due: CleanupDue
    until: datetime
    reason: str


_End: TypeAlias = _Done | _Ended | _Failed | _Held | _Waiting


@dataclass(frozen=True)
class ArtifactReaper:
    """Constructed once per process. `rate_limit` and `brake` are shared with the
    deployment's other artifact-reaper processes when given (they count objects)."""

    stores: ObjectStores
    captures: Captures
    schedules: ScheduleStore
    emitter: Emitter
    config: ArtifactsConfig
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    clock: Callable[[], datetime] = field(default=_utcnow)
    rate_limit: RateLimit | None = field(default=None, repr=False, compare=False)
    brake: Brake | None = field(default=None, repr=False, compare=False)
    # The row-reaper records ML Metadata's account of KFP runs (database.targets.
    # ml_metadata): a KFP run's artifacts due before it wait for it.
    metadata_expected: bool = False
    # What the runs still in the API server record (Argo Workflows, Running ones too).
    # None: no engine that records artifacts is watched (only captures protect).
    live: LiveRuns | None = None

    def __post_init__(self) -> None:
        rate_limit, brake = local_limits(self.safety, self.clock().timestamp())
        if self.rate_limit is None:
            object.__setattr__(self, "rate_limit", rate_limit)
        if self.brake is None:
            object.__setattr__(self, "brake", brake)

    @property
    def dry_run(self) -> bool:
        return self.safety.dry_run

    @functools.cached_property
    def _outcomes(self) -> Outcomes:
        return Outcomes(SOURCE, Target.ARTIFACTS, STAGE, self.clock)

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]:
        """Handle one due event; returns the events it emitted. May raise `RetryLater`.
        `trust` changes nothing: the reaper acts on what lapse stored, whoever delivered."""
        produced = await self._outcome_of(event)
        return await emit_all(self.emitter, [as_outcome_of(event, e) for e in produced])

    async def _outcome_of(self, event: BaseCloudEvent) -> list[BaseCloudEvent]:
        original = capture_event(event)
        try:
            claim = parse_payload(event, CleanupDue)
        except InvalidEvent as exc:
            return [self._outcomes.failed(None, exc.reason, original)]
        if claim.target is not Target.ARTIFACTS:
            return []
        try:
            end = await self._reap(claim)
            return await self._conclude(claim, end, original)
        except InvalidSubjectToken as exc:
            return [self._outcomes.failed(claim.run, f"cannot reschedule: {exc}", original)]

    async def _reap(self, claim: CleanupDue) -> _End:
        """The safety sequence, top to bottom (the module's docstring)."""
        # 1. Proof: what lapse stored for this (artifacts, uid), never the event's word.
        stored = await self.schedules.get(Target.ARTIFACTS, claim.run.uid)
        match prove(claim, stored, self.clock()):
            case Unbacked(reason=reason):
                reason = f"{reason}; nothing was deleted"
                return _Ended(claim.run, Outcome.REFUSED, claim.deadline, reason)
            case NotYet(reason=reason):
                return _Ended(claim.run, Outcome.RESCHEDULED, claim.deadline, reason)
            case Proven(due=due):
                pass
        run = due.run
        # 2. Scope.
        if (outside := out_of_scope(run.namespace, self.safety.namespaces)) is not None:
            return _Ended(run, Outcome.SKIPPED, due.deadline, f"{outside}; nothing read")
        # 3. The capture lapse stored when it planned the run.
        capture = await self.captures.get(run.uid)
        if capture is None:
            why = "no capture is stored for this run (its artifacts were handled already)"
            return _Ended(run, Outcome.ALREADY_GONE, due.deadline, why)
        if capture.collected_by_engine is not None:
            await self.captures.forget(capture)
            why = f"left to Argo's artifactGC ({capture.collected_by_engine}); lapse deletes none"
            return _Ended(run, Outcome.SKIPPED, due.deadline, why)
        if self.metadata_expected:
            database = await self.schedules.get(Target.DATABASE, run.uid)
            retry = self.safety.gate_retry
            match awaits_metadata(run, capture, database, self.clock(), retry):
                case Wait(until=until):
                    why = (
                        "waiting for ML Metadata's account of the run's artifacts, recorded "
                        f"when its rows are deleted; again at {until.isoformat()}"
                    )
                    return _Waiting(due, until, why)
                case GiveUp(reason=reason):
                    return _Failed(run, reason)
                case None:
                    pass
        # 4. Judgement, per item, against this reaper's configuration.
        allowed: list[CapturedItem] = []
        refused: list[Refused] = []
        # What ML Metadata said another run uses: kept, and shields what lies under it.
        shared: list[Shared] = [Shared(kept.item, kept.by) for kept in capture.kept]
        for item in capture.all_items:
            sharers = await self.captures.sharers(item, run.uid)
            match judge(item, self.config, sharers, run, capture.kind):
                case Allowed():
                    allowed.append(item)
                case Refused() as no:
                    refused.append(no)
                case Shared() as kept:
                    shared.append(kept)
        tally = Tally(
            refused=tuple(refused),
            shared=tuple(shared),
            outside=(*capture.outside, *(capture.metadata.outside if capture.metadata else ())),
            unrendered=capture.unrendered,
        )
        try:
            # 5. What lies under each allowed item, but for what another run records.
            protections = await self._protections(run, allowed)
            found, guarding = await self._listed(allowed, capture.kept, protections)
            tally = _with_shared(tally, guarding)
            if self.dry_run:
                return _Done(due, _counted(tally, found))
            # 6-7. Counted by the brake and the rate limit, deleted a batch at a time.
            return await self._delete(due, capture, tally, found)
        except StoreUnavailable as exc:
            raise RetryLater(f"object store unavailable: {exc}", RETRY_DELAY) from exc
        except StoreRefused as exc:
            return _Failed(run, f"the object store refused: {exc}; nothing more was deleted")
        except LiveRunsRefused as exc:
            return _Failed(run, f"{exc}; nothing was deleted")

    async def _protections(self, run: RunRef, allowed: Sequence[CapturedItem]) -> list[Protection]:
        """What other runs record near the allowed items: their captures (finished runs),
        and the live runs' keys read now (Running runs have no capture yet)."""
        if not allowed:
            return []
        found = await self.captures.near(allowed, run.uid)
        if self.live is not None:
            found += live_protections(self.config, await self.live.recorded(), run.uid)
        return found

    async def _listed(
        self,
        items: Sequence[CapturedItem],
        kept: Sequence[KeptItem] = (),
        protections: Sequence[Protection] = (),
    ) -> tuple[dict[str, list[StoredObject]], list[Protection]]:
        """Objects per store, each once, that belong to an allowed item and to nothing
        another run still uses; and the protections that kept something (or a whole
        item: a key another run records above it)."""
        found: dict[str, dict[str, StoredObject]] = {}
        guarding: list[Protection] = []
        for item in items:
            above = guarded(item.store, item.key.rstrip("/"), protections)
            if above is not None and above not in guarding:
                guarding.append(above)
            listed = await self.stores.list(item.store, item.key)
            if not item.tree and (own := await self.stores.head(item.store, item.key)):
                listed.append(own)
            for obj in listed:
                if not belongs(item, obj.path) or shielded(item.store, obj.path, kept):
                    continue
                if (keeps := guarded(item.store, obj.path, protections)) is not None:
                    if keeps not in guarding:
                        guarding.append(keeps)
                    continue
                found.setdefault(item.store, {})[obj.path] = obj
        return {store: list(objects.values()) for store, objects in found.items()}, guarding

    async def _delete(
        self,
        due: CleanupDue,
        capture: RunCapture,
        tally: Tally,
        found: dict[str, list[StoredObject]],
    ) -> _End:
        deleted: list[StoredObject] = []
        for store, objects in found.items():
            for start in range(0, len(objects), BATCH):
                batch = objects[start : start + BATCH]
                if (held := await self._admit(due, len(batch), len(deleted))) is not None:
                    return held
                await self.stores.delete(store, batch)
                deleted.extend(batch)
        await self.captures.forget(capture)
        return _Done(due, _counted(tally, {"": deleted}))

    async def _admit(self, due: CleanupDue, count: int, deleted: int) -> _Held | None:
        """The brake and the rate limit, each counting `count` objects."""
        assert self.brake is not None and self.rate_limit is not None  # set in __post_init__
        wait = 0.0
        for _ in range(count):
            now = self.clock().timestamp()
            decision = await self.brake.admit(now)
            if not decision.admitted:
                assert decision.until is not None
                until = datetime.fromtimestamp(decision.until, UTC)
                return _Held(due, until, decision.tripped, deleted)
            wait = await self.rate_limit.reserve(now)  # the last place is the longest wait
        if wait > 0:
            await asyncio.sleep(wait)
        return None

    async def _conclude(
        self, claim: CleanupDue, end: _End, original: OriginalEvent
    ) -> list[BaseCloudEvent]:
        match end:
            case _Done(due=due, tally=tally):
                if self.dry_run:
                    outcome = Outcome.DRY_RUN
                elif tally.objects > 0:
                    outcome = Outcome.DELETED
                elif tally.refused:
                    outcome = Outcome.REFUSED  # nothing deleted, and not because it was gone
                else:
                    outcome = Outcome.ALREADY_GONE
                detail = describe(tally, dry_run=self.dry_run)
                return [
                    self._outcomes.completed(
                        due.run, outcome, due.deadline, detail, dry_run=self.dry_run
                    )
                ]
            case _Ended(run=run, outcome=outcome, deadline=deadline, reason=reason):
                return [self._outcomes.completed(run, outcome, deadline, reason)]
            case _Failed(run=run, reason=reason):
                return [self._outcomes.failed(run, reason, original)]
            case _Held(due=due, until=until, tripped=tripped, deleted=deleted):
                await self._put(due, fire_at=until)
                produced = []
                if tripped:
                    settings = self.safety.mass_deletion_brake
                    window = int(settings.window.total_seconds())
                    produced.append(
                        self._outcomes.failed(
                            due.run,
                            f"mass-deletion brake engaged for artifacts: more than "
                            f"{settings.max_due} objects due within {window}s; deleting "
                            f"artifacts is paused until {until.isoformat()} and due runs are "
                            "rescheduled (check the policies; raise "
                            "safety.mass_deletion_brake.max_due if this volume is expected)",
                            stage=BRAKE_STAGE,
                        )
                    )
                detail = (
                    f"mass-deletion brake engaged after {deleted} objects: the rest is "
                    f"rescheduled for {until.isoformat()}"
                )
                produced.append(
                    self._outcomes.completed(due.run, Outcome.RESCHEDULED, due.deadline, detail)
                )
                return produced
            case _Waiting(due=due, until=until, reason=reason):
                await self._put(due, fire_at=until)
                return [
                    self._outcomes.completed(due.run, Outcome.RESCHEDULED, due.deadline, reason)
                ]
            case _:
                assert_never(end)

    async def _put(self, due: CleanupDue, *, fire_at: datetime) -> None:
        """The stored run's due event again, delivered at `fire_at` (its deadline stays)."""
        moved = due.model_copy(update={"scheduled_at": self.clock()})
        event = build_event(EventType.CLEANUP_DUE, source=SOURCE, data=moved, **creation_context())
        # The artifacts are proved from the stored capture, not from what this carries.
        await self.schedules.put(
            Target.ARTIFACTS, due.run.uid, fire_at, event, provenance=Provenance.CLAIMED
        )


def _with_shared(tally: Tally, guarding: Sequence[Protection]) -> Tally:
    shared = list(tally.shared)
    for protection in guarding:
        kept = Shared(protection.item, protection.by)
        if kept not in shared:
            shared.append(kept)
    return dataclasses.replace(tally, shared=tuple(shared))


def _counted(tally: Tally, found: dict[str, list[StoredObject]]) -> Tally:
    objects = [obj for listed in found.values() for obj in listed]
    return Tally(
        objects=len(objects),
        bytes=sum(obj.size for obj in objects),
        refused=tally.refused,
        shared=tally.shared,
        outside=tally.outside,
        unrendered=tally.unrendered,
    )


def describe(tally: Tally, *, dry_run: bool = False) -> str:
    """`12 objects, 3456 bytes; shared (kept): ...; refused: ...` (bounded)."""
    verb = "would delete" if dry_run else "deleted"
    parts = [f"{verb} {tally.objects} objects, {tally.bytes} bytes"]
    if tally.shared:
        kept = ", ".join(
            f"{s.item.store}:{s.item.key} (by {', '.join(s.by[:3])})" for s in tally.shared
        )
        parts.append(f"shared, kept: {kept}")
    if tally.refused:
        parts.append("refused: " + "; ".join(r.reason for r in tally.refused))
    if tally.outside:
        parts.append(f"outside the configured stores, not touched: {', '.join(tally.outside)}")
    if tally.unrendered:
        parts.append(f"templates without a value: {', '.join(tally.unrendered)}")
    return clip("; ".join(parts))
