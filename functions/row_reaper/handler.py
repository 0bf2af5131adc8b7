"""The row-reaper: `cleanup.due` (target database) in, at most one transaction and one
outcome event out, with the same safety sequence shape as the object reaper.

The row-reaper cannot read the run object (it is usually gone by the time its rows are
due), so it believes no due event's word for the deadline or the run: it reads what lapse
stored and what the database itself says (docs/architecture.md, "How a deletion is made
safe"; docs/security.md):

1. **Proof.** The schedule lapse stored for this (database, uid) — the due message the
   server fired from it, or the one still pending — says which run and which deadline
   (`verdict.prove`). Nothing stored: `refused`. A later stored deadline: `rescheduled`
   (the stored schedule will fire).
2. **Scope.** The stored run's namespace outside `safety.namespaces`: `skipped`, nothing
   read (the object-reaper's step 1, the same function).
3. **Keys** of the stored run, per target; a target the run has no key for is skipped.
4. **Brake and rate limit**, once per due event, counted apart from the objects' (the
   same settings, `safety.mass_deletion_brake` and `safety.max_deletions_per_second`).
5. **Delete** in one transaction, held to a precondition judged inside it with the run's
   rows locked (`verdict.judge_facts`): where the database records whose run the rows are
   (KFP's run_details.Namespace, Argo's archive, a declared `namespace_column`), it names
   the namespace lapse stored with the run, else `refused` and nothing deleted (the key
   may be a tenant's label); ML Metadata only for a run id KFP's record vouched for in
   the same transaction. The database's own record says the run finished, no later than
   lapse planned from. Running: `kept`. Finished later: `rescheduled` by as much. Zero
   rows: `already_gone`.
6. **Outcome**, with an id derived from the due event's: one due event, one outcome.

The database being unreachable (or asking to back off) raises `RetryLater`: nothing was
committed, the runtime delivers the event again after its back-off.

`handle_batch` is the same sequence for many due events (`lapse up`'s dispatcher hands it
each fetch), and `handle` is that for one: steps 1-4 and 6 are each event's own, step 5 is
one transaction for the runs that reached it. No two runs in one transaction name the
same uid or row key (functions/row_reaper/batches.py), so each event's outcome comes from
the rows the transaction matched to its own keys; an event that would share is put off to
a later round and proved again, as if it had arrived after the others.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final, NamedTuple, TypeAlias, assert_never

from cloudevents.core.base import BaseCloudEvent

from lapse.events.builder import as_outcome_of, build_event, parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.models import CleanupDue, OriginalEvent, clip
from lapse.events.original import capture_event
from lapse.events.run import RunRef, Target
from lapse.events.subjects import InvalidSubjectToken
from lapse.events.types import EventType, Outcome
from lapse.functions.outcomes import Outcomes
from lapse.functions.ports import Emitter, RetryLater, ScheduleStore, emit_all
from lapse.functions.ratelimit import Brake, RateLimit, local_limits
from lapse.functions.row_reaper.batches import row_keys, split
from lapse.functions.row_reaper.ports import (
    Contradicted,
    Counted,
    MetadataRecorder,
    Rejected,
    RowStore,
    RunResult,
    RunRows,
    Unavailable,
)
from lapse.functions.row_reaper.targets import ML_METADATA, RunKeys, keys_for
from lapse.functions.row_reaper.verdict import (
    Keep,
    MoveTo,
    NotOwned,
    NotYet,
    Proven,
    RunFacts,
    Unbacked,
    judge_facts,
    prove,
)
from lapse.functions.safety import SafetyConfig, out_of_scope
from lapse.functions.tracing import creation_context
from lapse.functions.trust import Provenance, Trust

SOURCE: Final = "/lapse/row-reaper"
STAGE: Final = "row-reaper"
BRAKE_STAGE: Final = "brake"
# The first wait for a database that does not answer; the runtime's back-off takes it from
# there (lapse/runtime/outages.py: doubling to 60 s).
RETRY_DELAY: Final = 1.0


def _utcnow() -> datetime:
    return datetime.now(UTC)


# --- where the sequence ends --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Done:
    """The transaction ran (or, in a dry run, counted): rows per table."""

    due: CleanupDue
    counted: Counted
    skipped: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class _Refused:
    """Nothing deleted and nothing to wait for: the reason is the record."""

    run: RunRef
    reason: str
    outcome: Outcome | None = Outcome.REFUSED  # None: a cleanup.failed (the database's refusal)


@dataclass(frozen=True, slots=True)
class _Later:
    """Not now: `deadline` is when (a schedule is put when `put`)."""

    due: CleanupDue
    deadline: datetime
    reason: str
    put: bool


@dataclass(frozen=True, slots=True)
class _Kept:
    due: CleanupDue
    reason: str


@dataclass(frozen=True, slots=True)
class _Held:
    """The brake is engaged: rescheduled to `until`; `tripped` when this event tripped it."""

    due: CleanupDue
    until: datetime
    tripped: bool


@dataclass(frozen=True, slots=True)
class _Skipped:
    """Outside safety.namespaces: nothing read, nothing deleted."""

    due: CleanupDue
    reason: str


_End: TypeAlias = _Done | _Refused | _Later | _Kept | _Held | _Skipped


class _Proven(NamedTuple):
    """A due event (`at`: its place in the batch) that the stored schedule backs: `due` is the
    stored due event, `keys` its run's."""

    at: int
    claim: CleanupDue
    due: CleanupDue
    keys: RunKeys

    def row_keys(self) -> frozenset[tuple[str, str]]:
        """What its transaction keys on: the claim's uid, the stored run's, its row keys."""
        return row_keys((self.claim.run.uid, self.due.run.uid), self.keys.keys)


@dataclass(frozen=True)
class RowReaper:
    """Constructed once per process. `rate_limit` and `brake` are shared with the
    deployment's other row-reaper processes when given; otherwise this process keeps its
    own (`safety.max_deletions_per_second`, `safety.mass_deletion_brake`)."""

    rows: RowStore
    schedules: ScheduleStore
    emitter: Emitter
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    clock: Callable[[], datetime] = field(default=_utcnow)
    rate_limit: RateLimit | None = field(default=None, repr=False, compare=False)
    brake: Brake | None = field(default=None, repr=False, compare=False)
    # Where ML Metadata's account of a run's artifacts goes before its MLMD rows are
    # deleted (the artifacts target's capture), when both targets are configured.
    metadata: MetadataRecorder | None = field(default=None, repr=False, compare=False)

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
        return Outcomes(SOURCE, Target.DATABASE, STAGE, self.clock)

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]:
        """Handle one due event; returns the events it emitted. May raise `RetryLater`.

        `trust` changes nothing here: what the row-reaper acts on is what lapse stored and
        what the database says, whoever delivered the event. The one exit: every event it
        emits carries an id derived from the due event's."""
        [answer] = await self.handle_batch([(event, trust)])
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def handle_batch(
        self, events: Sequence[tuple[BaseCloudEvent, Trust]]
    ) -> list[list[BaseCloudEvent] | Exception]:
        """Handle due events together (`lapse up`'s dispatcher hands it each fetch): one
        entry per event, in order - the events emitted for it, else what `handle` would
        have raised for it (`RetryLater`, or a bug). One event's failure is never
        another's, and no event is credited with another's rows: events naming the same
        uid or row key go in later rounds (`batches.split`), each proved afresh."""
        answers: list[list[BaseCloudEvent] | Exception] = [[] for _ in events]
        originals = [capture_event(event) for event, _ in events]
        produced: dict[int, list[BaseCloudEvent]] = {}
        waiting: list[tuple[int, CleanupDue]] = []
        for i, (event, _) in enumerate(events):
            try:
                claim = parse_payload(event, CleanupDue)
            except InvalidEvent as exc:
                produced[i] = [self._outcomes.failed(None, exc.reason, originals[i])]
                continue
            if claim.target is Target.DATABASE:
                waiting.append((i, claim))
            # else: the object-reaper's; a subscription without a target filter
        await self._emit(events, produced, answers)
        while waiting:
            try:
                waiting = await self._round(events, originals, waiting, answers)
            except Exception as exc:  # a bug: no outcome of this round was emitted
                for i, _ in waiting:
                    answers[i] = exc
                break
        return answers

    async def _round(
        self,
        events: Sequence[tuple[BaseCloudEvent, Trust]],
        originals: Sequence[OriginalEvent],
        claims: Sequence[tuple[int, CleanupDue]],
        answers: list[list[BaseCloudEvent] | Exception],
    ) -> list[tuple[int, CleanupDue]]:
        """The safety sequence (the module's docstring) for claims that each name rows no
        other in the round names; returns the claims put off to the next round."""
        ends: dict[int, _End] = {}
        failed: dict[int, BaseException] = {}
        # 1. Proof: what lapse stored for this (database, uid), never the event's word.
        stored = await asyncio.gather(
            *(self.schedules.get(Target.DATABASE, claim.run.uid) for _, claim in claims),
            return_exceptions=True,
        )
        now = self.clock()
        proven: list[_Proven] = []
        for (i, claim), schedule in zip(claims, stored, strict=True):
            if isinstance(schedule, BaseException):
                failed[i] = schedule
                continue
            match prove(claim, schedule, now):
                case Unbacked(reason=reason):
                    ends[i] = _Refused(claim.run, f"{reason}; nothing was deleted")
                case NotYet(deadline=deadline, reason=reason):
                    ends[i] = _Later(claim, deadline, reason, put=False)
                case Proven(due=due) if (
                    outside := out_of_scope(due.run.namespace, self.safety.namespaces)
                ) is not None:
                    # 2. Scope: the namespace lapse stored, never the event's.
                    ends[i] = _Skipped(due, outside)
                case Proven(due=due):
                    # 3. The stored run's keys.
                    keys = keys_for(due.run, self.rows.targets)
                    if keys.keys:
                        proven.append(_Proven(i, claim, due, keys))
                    else:
                        ends[i] = _Done(due, Counted(()), keys.skipped)
        # One transaction holds each uid and row key once: the rest wait for the next round.
        taken, later = split(proven, _Proven.row_keys)
        # 4. The brake, then the rate limit (a dry run deletes nothing: neither applies),
        # once per run; the transaction waits for its last run's slot.
        deleting: list[_Proven] = []
        wait = 0.0
        for p in taken:
            if self.dry_run:
                deleting.append(p)
                continue
            try:
                admitted = await self._admit(p.due)
            except Exception as exc:
                failed[p.at] = exc
                continue
            if isinstance(admitted, _Held):
                ends[p.at] = admitted
            else:
                wait = max(wait, admitted)
                deleting.append(p)
        if wait > 0:
            await asyncio.sleep(wait)
        # 5. One transaction, each run held to the database's own account of it.
        if deleting:
            rows = [self._run_rows(p.due, p.keys) for p in deleting]
            results = await self.rows.delete(rows, dry_run=self.dry_run)
            for p, result in zip(deleting, results, strict=True):
                try:
                    ends[p.at] = self._judged(p.due, result, p.keys.skipped)
                except RetryLater as exc:
                    failed[p.at] = exc
        # 6. Each event's outcome, from its own end alone.
        produced: dict[int, list[BaseCloudEvent]] = {}
        claimed = dict(claims)
        for i, problem in failed.items():
            if isinstance(problem, InvalidSubjectToken):
                reason = f"cannot reschedule: {problem}"
                produced[i] = [self._outcomes.failed(claimed[i].run, reason, originals[i])]
            elif isinstance(problem, Exception):
                answers[i] = problem
            else:
                raise problem  # cancelled, interrupted: not the event's answer
        for i, end in ends.items():
            try:
                produced[i] = await self._conclude(claimed[i], end, originals[i])
            except InvalidSubjectToken as exc:
                reason = f"cannot reschedule: {exc}"
                produced[i] = [self._outcomes.failed(claimed[i].run, reason, originals[i])]
            except Exception as exc:
                answers[i] = exc
        await self._emit(events, produced, answers)
        return [(p.at, p.claim) for p in later]

    def _run_rows(self, due: CleanupDue, keys: RunKeys) -> RunRows:
        def accepts(facts: RunFacts) -> bool:
            return judge_facts(due, facts, self.clock()) is None

        record = None
        if self.metadata is not None and ML_METADATA in keys.keys:
            record = functools.partial(self.metadata.record, due.run.uid)
        return RunRows(keys.keys, accepts, record=record, namespace=due.run.namespace)

    async def _emit(
        self,
        events: Sequence[tuple[BaseCloudEvent, Trust]],
        produced: Mapping[int, list[BaseCloudEvent]],
        answers: list[list[BaseCloudEvent] | Exception],
    ) -> None:
        """Each event's outcomes in order, the events' side by side (an acknowledged
        publish each: one after another they were most of a batch's time)."""
        emitting = [
            emit_all(self.emitter, [as_outcome_of(events[i][0], e) for e in outcomes])
            for i, outcomes in produced.items()
        ]
        emitted = await asyncio.gather(*emitting, return_exceptions=True)
        for i, answer in zip(produced, emitted, strict=True):
            if isinstance(answer, BaseException) and not isinstance(answer, Exception):
                raise answer
            answers[i] = answer

    def _judged(self, due: CleanupDue, result: RunResult, skipped: Mapping[str, str]) -> _End:
        match result:
            case Counted():
                return _Done(due, result, skipped)
            case Unavailable(reason=reason):
                raise RetryLater(reason, RETRY_DELAY)
            case Rejected(reason=reason):
                return _Refused(due.run, reason, outcome=None)
            case Contradicted(facts=facts):
                match judge_facts(due, facts, self.clock()):
                    case NotOwned(reason=reason):
                        return _Refused(due.run, reason)
                    case Keep(reason=reason):
                        return _Kept(due, reason)
                    case MoveTo(deadline=deadline, reason=reason):
                        return _Later(due, deadline, reason, put=True)
                    case None:
                        # Agreed on a second look (time passed): delivered again, it deletes.
                        raise RetryLater("the database's account of the run changed", 0)
        assert_never(result)

    async def _admit(self, due: CleanupDue) -> _Held | float:
        """The brake's answer for one run, else how long until its rate-limit slot:
        delayed in arrival order, never dropped."""
        now = self.clock()
        assert self.brake is not None and self.rate_limit is not None  # set in __post_init__
        decision = await self.brake.admit(now.timestamp())
        if not decision.admitted:
            assert decision.until is not None
            return _Held(due, datetime.fromtimestamp(decision.until, UTC), decision.tripped)
        return await self.rate_limit.reserve(now.timestamp())

    async def _conclude(
        self, claim: CleanupDue, end: _End, original: OriginalEvent
    ) -> list[BaseCloudEvent]:
        match end:
            case _Done(due=due, counted=counted, skipped=skipped):
                if self.dry_run:
                    outcome = Outcome.DRY_RUN
                elif counted.total > 0:
                    outcome = Outcome.DELETED
                else:
                    outcome = Outcome.ALREADY_GONE
                detail = describe(counted, skipped, dry_run=self.dry_run)
                dry_run = outcome is Outcome.DRY_RUN
                return [
                    self._outcomes.completed(
                        due.run, outcome, due.deadline, detail, dry_run=dry_run
                    )
                ]
            case _Refused(run=run, reason=reason, outcome=None):
                return [self._outcomes.failed(run, reason, original)]
            case _Refused(run=run, reason=reason, outcome=outcome):
                return [self._outcomes.completed(run, outcome, claim.deadline, reason)]
            case _Later(due=due, deadline=deadline, reason=reason, put=put):
                if put:
                    await self._put(due, deadline, fire_at=deadline)
                return [
                    self._outcomes.completed(due.run, Outcome.RESCHEDULED, claim.deadline, reason)
                ]
            case _Kept(due=due, reason=reason):
                return [self._outcomes.completed(due.run, Outcome.KEPT, due.deadline, reason)]
            case _Skipped(due=due, reason=reason):
                detail = f"{reason}; no rows were read or deleted"
                return [self._outcomes.completed(due.run, Outcome.SKIPPED, due.deadline, detail)]
            case _Held(due=due, until=until, tripped=tripped):
                await self._put(due, due.deadline, fire_at=until)
                produced = []
                if tripped:
                    settings = self.safety.mass_deletion_brake
                    window = int(settings.window.total_seconds())
                    produced.append(
                        self._outcomes.failed(
                            due.run,
                            f"mass-deletion brake engaged for database rows: more than "
                            f"{settings.max_due} runs' rows due within {window}s; deleting "
                            f"rows is paused until {until.isoformat()} and due runs are "
                            "rescheduled (check the policies; raise "
                            "safety.mass_deletion_brake.max_due if this volume is expected)",
                            stage=BRAKE_STAGE,
                        )
                    )
                detail = f"mass-deletion brake engaged: rescheduled for {until.isoformat()}"
                produced.append(
                    self._outcomes.completed(due.run, Outcome.RESCHEDULED, due.deadline, detail)
                )
                return produced
            case _:
                assert_never(end)

    async def _put(self, due: CleanupDue, deadline: datetime, *, fire_at: datetime) -> None:
        """A new due event for `deadline`, delivered at `fire_at`, for the stored run."""
        moved = due.model_copy(update={"deadline": deadline, "scheduled_at": self.clock()})
        event = build_event(EventType.CLEANUP_DUE, source=SOURCE, data=moved, **creation_context())
        # The rows are proved from the stored schedule and the database, not from this.
        await self.schedules.put(
            Target.DATABASE, due.run.uid, fire_at, event, provenance=Provenance.CLAIMED
        )


def describe(counted: Counted, skipped: Mapping[str, str], *, dry_run: bool = False) -> str:
    """`kfp: run_metrics=3, tasks=2, ...; argo_archive: skipped (why)` (bounded)."""
    per_target: dict[str, list[str]] = {}
    for target, table, rows in counted.counts:
        per_target.setdefault(target, []).append(f"{table}={rows}")
    parts = [f"{target}: {', '.join(tables)}" for target, tables in per_target.items()]
    if parts and dry_run:
        parts[0] = f"would delete {parts[0]}"
    skips = [*skipped.items(), *counted.skipped]
    parts += [f"{target}: skipped ({reason})" for target, reason in skips]
    return clip("; ".join(parts))
