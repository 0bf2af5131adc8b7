"""Real Jobs, run to the end by the cluster's own kube-controller-manager, cleaned by lapse
(issue 39): no object here is written finished by the test. Five Jobs of a few seconds each,
in the namespace one shape of lapse cleans, all at once:

- `succeeded` (exit 0) and `failed` (exit 3, `backoffLimit: 0`: exhausted at the first
  failure), each with `lapse.dev/ttl`: lapse deletes them at the controller-written finish
  (the Complete/Failed condition's lastTransitionTime) + ttl, not before;
- `engine-first`: `ttlSecondsAfterFinished: 2` under a longer `lapse.dev/ttl`: Kubernetes'
  TTL-after-finished controller deletes it (Foreground: the watch sees its
  `foregroundDeletion` finalizer) and lapse never deletes it a second time;
- `lapse-first`: `ttlSecondsAfterFinished: 600` under a shorter `lapse.dev/ttl`: lapse's
  deadline comes first;
- `running`: a long sleep with a `lapse.dev/ttl` of 1 s: never touched while it runs, checked
  after the others' deletions (which it would have met).

Every deleted Job's pods go too (lapse deletes with Background propagation: the garbage
collector takes them, none is orphaned), and the controller-manager logs no error about
these Jobs. Both shapes: `lapse up` of the single-process overlay (`lapse_up`, its own
restricted namespace, outcomes read with `lapse history`) and the Knative functions of the
dev overlay (`lapse`, namespace `default`).

`LAPSE_RECORD_ENGINE_FIXTURES=1` writes the Jobs as the controller left them to
tests/fixtures/engines/ (what tests/unit/test_engine_fixtures.py feeds to lapse's
decisions, and docs/engines.md's table is checked against)."""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import REPO, Cluster, json_objects, poll
from tests.cluster.lapse_on_cluster import RUNS, DeletionWatch, parse_time
from tests.cluster.lapse_up_on_cluster import UID, LapseUp

FIXTURES = REPO / "tests/fixtures/engines"
LAPSE_TTL = 8  # lapse.dev/ttl of the Jobs lapse deletes
ENGINE_FIRST_TTL = 2  # ttlSecondsAfterFinished, under a lapse.dev/ttl of ENGINE_LOSES_TTL
ENGINE_LOSES_TTL = 12
LAPSE_FIRST_ENGINE_TTL = 600


@dataclass(frozen=True)
class Case:
    script: str
    lapse_ttl: int
    engine_ttl: int | None = None

    def lapse_deletes(self) -> bool:
        return self.engine_ttl is None or self.engine_ttl > self.lapse_ttl


CASES = {
    "succeeded": Case("print('done')", LAPSE_TTL),
    "failed": Case("raise SystemExit(3)", LAPSE_TTL),
    "engine-first": Case("print('done')", ENGINE_LOSES_TTL, ENGINE_FIRST_TTL),
    "lapse-first": Case("print('done')", LAPSE_TTL, LAPSE_FIRST_ENGINE_TTL),
    "running": Case("import time; time.sleep(600)", 1),
}


def job(name: str, case: Case, image: str, token: str) -> dict[str, Any]:
    """A Job whose pod passes Pod Security `restricted` (lapse up's namespace enforces it)."""
    spec: dict[str, Any] = {
        "backoffLimit": 0,
        "template": {
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "securityContext": {
                    "runAsNonRoot": True, "runAsUser": UID,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                "containers": [{
                    "name": "main", "image": image, "command": ["python3", "-c", case.script],
                    "securityContext": {"allowPrivilegeEscalation": False,
                                        "capabilities": {"drop": ["ALL"]}},
                    "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                }],
            }
        },
    }  # fmt: skip
    if case.engine_ttl is not None:
        spec["ttlSecondsAfterFinished"] = case.engine_ttl
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "labels": {"lapse-test": token},
            "annotations": {"lapse.dev/ttl": f"{case.lapse_ttl}s"},
        },
        "spec": spec,
    }


def finish(obj: dict[str, Any]) -> tuple[str, datetime] | None:
    """The Complete/Failed condition the Job controller wrote, and when (what lapse and the
    TTL-after-finished controller count from)."""
    for condition in obj.get("status", {}).get("conditions", []):
        if condition["type"] in ("Complete", "Failed") and condition["status"] == "True":
            return condition["type"], parse_time(condition["lastTransitionTime"])
    return None


@dataclass
class Shape:
    name: str
    namespace: str
    # lapse's audit rows of Jobs (`lapse history`), where the test reads them
    history: Callable[[], list[dict[str, Any]]] | None


@pytest.fixture(params=["up", "knative"])
def shape(request: pytest.FixtureRequest) -> Iterator[Shape]:
    if request.param == "up":
        up: LapseUp = request.getfixturevalue("lapse_up")

        def history() -> list[dict[str, Any]]:
            result = up.cli("history", "-n", up.namespace, "--kind", "Job", "-o", "json")
            assert result.returncode == 0, result.stderr
            rows: list[dict[str, Any]] = json.loads(result.stdout)["items"]
            return rows

        yield Shape("lapse up", up.namespace, history)
    else:
        request.getfixturevalue("lapse")
        yield Shape("knative", RUNS, None)


def controller_manager_log(cluster: Cluster) -> Path:
    return Path(cluster.kubeconfig).parent / "logs/kube-controller-manager.log"


def test_real_jobs_are_deleted_at_their_deadline_by_lapse_or_the_ttl_controller(
    cluster: Cluster, shape: Shape
) -> None:
    started = time.monotonic()
    token = uuid.uuid4().hex[:8]
    names = {case: f"job-{token}-{case}" for case in CASES}
    log = controller_manager_log(cluster)
    log_start = log.stat().st_size
    watch = DeletionWatch(cluster, shape.namespace, selector=f"lapse-test={token}",
                          resource="jobs.batch")  # fmt: skip
    try:
        items = [job(names[c], case, cluster.python_image, token) for c, case in CASES.items()]
        listed = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        out = cluster.kubectl("-n", shape.namespace, "create", "-ojson", "-f", "-", stdin=listed)
        created = json_objects(out)
        if len(created) == 1 and created[0].get("kind") == "List":
            created = created[0]["items"]
        uids = {obj["metadata"]["name"].rpartition(f"{token}-")[2]: obj["metadata"]["uid"]
                for obj in created}  # fmt: skip
        assert set(uids) == set(CASES), uids
        gone = {c: watch.deleted_at(uids[c], timeout=120) for c in CASES if c != "running"}
        report = check_deletions(watch, uids, gone)
        all_gone = time.monotonic() - started
        check_pods_gone(cluster, shape.namespace, [names[c] for c in gone])
        # `running` would have been deleted by now if lapse touched running Jobs: its
        # lapse.dev/ttl (1 s) is far shorter than the others'.
        running = cluster.get(shape.namespace, f"job/{names['running']}")
        assert running["metadata"]["uid"] == uids["running"], running["metadata"]
        assert "deletionTimestamp" not in running["metadata"], running["metadata"]
        assert finish(running) is None, running["status"]
        assert running["status"].get("active") == 1, running["status"]
        if shape.history is not None:
            check_outcomes(shape.history, uids)
        check_controller_log(log, log_start, names.values())
        if os.environ.get("LAPSE_RECORD_ENGINE_FIXTURES"):
            record(cluster, watch, uids, running)
        print(f"\n{shape.name}: deleted after their deadline by: {report}; the last "
              f"{all_gone:.1f} s after the Jobs' creation, {time.monotonic() - started:.1f} s "
              "with the checks")  # fmt: skip
    finally:
        watch.stop()
        cluster.kubectl("-n", shape.namespace, "delete", "jobs", "-l", f"lapse-test={token}",
                        "--cascade=background", "--wait=false", check=False)  # fmt: skip


def check_deletions(watch: DeletionWatch, uids: dict[str, str], gone: dict[str, float]) -> str:
    """Each Job deleted at or after its deadline (finish + the TTL of whoever deleted it),
    by the hand the case expects; returns the lateness of each."""
    lines = []
    for case, deleted_at in gone.items():
        seen = watch.objects[uids[case]]
        finished = next((f for o in seen if (f := finish(o)) is not None), None)
        assert finished is not None, f"{case}: never finished before its deletion: {seen[-1]}"
        condition, at = finished
        assert condition == ("Failed" if case == "failed" else "Complete"), (case, condition)
        spec = CASES[case]
        ttl = spec.lapse_ttl if spec.lapse_deletes() else spec.engine_ttl
        assert ttl is not None
        lateness = deleted_at - (at.timestamp() + ttl)
        # lastTransitionTime has second resolution and rounds down: the true finish is no
        # earlier, so a deletion before it + ttl is early for certain.
        assert lateness >= 0, f"{case}: deleted {-lateness:.2f} s before its deadline"
        assert lateness < 60, f"{case}: deleted {lateness:.1f} s after its deadline"
        # The TTL-after-finished controller deletes Foreground: the Job waits for its pods
        # under the foregroundDeletion finalizer. lapse deletes Background: gone at once.
        foreground = any("foregroundDeletion" in o["metadata"].get("finalizers", []) for o in seen)
        assert foreground is not spec.lapse_deletes(), (case, seen[-1]["metadata"])
        lines.append(f"{case} +{lateness:.2f} s")
    return ", ".join(lines)


def check_pods_gone(cluster: Cluster, namespace: str, jobs: list[str]) -> None:
    selector = f"batch.kubernetes.io/job-name in ({','.join(jobs)})"

    def none_left() -> bool:
        out = cluster.kubectl("-n", namespace, "get", "pods", "-l", selector, "-o", "name")
        return not out.strip()

    poll(f"the pods of {jobs} deleted with their Jobs", none_left, timeout=60, interval=0.5)


def check_outcomes(history: Callable[[], list[dict[str, Any]]], uids: dict[str, str]) -> None:
    """lapse's audit trail: `deleted` once for each Job it deleted, never for the one the
    TTL controller deleted first (nothing, or already_gone: no second DELETE), nothing for
    the running one."""
    mine = {uids[c] for c, spec in CASES.items() if c != "running" and spec.lapse_deletes()}

    def all_recorded() -> list[dict[str, Any]]:
        rows = history()  # one `lapse history` (a process) per poll
        return rows if mine <= {r["uid"] for r in rows if r["outcome"] == "deleted"} else []

    rows = poll("lapse's outcomes of the Jobs it deleted", all_recorded, timeout=30, interval=1)
    for uid in mine:
        outcomes = [r for r in rows if r["uid"] == uid]
        assert [r["outcome"] for r in outcomes] == ["deleted"], outcomes
        assert outcomes[0]["latencySeconds"] >= 0, outcomes
    engine = [r["outcome"] for r in rows if r["uid"] == uids["engine-first"]]
    assert set(engine) <= {"already_gone"}, rows
    assert not [r for r in rows if r["uid"] == uids["running"]], rows


def check_controller_log(log: Path, start: int, names: Iterable[str]) -> None:
    """No error or warning of the controller-manager (klog E/W lines) naming these Jobs."""
    with log.open("rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    wanted = re.compile("|".join(re.escape(n) for n in names))
    bad = [line for line in text.splitlines() if line[:1] in ("E", "W") and wanted.search(line)]
    assert not bad, "\n".join(bad)


def record(cluster: Cluster, watch: DeletionWatch, uids: dict[str, str],
           running: dict[str, Any]) -> None:  # fmt: skip
    """The Jobs as the controller left them (the last state before any deletion), with the
    Kubernetes version that wrote them."""
    version = json.loads(cluster.kubectl("version", "-o", "json"))["serverVersion"]["gitVersion"]
    objects: dict[str, Any] = {"running": running}
    for case, uid in uids.items():
        if case == "running":
            continue
        seen = [o for o in watch.objects[uid] if "deletionTimestamp" not in o["metadata"]]
        objects[case] = seen[-1]
    for obj in objects.values():
        obj["metadata"].pop("managedFields", None)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    path = FIXTURES / f"kubernetes-{version}-jobs.json"
    recorded = {
        "engine": "kubernetes", "version": version,
        "recorded": datetime.now(UTC).strftime("%Y-%m-%d"),
        "by": "tests/cluster/test_engines_on_cluster.py", "jobs": objects,
    }  # fmt: skip
    path.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")
