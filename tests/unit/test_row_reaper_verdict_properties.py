"""Properties of the row-reaper's judgements (functions/row_reaper/verdict.py), over
generated due events, stored schedules, clocks and database accounts: whatever a due event
claims, rows are proven due only by a stored schedule that has fired and whose deadline has
come, and the database's word that a run is running (or has no finish time) always keeps
its rows.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from lapse.events.models import CleanupDue
from lapse.events.run import Engine, RunRef, Target
from lapse.functions.ports import PendingSchedule
from lapse.functions.row_reaper.verdict import (
    EARLY_TOLERANCE,
    FINISH_TOLERANCE,
    Keep,
    MoveTo,
    NotOwned,
    NotYet,
    Proven,
    RunFacts,
    Unbacked,
    judge_facts,
    meets,
    precondition,
    prove,
)

MOMENTS = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
)
# Offsets around the edges that matter: the tolerance, a second, zero.
OFFSETS = st.one_of(
    st.sampled_from([timedelta(0), EARLY_TOLERANCE, -EARLY_TOLERANCE, timedelta(seconds=1.001)]),
    st.timedeltas(min_value=timedelta(days=-3650), max_value=timedelta(days=3650)),
)


@st.composite
def runs(draw: st.DrawFn) -> RunRef:
    uid = draw(st.sampled_from(["uid-1", "uid-2"]))
    return RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="team-a", name=f"wf-{uid}", uid=uid,
        phase=draw(st.sampled_from(["Succeeded", "Failed", "Running", ""])),
        finished_at=draw(st.none() | MOMENTS),
        kfp_run_id=draw(st.none() | st.sampled_from(["r1", "r2"])),
        annotations=draw(st.sampled_from([{}, {"lapse.dev/ttl": "1s"}])),
    )  # fmt: skip


@st.composite
def dues(draw: st.DrawFn) -> CleanupDue:
    return CleanupDue(
        run=draw(runs()),
        target=Target.DATABASE,
        deadline=draw(MOMENTS),
        policy=draw(st.sampled_from(["kfp-runs", "forged"])),
        scheduled_at=draw(MOMENTS),
    )


@st.composite
def stored_schedules(draw: st.DrawFn, now: datetime) -> PendingSchedule:
    deadline = now + draw(OFFSETS)
    fired = draw(st.booleans())
    due = draw(st.none() | dues())
    return PendingSchedule(Target.DATABASE, "uid-1", deadline, fired=fired, due=due)


@settings(max_examples=300, derandomize=True, database=None)
@given(claim=dues(), now=MOMENTS, data=st.data())
def test_prove_never_proves_what_lapse_did_not_store_or_has_not_fired(
    claim: CleanupDue, now: datetime, data: st.DataObject
) -> None:
    assert isinstance(prove(claim, None, now), Unbacked)

    stored = data.draw(stored_schedules(now))
    proof = prove(claim, stored, now)
    if stored.deadline - now > EARLY_TOLERANCE:
        assert isinstance(proof, NotYet) and proof.deadline == stored.deadline
    if not stored.fired or stored.due is None:
        assert not isinstance(proof, Proven)
    if isinstance(proof, Proven):
        # What is acted on is what lapse stored, never the claim's content.
        assert stored.fired and stored.due is not None
        assert proof.due is stored.due
        assert stored.deadline - now <= EARLY_TOLERANCE


# Around the bounds `precondition` draws: a finish tolerance, a microsecond either side.
NEAR = st.one_of(
    OFFSETS,
    st.sampled_from([FINISH_TOLERANCE, EARLY_TOLERANCE]).flatmap(
        lambda bound: st.sampled_from([bound, bound + timedelta(microseconds=1), -bound])
    ),
)


@st.composite
def facts(draw: st.DrawFn) -> RunFacts:
    return RunFacts(
        running=draw(st.booleans()),
        finished_at=draw(st.none() | MOMENTS),
        state=draw(st.sampled_from([None, "RUNNING", "SUCCEEDED", "Pending"])),
    )


@settings(max_examples=300, derandomize=True, database=None)
@given(due=dues(), account=facts(), now=MOMENTS, late=NEAR, early=NEAR, near=st.booleans())
def test_judge_facts_never_lets_a_running_run_or_an_unknown_finish_through(
    due: CleanupDue,
    account: RunFacts,
    now: datetime,
    late: timedelta,
    early: timedelta,
    near: bool,
) -> None:
    """...and the precondition the row store checks with the rows locked (`meets`, on the
    data the port hands it: no callable crosses into the edge) lets the rows go exactly
    when `judge_facts` agrees, at every bound (the namespace the store holds apart)."""
    if near and due.run.finished_at is not None:
        # A finish and a clock near the bounds: later than planned by about the tolerance,
        # or by about as much as leaves the moved deadline due now.
        account = dataclasses.replace(account, finished_at=due.run.finished_at + late)
        now = due.deadline + early
    verdict = judge_facts(due, account, now)
    if account.running or account.finished_at is None:
        assert isinstance(verdict, Keep)
    if verdict is None:
        # Agreed: finished, and no later than planned, or due all the same.
        assert not account.running and account.finished_at is not None
        planned = due.run.finished_at
        if planned is not None and account.finished_at - planned > FINISH_TOLERANCE:
            moved = due.deadline + (account.finished_at - planned)
            assert moved - now <= EARLY_TOLERANCE
    if isinstance(verdict, MoveTo):
        assert verdict.deadline > due.deadline and verdict.deadline - now > EARLY_TOLERANCE
    assert meets(precondition(due, now), account) == (verdict is None)


def test_the_precondition_holds_to_the_microsecond_at_both_bounds() -> None:
    """At the bounds themselves (which generated clocks rarely hit): a finish later than
    planned by the tolerance, or by as much as leaves the moved deadline due now, is
    agreed; a microsecond more is not, whichever bound is the larger."""
    planned = datetime(2026, 3, 1, tzinfo=UTC)
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace="team-a", name="wf", uid="uid-1", phase="Succeeded", finished_at=planned,
    )  # fmt: skip
    deadline = planned + timedelta(days=1)
    due = CleanupDue(
        run=run, target=Target.DATABASE, deadline=deadline, policy="p", scheduled_at=deadline
    )
    micro = timedelta(microseconds=1)
    for early in (-EARLY_TOLERANCE, timedelta(0), micro, timedelta(seconds=5)):
        now = deadline + early
        bound = max(FINISH_TOLERANCE, early + EARLY_TOLERANCE)
        for late, agreed in ((bound - micro, True), (bound, True), (bound + micro, False)):
            for running in (False, True):
                account = RunFacts(running=running, finished_at=planned + late)
                verdict = judge_facts(due, account, now)
                assert (verdict is None) is (agreed and not running), (early, late, running)
                assert meets(precondition(due, now), account) is (verdict is None)


@settings(max_examples=300, derandomize=True, database=None)
@given(
    due=dues(),
    account=facts(),
    now=MOMENTS,
    recorded=st.sampled_from(["team-a", "team-b", "", "TEAM-A", "team-a "]),
)
def test_judge_facts_refuses_rows_another_namespace_records_whatever_else_they_say(
    due: CleanupDue, account: RunFacts, now: datetime, recorded: str
) -> None:
    """Whose run comes first: rows the database records as another namespace's are refused
    (running, finished or not); the run's own namespace changes nothing of the verdict."""
    owned = dataclasses.replace(account, namespace=recorded)
    verdict = judge_facts(due, owned, now)
    if recorded != due.run.namespace:
        assert isinstance(verdict, NotOwned)
        assert "nothing was deleted" in verdict.reason
    else:
        assert verdict == judge_facts(due, account, now)
