"""The artifact reaper: `cleanup.due` (target artifacts) in, at most one pass of deletes in
object storage and one outcome event out. It runs the one reaping sequence
(functions/reaping/sequence.py: prove, scope, read, judge, admit, remove, conclude); this
module is its port, `ArtifactsPort`, and reads in one screen:

- **prove**: the run is gone by the time its artifacts are due, so nothing a due event
  says is believed (docs/architecture.md, "How a deletion is made safe"; docs/security.md):
  the schedule lapse stored for this (artifacts, uid) says which run and which deadline
  (`stored.prove`). Nothing stored: `refused`. Later: `rescheduled`.
- **read**: the capture lapse stored when it planned the run (kept beside the schedule),
  with ML Metadata's account of a KFP run's artifacts when the row-reaper recorded it;
  which other runs captured each item; what other runs record near the items it may
  delete (their captures, and the runs still in the API server, Running ones included,
  read now); and what is listed under each of those items.
- **judge** (pure): no capture: `already_gone`. Artifacts Argo collects itself (its
  artifactGC): `skipped`, left to Argo, whose finalizer lapse never touches (the capture
  alone is forgotten). A KFP run whose account is still to be recorded: `rescheduled`
  until just after its database deadline, then every `safety.gate_retry.backoff` up to
  `max_wait`, then a `cleanup.failed`. Each item against the configuration this reaper
  runs with (verdict.py: configured store serving the run's namespace and kind, a clean
  key inside one of the run's roots, at least `min_prefix_depth` deep, no other run's
  capture holding it); of what is listed under the allowed items, only the objects that
  belong to one (`verdict.belongs`) and that no other run records (`verdict.owned`),
  cut in batches of `BATCH` (one DeleteObjects request). Disallowed and kept items are
  said in the outcome, never deleted.
- **remove** a batch held to its precondition: the batch's keys are listed again just
  before, and one whose size or etag changed is a `Conflict` (read and judged again).
  Then an S3 store deletes each object with `If-Match: <the etag listed>`: one written
  again in between is refused by the store itself (412) and kept, counted in the outcome
  (`conditional_delete: false`, GCS and Azure: a batched delete, the listing again being
  the precondition). An object already gone is no error, so a second delivery deletes
  what is left and nothing twice. The brake and the rate limit count objects, a batch at
  a time.
- **removed**: the capture is forgotten; `deleted` (with the tally), `refused` when items
  were disallowed and nothing deleted, `kept` when the store kept every object as
  changed, else `already_gone`.

A store that does not answer (timeouts, 5xx, throttling) is `Unavailable` (a `RetryLater`):
waited out like the API server, never dead-lettered. A store that refuses (403, no such
bucket) is `Refused`, a `cleanup.failed` naming the store: misconfigured credentials must
be loud. Both are mapped at the edge (lapse/edges/artifacts/).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import ClassVar, Final

from lapse.events.models import CleanupDue, clip
from lapse.events.run import RunRef, Target
from lapse.events.types import Outcome
from lapse.functions.artifact_reaper.capture import CapturedItem, RunCapture
from lapse.functions.artifact_reaper.ownership import Protection, live_protections
from lapse.functions.artifact_reaper.ports import (
    Captures,
    Deletion,
    LiveRuns,
    ObjectStores,
    StoredObject,
)
from lapse.functions.artifact_reaper.stores import ArtifactsConfig
from lapse.functions.artifact_reaper.verdict import (
    Allowed,
    Disallowed,
    GiveUp,
    NotRecorded,
    Shared,
    awaits_metadata,
    changed,
    judge,
    owned,
)
from lapse.functions.ports import PendingSchedule
from lapse.functions.reaping.ends import End, Ended, Failed, Later
from lapse.functions.reaping.failures import Conflict
from lapse.functions.reaping.ports import Proven, Removal
from lapse.functions.reaping.sequence import Reaper
from lapse.functions.reaping.stored import Backed, NotYet, Unbacked, prove
from lapse.functions.trust import Provenance, Trust

SOURCE: Final = "/lapse/artifact-reaper"
STAGE: Final = "artifact-reaper"
# What one DeleteObjects request takes (S3's limit); the brake and rate limit count a
# batch at a time.
BATCH: Final = 1000
# The artifacts are proved from the stored schedule and capture, never from an object
# version lapse read: what is put again is not marked observed.
PROVENANCE: Final = Provenance.CLAIMED


@dataclass(frozen=True, slots=True)
class Tally:
    """What one pass found and did."""

    objects: int = 0
    bytes: int = 0
    refused: tuple[Disallowed, ...] = ()
    shared: tuple[Shared, ...] = ()
    outside: tuple[str, ...] = ()
    unrendered: tuple[str, ...] = ()
    # Objects the store kept because they changed since they were listed (S3 412), and
    # objects that were gone by the delete.
    changed: int = 0
    gone: int = 0


@dataclass(frozen=True, slots=True)
class Found:
    """What `read` found. `database`: the run's database schedule, read when ML Metadata's
    account is expected. The rest only when the judgement goes on to the items: who else
    captured each item, what other runs record near the items, what is listed under them."""

    capture: RunCapture | None
    database: PendingSchedule | None = None
    sharers: tuple[tuple[CapturedItem, tuple[str, ...]], ...] = ()
    protections: tuple[Protection, ...] = ()
    listed: tuple[tuple[CapturedItem, tuple[StoredObject, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class Batch:
    store: str
    objects: tuple[StoredObject, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """What the judgement removes: the batches, then the capture. `left_to`: why the
    engine collects them itself (no batches: only the capture is forgotten)."""

    capture: RunCapture
    tally: Tally
    batches: tuple[Batch, ...] = ()
    left_to: str | None = None


@dataclass(frozen=True, kw_only=True)
class ArtifactReaper(Reaper):
    """Constructed once per process. `rate_limit` and `brake` are shared with the
    deployment's other artifact-reaper processes when given (they count objects)."""

    SOURCE: ClassVar[str] = SOURCE
    STAGE: ClassVar[str] = STAGE
    TARGET: ClassVar[Target] = Target.ARTIFACTS

    stores: ObjectStores
    captures: Captures
    config: ArtifactsConfig
    # The row-reaper records ML Metadata's account of KFP runs (database.targets.
    # ml_metadata): a KFP run's artifacts due before it wait for it.
    metadata_expected: bool = False
    # What the runs still in the API server record (Argo Workflows, Running ones too).
    # None: no engine that records artifacts is watched (only captures protect).
    live: LiveRuns | None = None

    def port(self) -> ArtifactsPort:
        return ArtifactsPort(self)


@dataclass(frozen=True, slots=True)
class ArtifactsPort:
    """The artifact-reaper's port to the reaping sequence (functions/reaping/ports.py),
    one per due event: `deletions` is what its deletes did."""

    reaper: ArtifactReaper
    deletions: list[Deletion] = field(default_factory=list)

    @property
    def target(self) -> Target:
        return Target.ARTIFACTS

    @property
    def units(self) -> str:
        return "objects"

    async def prove(self, claim: CleanupDue, trust: Trust) -> Proven | End:
        """What lapse stored for this (artifacts, uid), never the event's word (`trust`
        changes nothing: the reaper acts on what lapse stored, whoever delivered)."""
        stored = await self.reaper.schedules.get(Target.ARTIFACTS, claim.run.uid)
        match prove(claim, stored, self.reaper.clock()):
            case Unbacked(reason=reason):
                reason = f"{reason}; nothing was deleted"
                return Ended(claim.run, Outcome.REFUSED, claim.deadline, reason)
            case NotYet(reason=reason):
                return Ended(claim.run, Outcome.RESCHEDULED, claim.deadline, reason)
            case Backed(due=due):
                return Proven(due, PROVENANCE)

    async def read(self, proof: Proven, *, again: bool) -> Found:
        reaper, run = self.reaper, proof.due.run
        capture = await reaper.captures.get(run.uid)
        if capture is None or capture.collected_by_engine is not None:
            return Found(capture)
        database = None
        if reaper.metadata_expected:
            database = await reaper.schedules.get(Target.DATABASE, run.uid)
            retry = reaper.safety.gate_retry
            if awaits_metadata(run, capture, database, reaper.clock(), retry) is not None:
                return Found(capture, database)  # judged a wait: nothing else to read
        sharers = [
            (item, await reaper.captures.sharers(item, run.uid)) for item in capture.all_items
        ]
        allowed = [
            item
            for item, by in sharers
            if isinstance(judge(item, reaper.config, by, run, capture.kind), Allowed)
        ]
        protections = await self._protections(run, allowed)
        listed = [(item, tuple(await self._list(item))) for item in allowed]
        return Found(capture, database, tuple(sharers), tuple(protections), tuple(listed))

    async def _protections(self, run: RunRef, allowed: Sequence[CapturedItem]) -> list[Protection]:
        """What other runs record near the allowed items: their captures (finished runs),
        and the live runs' keys read now (Running runs have no capture yet)."""
        if not allowed:
            return []
        found = await self.reaper.captures.near(allowed, run.uid)
        if self.reaper.live is not None:
            recorded = await self.reaper.live.recorded()
            found += live_protections(self.reaper.config, recorded, run.uid)
        return found

    async def _list(self, item: CapturedItem) -> list[StoredObject]:
        listed = await self.reaper.stores.list(item.store, item.key)
        if not item.tree and (own := await self.reaper.stores.head(item.store, item.key)):
            listed.append(own)
        return listed

    def judge(self, proof: Proven, found: Found, now: datetime) -> Removal[Plan] | End:
        due, config = proof.due, self.reaper.config
        run, capture = due.run, found.capture
        if capture is None:
            why = "no capture is stored for this run (its artifacts were handled already)"
            return Ended(run, Outcome.ALREADY_GONE, due.deadline, why)
        if capture.collected_by_engine is not None:
            why = f"left to Argo's artifactGC ({capture.collected_by_engine}); lapse deletes none"
            return Removal(due, Plan(capture, Tally(), left_to=why), PROVENANCE, parts=())
        if self.reaper.metadata_expected:
            retry = self.reaper.safety.gate_retry
            match awaits_metadata(run, capture, found.database, now, retry):
                case NotRecorded(until=until):
                    why = (
                        "waiting for ML Metadata's account of the run's artifacts, recorded "
                        f"when its rows are deleted; again at {until.isoformat()}"
                    )
                    return Later(due, until, why, PROVENANCE)
                case GiveUp(reason=reason):
                    return Failed(run, reason)
        allowed: set[CapturedItem] = set()
        refused: list[Disallowed] = []
        # What ML Metadata said another run uses: kept, and shields what lies under it.
        shared = [Shared(kept.item, kept.by) for kept in capture.kept]
        for item, sharers in found.sharers:
            match judge(item, config, sharers, run, capture.kind):
                case Allowed():
                    allowed.add(item)
                case Disallowed() as no:
                    refused.append(no)
                case Shared() as kept:
                    shared.append(kept)
        listed = [(item, objects) for item, objects in found.listed if item in allowed]
        objects, guarding = owned(listed, capture.kept, found.protections)
        tally = _with_shared(
            Tally(
                refused=tuple(refused),
                shared=tuple(shared),
                outside=(*capture.outside, *(capture.metadata.outside if capture.metadata else ())),
                unrendered=capture.unrendered,
            ),
            guarding,
        )
        batches = tuple(
            Batch(store, tuple(listed_in[start : start + BATCH]))
            for store, listed_in in objects.items()
            for start in range(0, len(listed_in), BATCH)
        )
        parts = tuple(len(batch.objects) for batch in batches)
        return Removal(due, Plan(capture, tally, batches), PROVENANCE, parts=parts)

    async def dry_run(self, removal: Removal[Plan]) -> End:
        due, plan = removal.due, removal.what
        if plan.left_to is not None:
            return Ended(due.run, Outcome.SKIPPED, due.deadline, plan.left_to)
        detail = describe(_counted(plan), dry_run=True)
        return Ended(due.run, Outcome.DRY_RUN, due.deadline, detail, dry_run=True)

    async def remove(self, removal: Removal[Plan], part: int) -> End | None:
        """One batch, held to the listing judged: listed again now, deleted only if no
        object changed (a new object under the same key: read and judge again)."""
        batch = removal.what.batches[part]
        now = await self.reaper.stores.current(batch.store, batch.objects)
        if moved := changed(batch.objects, now):
            raise Conflict(
                f"{batch.store}: {len(moved)} objects changed since they were listed "
                f"({', '.join(moved[:3])})"
            )
        there = {obj.path for obj in now}
        gone = tuple(obj for obj in batch.objects if obj.path not in there)
        deletion = await self.reaper.stores.delete(
            batch.store, [obj for obj in batch.objects if obj.path in there]
        )
        self.deletions.append(dataclasses.replace(deletion, gone=gone + deletion.gone))
        return None

    async def removed(self, removal: Removal[Plan], done: int) -> End:
        due, plan = removal.due, removal.what
        await self.reaper.captures.forget(plan.capture)
        if plan.left_to is not None:
            return Ended(due.run, Outcome.SKIPPED, due.deadline, plan.left_to)
        tally = _counted(plan, self.deletions)
        if tally.objects > 0:
            outcome = Outcome.DELETED
        elif tally.refused:
            outcome = Outcome.REFUSED  # nothing deleted, and not because it was gone
        elif tally.changed:
            outcome = Outcome.KEPT  # the store kept each: written again since listed
        else:
            outcome = Outcome.ALREADY_GONE
        return Ended(due.run, outcome, due.deadline, describe(tally))


def _with_shared(tally: Tally, guarding: Sequence[Protection]) -> Tally:
    shared = list(tally.shared)
    for protection in guarding:
        kept = Shared(protection.item, protection.by)
        if kept not in shared:
            shared.append(kept)
    return dataclasses.replace(tally, shared=tuple(shared))


def _counted(plan: Plan, deletions: Sequence[Deletion] = ()) -> Tally:
    """The plan's objects, less those its deletes found changed or gone."""
    kept = {obj.path for deletion in deletions for obj in deletion.kept}
    gone = {obj.path for deletion in deletions for obj in deletion.gone}
    objects = [
        obj
        for batch in plan.batches
        for obj in batch.objects
        if obj.path not in kept and obj.path not in gone
    ]
    return dataclasses.replace(
        plan.tally,
        objects=len(objects),
        bytes=sum(obj.size for obj in objects),
        changed=len(kept),
        gone=len(gone),
    )


def describe(tally: Tally, *, dry_run: bool = False) -> str:
    """`12 objects, 3456 bytes; shared (kept): ...; refused: ...` (bounded)."""
    verb = "would delete" if dry_run else "deleted"
    parts = [f"{verb} {tally.objects} objects, {tally.bytes} bytes"]
    if tally.changed:
        parts.append(
            f"kept {tally.changed} objects written again since they were listed "
            "(the store refused their conditional delete)"
        )
    if tally.gone:
        parts.append(f"{tally.gone} objects were already gone")
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
