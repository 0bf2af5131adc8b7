"""What to do when a Kubernetes deadline comes due: the pure decision.

`classify(fresh, due, kind, policies, safety, now)` is step 4 of the reaping sequence
(docs/architecture.md, "How a deletion is made safe"; the whole sequence reads top to
bottom in functions/reaping/sequence.py, this reaper's port in handler.py), on the
object as the API server returned it a moment ago:

identity   gone / being deleted                             -> AlreadyGone
           same name, another uid                           -> Replaced
policy     keep annotation, TTL never                       -> Kept
           not finished any more (re-run)                   -> Kept
           malformed object or lapse.dev/* annotation       -> Invalid
           deadline still in the future                     -> Reschedule
gates      the kind's gates (Argo archiving, KFP state,      -> Wait, or GaveUp once
           Tekton TaskRuns still running)                      max_wait has passed
otherwise                                                   -> Delete (dry_run flagged)

`as_planned(due, ...)` makes the same judgement on the object version the planner read
(`due.run`, with its resourceVersion): when that says Delete, the reaper can DELETE with
uid and resourceVersion preconditions without reading first, because the API server then
refuses (409) unless the object is still exactly the version judged.

`now` is the only clock. The namespace scope, the brake and rate limit, the DELETE and
the failures of API calls belong to the one reaping sequence (functions/reaping/) and
the edge; `handler.py` is the port that connects them to this judgement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

from lapse.events.adapters import Ignored
from lapse.events.adapters.objects import adapt
from lapse.events.errors import InvalidEvent
from lapse.events.kinds import Gate, KindSpec
from lapse.events.models import CleanupDue, RunFinished
from lapse.events.run import RunRef, Target
from lapse.functions.keep_last import listed_runs
from lapse.functions.object_reaper.gates import closed_gate, needs_children
from lapse.functions.policy import (
    KEEP_ANNOTATION,
    Action,
    Policy,
    counted_out,
    decide,
    keep_last_group,
    with_count,
)
from lapse.functions.safety import SafetyConfig


@dataclass(frozen=True, slots=True)
class AlreadyGone:
    detail: str


@dataclass(frozen=True, slots=True)
class Replaced:
    """The name belongs to a newer object now; it has its own deadline and is not touched."""

    current_uid: str


@dataclass(frozen=True, slots=True)
class Kept:
    run: RunRef
    reason: str


@dataclass(frozen=True, slots=True)
class Reschedule:
    """Not due yet: deliver again at `deadline` (the deadline the object says now)."""

    run: RunRef
    deadline: datetime
    policy: str
    reason: str


@dataclass(frozen=True, slots=True)
class Wait:
    """Due, but a gate is closed: ask again at `retry_at`; `deadline` stays the original
    one so the wait stays bounded and lateness stays honest."""

    run: RunRef
    deadline: datetime
    policy: str
    gate: Gate
    retry_at: datetime
    reason: str


@dataclass(frozen=True, slots=True)
class GaveUp:
    run: RunRef
    gate: Gate
    reason: str


@dataclass(frozen=True, slots=True)
class Invalid:
    run: RunRef
    reason: str


@dataclass(frozen=True, slots=True)
class Delete:
    run: RunRef
    # The fresh read's; the DELETE precondition makes the server refuse if it changed since.
    resource_version: str | None
    deadline: datetime
    policy: str
    dry_run: bool


Verdict: TypeAlias = AlreadyGone | Replaced | Kept | Reschedule | Wait | GaveUp | Invalid | Delete


def classify(
    fresh: Mapping[str, Any] | None,
    due: CleanupDue,
    kind: KindSpec,
    policies: Sequence[Policy],
    safety: SafetyConfig,
    now: datetime,
    children: Sequence[Mapping[str, Any]] = (),
    group: Sequence[Mapping[str, Any]] | None = None,
) -> Verdict:
    """The verdict for `due` given `fresh`, the object's current state (None: 404), and,
    for kinds whose gates need them, its `children` as listed a moment ago. `group`: the
    objects of its keep_last group as listed a moment ago (`counts`), None when not
    listed: then only the clocks decide."""
    ref = due.run
    if fresh is None:
        return AlreadyGone(f"{kind.kind} {ref.subject} no longer exists")
    metadata = fresh.get("metadata")
    metadata = metadata if isinstance(metadata, Mapping) else {}
    uid = metadata.get("uid")
    if uid != ref.uid:
        return Replaced(str(uid))
    if metadata.get("deletionTimestamp"):
        return AlreadyGone(
            f"{kind.kind} {ref.subject} is already being deleted "
            f"(deletionTimestamp {metadata['deletionTimestamp']})"
        )

    annotations = metadata.get("annotations")
    keep = isinstance(annotations, Mapping) and annotations.get(KEEP_ANNOTATION) == "true"
    try:
        adapted = adapt(dict(fresh), kind)
    except InvalidEvent as exc:
        # keep outranks everything, even an object lapse cannot otherwise read.
        if keep:
            return Kept(ref, f"{KEEP_ANNOTATION} is 'true': the object is kept")
        return Invalid(ref, f"the {kind.kind} as it is now cannot be used: {exc.reason}")
    if isinstance(adapted, Ignored):
        if keep:
            return Kept(ref, f"{KEEP_ANNOTATION} is 'true': the object is kept")
        return Kept(
            ref,
            f"{adapted.reason} (re-run?): not deleted; it is planned again when it finishes",
        )
    assert isinstance(adapted, RunFinished)  # adapt(deleted=False) never says deleted
    return _judge(adapted.run, due, kind, policies, safety, now, children, group)


def counts(verdict: Verdict, policies: Sequence[Policy]) -> str | None:
    """The label selector of the keep_last group to list before judging again, when the
    clocks say "not yet" (or "never": a TTL of never does not outlast the count) and the
    count might say "now"; None otherwise (and always for a run marked keep)."""
    if isinstance(verdict, Kept):
        if verdict.run.annotations.get(KEEP_ANNOTATION) == "true":
            return None
    elif not isinstance(verdict, Reschedule):
        return None
    found = keep_last_group(verdict.run, policies)
    return None if found is None else found[0].selector


def as_planned(
    due: CleanupDue,
    kind: KindSpec,
    policies: Sequence[Policy],
    safety: SafetyConfig,
    now: datetime,
) -> Delete | None:
    """Delete when the object version the planner read (`due.run`) may be deleted now, as
    `classify` would judge that same version; None when a fresh read must decide (no
    resourceVersion to hold the server to, gates that need more reads, a dry run (which
    reports what a fresh read shows), or any verdict but Delete: the object has likely
    changed since, and the fresh read says how)."""
    run = due.run
    if run.resource_version is None or needs_children(kind) or safety.dry_run:
        return None
    verdict = _judge(run, due, kind, policies, safety, now, (), None)
    return verdict if isinstance(verdict, Delete) else None


def _judge(
    run: RunRef,
    due: CleanupDue,
    kind: KindSpec,
    policies: Sequence[Policy],
    safety: SafetyConfig,
    now: datetime,
    children: Sequence[Mapping[str, Any]],
    group: Sequence[Mapping[str, Any]] | None,
) -> Verdict:
    """Policy, deadline and gates for a finished run, as one object version states them,
    and the count of its keep_last group as listed a moment ago (when given)."""
    ref = due.run
    if run.finished_at is None and ref.finished_at is not None:
        # No finishedAt on the object: the clock started when the planner first saw it
        # finished, and the due event carries that time. Timing from `now` instead would
        # move the deadline on at every delivery and never delete.
        run = run.model_copy(update={"finished_at": ref.finished_at})

    decision = decide(run, Target.KUBERNETES, policies, now)
    if group is not None:
        # Counted from the group as it is now: a run already gone is not counted, and a
        # run only counted out in an older listing is not deleted on that word. The
        # count's floor is held here too, from the finish the clocks use: a schedule put
        # by a count without it (an older lapse, a bound set since) deletes nothing early.
        counted = counted_out(listed_runs(group, kind), policies, now)
        decision = with_count(decision, counted.get(run.uid), run.finished_at)
    if decision.action is Action.CANCEL:
        return Kept(run, decision.reason)
    if decision.action is Action.INVALID:
        return Invalid(run, decision.reason)
    deadline = decision.deadline
    assert deadline is not None  # Decision guarantees it for SCHEDULE
    if deadline > now:
        # Deleting before the deadline the object states *now* is never right, whether the
        # TTL was extended or the due event simply arrived early.
        why = (
            f"deadline moved from {due.deadline.isoformat()} to {deadline.isoformat()}"
            if deadline > due.deadline
            else f"not due until {deadline.isoformat()} (the due event arrived early)"
        )
        return Reschedule(run, deadline, decision.policy, f"{why}: {decision.reason}")

    closed = closed_gate(run, kind, safety, children)
    if closed is not None:
        waited = now - deadline
        limit = safety.gate_retry.max_wait
        if waited > limit:
            return GaveUp(
                run,
                closed.gate,
                f"gave up waiting for gate {closed.gate}: {closed.reason} "
                f"{int(waited.total_seconds())}s after the deadline "
                f"(safety.gate_retry.max_wait {int(limit.total_seconds())}s); nothing deleted",
            )
        retry_at = now + safety.gate_retry.backoff
        return Wait(
            run,
            deadline,
            decision.policy,
            closed.gate,
            retry_at,
            f"waiting for gate {closed.gate}: {closed.reason}; next check {retry_at.isoformat()}",
        )
    return Delete(run, run.resource_version, deadline, decision.policy, safety.dry_run)
