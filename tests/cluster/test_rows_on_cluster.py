"""A KFP run's rows in PostgreSQL deleted on their own, later clock by the row-reaper running
on the cluster (issue 17): the Workflow (label pipeline/runid) is deleted at its
lapse.dev/ttl by the object-reaper; its rows stay until finishedAt + ROWS_TTL (the policy
lapse_on_cluster.py adds to the dev overlay's lapse.yaml), then the row-reaper deletes them
from the host's PostgreSQL, reached through the Service lapse-postgres."""

from __future__ import annotations

import time
import uuid

from tests.cluster.conftest import poll
from tests.cluster.lapse_on_cluster import ROWS_TTL, Deployment, Written


def test_a_kfp_runs_rows_are_deleted_by_the_row_reaper_on_their_own_later_clock(
    lapse: Deployment,
) -> None:
    rows = lapse.rows
    assert rows is not None
    run_id = str(uuid.uuid4())
    rows.insert_run(run_id)
    before = rows.counts(run_id)
    assert all(count > 0 for count in before.values()), before
    other = str(uuid.uuid4())  # a run no Workflow names: its rows must stay
    rows.insert_run(other)

    # KFP labels its Workflows with the run id, and marks them once its final state is
    # stored (safety.wait_for_kfp_persisted holds them until then).
    labels = {"pipeline/runid": run_id, "pipeline/persistedFinalState": "true"}
    workflow = Written(lapse, 20, "kfp", labels=labels).write()
    assert workflow.finished_at is not None
    rows_deadline = workflow.finished_at.timestamp() + ROWS_TTL
    workflow.deleted()  # on the Kubernetes clock
    assert rows.counts(run_id) == before, "rows deleted with the Workflow, not on their clock"

    # Until their own deadline the rows stay; then the row-reaper deletes them.
    while time.time() < rows_deadline - 1.5:
        assert rows.counts(run_id) == before, (
            f"rows deleted {rows_deadline - time.time():.1f} s before their deadline"
        )
        time.sleep(1)

    def gone() -> float:
        return time.time() if not any(rows.counts(run_id).values()) else 0.0

    try:
        gone_at = poll("the run's rows deleted", gone, timeout=150, interval=0.25)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {rows.counts(run_id)}\n{lapse.diagnosis()}") from None
    assert gone_at >= rows_deadline, f"rows gone {rows_deadline - gone_at:.2f} s early"
    assert rows.counts(other) == before, "another run's rows were touched"
    print(
        f"\nKFP run {run_id}: Workflow deleted {workflow.lateness:.2f} s after its deadline "
        f"(lapse.dev/ttl 20s); its {sum(before.values())} rows stayed {ROWS_TTL - 20} s "
        f"longer and were gone {gone_at - rows_deadline:.2f} s after their own deadline "
        f"(database ttl {ROWS_TTL}s; polled every 0.25 s)"
    )
