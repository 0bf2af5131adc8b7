"""Policy objects on the real cluster's Knative path (issue 26): the CRDs arrive with the
kustomize package (`infra/overlays/dev`, through `infra/components/policies`), a
ClusterLapsePolicy and a LapsePolicy are applied as a kustomization of their own, and that
one change moves a run's deadline end to end: the Deployment lapse-policy-watcher judges
the LapsePolicy (status Accepted) and re-plans the finished Workflow it matches with its
own ttl-planner; the schedule, now in the past, fires at once through NATS -> lapse-bridge
-> Broker -> object-reaper, which re-decides it with the same policy (it follows the
objects itself) and deletes the Workflow. Before the policy the same Workflow had only
lapse.yaml's 24h default and stayed.

The run is a Workflow written finished (status already Succeeded, as every test here does:
no controller runs), never a real Job waited on to complete.

Run by `make test-cluster`; lapse is deployed once per session (lapse_on_cluster.py).
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.conftest import poll
from tests.cluster.lapse_on_cluster import (
    RUNS,
    SYSTEM,
    DeletionWatch,
    Deployment,
    kubectl_waiting,
    rfc3339,
)

WATCHER = "lapse-policy-watcher"
CRDS = ("lapsepolicies.lapse.dev", "clusterlapsepolicies.lapse.dev")
# The smallest TTL a LapsePolicy may set (its schema refuses less): the Workflow below
# finished 10 minutes ago, so its new deadline is already past when the policy arrives.
POLICY_TTL = "1m"
FINISHED_AGO = timedelta(minutes=10)
# Without the policy, lapse.yaml's default: 24h after the finish. The Workflow must still
# be there this long after the ApiServerSource saw it (the planner has planned it by then).
UNPOLICED_FOR = 15.0


def unannotated_workflow(name: str, finished_at: datetime, label: str) -> dict[str, Any]:
    """A finished Workflow with no lapse.dev/ttl: only a policy gives it a deadline."""
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "labels": {"workflows.argoproj.io/completed": "true", "lapse-policy-test": label},
        },
        "spec": {"entrypoint": "main", "templates": [{"name": "main", "container": {
            "image": "busybox", "command": ["true"]}}]},
        "status": {
            "phase": "Succeeded",
            "startedAt": rfc3339(finished_at - timedelta(seconds=3)),
            "finishedAt": rfc3339(finished_at),
        },
    }  # fmt: skip


def policy_package(folder: Path, tag: str) -> Path:
    """The team's policy and the platform's permission for it, as a kustomization."""
    allow = {
        "apiVersion": "lapse.dev/v1alpha1", "kind": "ClusterLapsePolicy",
        "metadata": {"name": f"allow-{tag}"},
        "spec": {"match": {"namespaces": [RUNS]},
                 "namespacedPolicies": {"allowed": True, "kubernetes": {"minTTL": "1m"}}},
    }  # fmt: skip
    team = {
        "apiVersion": "lapse.dev/v1alpha1", "kind": "LapsePolicy",
        "metadata": {"name": f"short-{tag}", "namespace": RUNS},
        "spec": {"match": {"engines": ["argo"], "labels": {"lapse-policy-test": tag}},
                 "kubernetes": {"ttl": POLICY_TTL}},
    }  # fmt: skip
    (folder / "policies.yaml").write_text(yaml.safe_dump_all([allow, team]))
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["policies.yaml"],
    }
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return folder


def accepted(lapse: Deployment, name: str) -> dict[str, Any] | None:
    obj = json.loads(
        lapse.cluster.kubectl("-n", RUNS, "get", f"lapsepolicies.lapse.dev/{name}", "-o", "json")
    )
    status = obj.get("status") or {}
    if status.get("observedGeneration") != obj["metadata"]["generation"]:
        return None
    found: dict[str, Any] = next(c for c in status["conditions"] if c["type"] == "Accepted")
    return found


def watcher_logs(lapse: Deployment) -> str:
    return lapse.cluster.kubectl(
        "-n", SYSTEM, "logs", f"deploy/{WATCHER}", "--tail=40", check=False
    )  # fmt: skip


def test_a_lapse_policy_applied_with_kustomize_deletes_the_run_it_shortens(
    lapse: Deployment, tmp_path: Path
) -> None:
    cluster = lapse.cluster
    for crd in CRDS:
        cluster.kubectl("wait", f"crd/{crd}", "--for=condition=Established", "--timeout=60s")
    kubectl_waiting(cluster, "-n", SYSTEM, "rollout", "status", f"deploy/{WATCHER}", timeout=240)

    tag = uuid.uuid4().hex[:8]
    name = f"policed-{tag}"
    watch = DeletionWatch(cluster, RUNS, name)
    package = policy_package(tmp_path, tag)
    try:
        time.sleep(1)  # the watch is established (its first list comes back empty)
        finished_at = datetime.now(UTC).replace(microsecond=0) - FINISHED_AGO
        created = json.loads(
            cluster.kubectl(
                "-n", RUNS, "create", "-o", "json", "-f", "-",
                stdin=json.dumps(unannotated_workflow(name, finished_at, tag)),
            )
        )  # fmt: skip
        uid = created["metadata"]["uid"]
        watch.added()
        # No policy yet: lapse.yaml's 24h default, so nothing happens.
        until = time.monotonic() + UNPOLICED_FOR
        while time.monotonic() < until:
            assert not watch.deleted(), f"{name} deleted before any policy applied to it"
            time.sleep(0.5)

        applied_at = time.time()
        cluster.kubectl("apply", "-k", str(package))

        # Judged once both objects are read (one may arrive before the other: NotAllowed
        # for a moment, then Accepted).
        def in_effect() -> dict[str, Any] | None:
            found = accepted(lapse, f"short-{tag}")
            return found if found and found["reason"] == "Accepted" else None

        try:
            verdict = poll(f"LapsePolicy short-{tag} Accepted", in_effect, 60, 0.5)
        except AssertionError as exc:
            now = accepted(lapse, f"short-{tag}")
            raise AssertionError(f"{exc}: {now}\n{watcher_logs(lapse)}") from None
        assert verdict["status"] == "True", verdict
        try:
            deleted_at = watch.deleted_at(uid, timeout=150)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}: {name} (uid {uid}) not deleted after the policy\n"
                f"--- {WATCHER} logs\n{watcher_logs(lapse)}\n{lapse.diagnosis()}"
            ) from None
        # The audit trail names the policy object, by name and generation, for the schedule
        # and the deletion (`lapse history`, run where lapse's admin identity is mounted).
        by = f"lapsepolicy:{RUNS}/short-{tag}@1"

        def named() -> list[dict[str, Any]]:
            history = cluster.kubectl(
                "-n", SYSTEM, "exec", "deploy/lapse-streams", "-c", "streams", "--",
                "lapse", "history", "-n", RUNS, "--name", name, "--all", "-o", "json",
            )  # fmt: skip
            rows = [r for r in json.loads(history)["items"] if by in (r.get("detail") or "")]
            done = any(r["outcome"] == "deleted" for r in rows)
            return rows if done else []

        # The outcome is recorded just after the deletion: polled.
        rows = poll(f"lapse history names {by} for the deletion", named, 60, 1.0)
        assert {r["event"] for r in rows} >= {"cleanup.scheduled", "cleanup.completed"}, rows
        print(
            f"\nLapsePolicy short-{tag} (kubernetes.ttl {POLICY_TTL}) applied with kustomize: "
            f"Accepted, and Workflow {name}, finished {FINISHED_AGO} earlier and kept under "
            f"lapse.yaml's default for {UNPOLICED_FOR:.0f} s, deleted "
            f"{deleted_at - applied_at:.1f} s after the apply"
        )
    finally:
        watch.stop()
        cluster.kubectl("delete", "-k", str(package), "--ignore-not-found", check=False)
        cluster.kubectl("-n", RUNS, "delete", "workflow", name, "--ignore-not-found", check=False)
