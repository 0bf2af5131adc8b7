"""Whose deletion a gone object is (functions/artifact_reaper/sent.py, issue 37), and the
artifact reaper's tally over it (handler.py): an object found gone is lapse's own deletion
only when an earlier pass sent a DELETE for that very object (store, key, etag), the
answer to which may never have come; any other gone object is someone else's."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lapse.functions.artifact_reaper.capture import RunCapture
from lapse.functions.artifact_reaper.handler import Batch, Plan, Tally, _counted
from lapse.functions.artifact_reaper.ports import Deletion, SentBatch, StoredObject
from lapse.functions.artifact_reaper.sent import gone_since_sent, lapses_own, sent_marks

A = StoredObject("runs/team-a/wf/a.log", 10, '"e-a"')
B = StoredObject("runs/team-a/wf/b.log", 20, '"e-b"')
C = StoredObject("runs/team-a/wf/c.log", 40, '"e-c"')
CAPTURE = RunCapture(uid="uid-1")


def test_a_gone_object_is_lapses_only_when_lapse_sent_a_delete_for_that_very_object() -> None:
    sent = sent_marks([SentBatch("argo", (A, B))])
    assert lapses_own("argo", A, sent)
    assert not lapses_own("argo", C, sent), "never sent: someone else's"
    assert not lapses_own("other", A, sent), "another store's key"
    rewritten = StoredObject(A.path, A.size, '"e-new"')
    assert not lapses_own("argo", rewritten, sent), "another object under the same key"


def test_the_sent_objects_gone_since_are_those_not_there_each_once() -> None:
    sent = (SentBatch("argo", (A, B)), SentBatch("argo", (B, C)))
    gone = gone_since_sent(sent, [("argo", B.path), ("other", C.path)])
    assert gone == (SentBatch("argo", (A,)), SentBatch("argo", (C,)))
    assert gone_since_sent(sent, [("argo", o.path) for o in (A, B, C)]) == ()


def test_a_delete_answered_too_late_is_counted_deleted_not_already_gone() -> None:
    # Pass 1 sent DELETEs for A and B, and B's answer never came; pass 2 lists B again
    # (the delete lands later) and the store answers 404; A is gone at the listing.
    plan = Plan(
        CAPTURE,
        Tally(),
        (Batch("argo", (B, C)),),
        sent=(SentBatch("argo", (A, B)),),
        sent_gone=(SentBatch("argo", (A,)),),
    )
    tally = _counted(plan, [Deletion(gone=(B,))])
    assert (tally.objects, tally.bytes, tally.gone) == (3, 70, 0)


def test_a_key_gone_that_lapse_never_sent_a_delete_for_stays_already_gone() -> None:
    plan = Plan(CAPTURE, Tally(), (Batch("argo", (B, C)),), sent=(SentBatch("argo", (A,)),))
    tally = _counted(plan, [Deletion(gone=(B, C))])
    assert (tally.objects, tally.gone) == (0, 2)


objects = st.builds(
    StoredObject,
    st.sampled_from([f"runs/team-a/wf/{i}.log" for i in range(6)]),
    st.integers(0, 100),
    st.sampled_from(['"e1"', '"e2"']),
)


@given(
    planned=st.lists(objects, max_size=6, unique_by=lambda o: o.path),
    sent=st.lists(objects, max_size=6),
    gone_at=st.sets(st.integers(0, 5)),
    kept_at=st.sets(st.integers(0, 5)),
)
def test_every_planned_object_is_counted_once_and_a_gone_one_is_lapses_only_if_sent(
    planned: list[StoredObject], sent: list[StoredObject], gone_at: set[int], kept_at: set[int]
) -> None:
    kept = tuple(o for i, o in enumerate(planned) if i in kept_at)
    gone = tuple(o for i, o in enumerate(planned) if i in gone_at and o not in kept)
    plan = Plan(
        CAPTURE, Tally(), (Batch("argo", tuple(planned)),), sent=(SentBatch("argo", tuple(sent)),)
    )
    tally = _counted(plan, [Deletion(kept=kept, gone=gone)])
    marks = sent_marks(plan.sent)
    assert tally.objects + tally.gone + tally.changed == len(planned)
    assert tally.gone == sum(1 for o in gone if not lapses_own("argo", o, marks))
    assert tally.gone <= len(gone)
    if not sent:
        assert tally.objects == len(planned) - len(kept) - len(gone)
