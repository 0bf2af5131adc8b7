"""lapse deployed on the real cluster as docs/deploy.md says, and its due path proven there
(issue 17): lapse's images pushed to the cluster's registry, the run CRDs, the Secrets the
docs ask for, `kubectl apply -k infra/overlays/dev` (its NATS included), everything Ready;
then a Workflow written finished is deleted at its deadline, not before, through
ApiServerSource -> Broker -> ttl-planner -> NATS message schedule -> lapse-bridge ->
Broker -> object-reaper, and a reaper scaled to zero wakes for a due event.

How lapse is deployed (the kustomization over the dev overlay): lapse_on_cluster.py.
Run by `make test-cluster`.
"""

from __future__ import annotations

from tests.cluster.conftest import poll
from tests.cluster.lapse_on_cluster import REAPER, Deployment, Written, parse_time


def test_a_finished_workflow_is_deleted_at_its_deadline_not_before(lapse: Deployment) -> None:
    ttl = 20
    got = Written(lapse, ttl, "e2e").write().deleted()
    # A generous bound, so a lost event fails rather than passing late: the path is a few
    # hops, each well under a second when warm; cold functions add seconds.
    assert got.lateness < 60, got
    print(
        f"\nWorkflow {got.name} (lapse.dev/ttl {ttl}s): written {got.created_at:.3f}, "
        f"deadline {got.deadline:.3f}, deleted {got.deleted_at:.3f}: "
        f"lateness {got.lateness:.2f} s "
        f"({got.reaper_pods_at_deadline} object-reaper pod(s) 1.5 s before the deadline)"
    )


def test_a_reaper_scaled_to_zero_wakes_for_a_due_event(lapse: Deployment) -> None:
    poll(f"{REAPER} scaled to zero", lambda: not lapse.pods(REAPER), timeout=180)
    got = Written(lapse, 20, "cold").write().deleted()
    assert got.reaper_pods_at_deadline == 0, got
    pods = lapse.pods(REAPER)
    woke = [p for p in pods if parse_time(p["metadata"]["creationTimestamp"]).timestamp()
            >= got.deadline - 1]  # fmt: skip
    assert woke, f"no {REAPER} pod started for the due event: {[p['metadata'] for p in pods]}"
    pod = woke[0]
    created = parse_time(pod["metadata"]["creationTimestamp"]).timestamp()
    ready = next(
        parse_time(c["lastTransitionTime"]).timestamp()
        for c in pod["status"]["conditions"]
        if c["type"] == "Ready"
    )
    assert got.lateness < 90, got
    print(
        f"\nscaled-to-zero object-reaper: pod {pod['metadata']['name']} created "
        f"{created - got.deadline:+.0f} s from the deadline, Ready {ready - created:.0f} s "
        f"later (second resolution); Workflow deleted {got.lateness:.2f} s after its "
        "deadline (cold start included)"
    )


def test_a_reaper_already_up_deletes_the_next_due_run(lapse: Deployment) -> None:
    """Two Workflows due 6 s apart: the first wakes the reaper, the second finds it up."""
    first = Written(lapse, 20, "warm-a").write()
    second = Written(lapse, 26, "warm-b").write()
    first.deleted()
    second.deleted()
    assert second.reaper_pods_at_deadline > 0, second
    assert second.lateness < 30, second
    print(
        f"\nfirst Workflow deleted {first.lateness:.2f} s after its deadline "
        f"({first.reaper_pods_at_deadline} reaper pod(s) before it), the second "
        f"{second.lateness:.2f} s after its own with the reaper up "
        f"({second.reaper_pods_at_deadline} pod(s))"
    )
