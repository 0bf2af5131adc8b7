"""The Knative path measured on the real cluster, beside `lapse up` on the same machine
(issue 27): deletions/s and lateness through ApiServerSource -> Broker -> ttl-planner ->
NATS message schedule -> lapse-bridge -> Broker -> object-reaper, with the object-reaper
held at 1, 2 and 4 replicas of the same CPU limit, and where the time and the CPU go.

lapse is deployed as the cluster tests deploy it (tests/cluster/lapse_on_cluster.py: the dev
overlay, its NATS, the Collector and Jaeger), with lapse.yaml's rate limit and mass-deletion
brake off as in bench/compare.py. Each phase writes BURST finished Workflows at once, all
due TTL seconds later (finish times have one-second precision: one deadline for all), and
watches them go (`kubectl get --watch`, host clock = node clock):

- lateness: when the watch saw each DELETED, minus the deadline (p50, p99, max; early ones
  counted); deletions/s from the first deletion to the last;
- where the time goes, from the spans in Jaeger (each run's planner decision, the bridge's
  delivery of its due event, the reaper's request and judgement): the Workflow's ADDED
  event to the planner's request, the planning itself, the deadline to the bridge taking
  the due message, the bridge to the reaper's request (through the Broker), the reaper's
  work, and the reaper's end to the watch's DELETED;
- where the CPU goes: each pod's cgroup (cpuacct) and the host's kube-apiserver and etcd,
  summed by component over the phase, per deletion.

Then `lapse up` on the host (its embedded NATS, the same cluster's API server, only the
namespace bench-up, unthrottled) gets the same burst.

    make cluster && .venv/bin/python -m bench.bench_knative [--burst 400] [--replicas 1,2,4]

Writes bench/out/knative.json. Needs root (cgroups), the images `make images` builds and the
host's PostgreSQL (`make databases`: the row-reaper's target, as in the cluster tests).
A benchmark, never a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from bench import report
from tests.cluster.conftest import REPO, Cluster, _cluster_env, json_objects, poll
from tests.cluster.lapse_on_cluster import (
    JAEGER_QUERY_PORT,
    OBSERVABILITY,
    REAPER,
    RUNS,
    SYSTEM,
    DeletionWatch,
    deploy,
    finished_workflow,
    kubectl_waiting,
    lapse_yaml,
)
from tests.observability import jaeger_traces
from tests.stack import POSTGRES_ADMIN_URL, scratch_database

OUT = REPO / "bench" / "out" / "knative.json"
UP_NAMESPACE = "bench-up"
CGROUP_CPU = Path("/sys/fs/cgroup/cpuacct")
SERVICES = ("lapse-ttl-planner", "lapse-bridge", "lapse-object-reaper")
HOPS = (
    ("added_to_planner_s", "the Workflow's ADDED to the planner's request (through the Broker)"),
    ("planning_s", "the planner's request to its decision stored (schedule put in NATS)"),
    ("deadline_to_bridge_s", "the deadline to the bridge taking the due message (NATS schedule)"),
    ("bridge_to_reaper_s", "the bridge to the reaper's request (Broker ingress, channel, filter)"),
    ("reaper_s", "the reaper's request to its end (proof, judgement, DELETE)"),
    ("reaper_to_watch_s", "the reaper's end to the watch's DELETED"),
)


def bench_config() -> str:
    """The cluster tests' lapse.yaml, unthrottled as bench/compare.py runs `lapse up`."""
    config = yaml.safe_load(lapse_yaml())
    safety = config.setdefault("safety", {})
    safety["max_deletions_per_second"] = 1_000_000
    safety["mass_deletion_brake"] = {"enabled": False}
    config["kubernetes"] = {**config.get("kubernetes", {}), "qps": 100_000, "burst": 100_000}
    return yaml.safe_dump(config, sort_keys=False)


def versions(cluster: Cluster) -> dict[str, str]:
    """The API server's version, and Knative's as scripts/cluster/lib.sh pins them (the
    images are built from source: their own version labels say `devel`)."""
    server = json.loads(cluster.kubectl("version", "-o", "json")).get("serverVersion", {})
    found = {"kubernetes": str(server.get("gitVersion", ""))}
    lib = (REPO / "scripts/cluster/lib.sh").read_text()
    for name in ("EVENTING", "SERVING", "KOURIER"):
        pinned = re.search(rf'{name}_VERSION="\$\{{LAPSE_{name}_VERSION:-([^}}]+)\}}"', lib)
        found[f"knative-{name.lower()}"] = pinned.group(1) if pinned else ""
    return found


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """n, p50, p99 and max, the percentiles as `report.percentile` takes them."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    return {
        "n": len(values),
        "p50": round(report.percentile(values, 50) or 0.0, 3),
        "p99": round(report.percentile(values, 99) or 0.0, 3),
        "max": round(max(values), 3),
    }


# --- CPU: each pod's cgroup and the host's cluster processes ---------------------------


def _pod_cgroup(uid: str) -> Path | None:
    for qos in ("", "burstable/", "besteffort/"):
        folder = CGROUP_CPU / f"kubepods/{qos}pod{uid}"
        if (folder / "cpuacct.usage").exists():
            return folder
    return None


def cpu_seconds(cluster: Cluster) -> dict[str, float]:
    """CPU seconds so far: each pod's (by namespace/app, the function pods split into
    their function and Knative's queue-proxy) and the host's kube-apiserver and etcd."""
    pods = json.loads(cluster.kubectl("get", "pods", "-A", "-o", "json"))["items"]
    used: dict[str, float] = defaultdict(float)
    for pod in pods:
        folder = _pod_cgroup(pod["metadata"]["uid"])
        if folder is None:
            continue
        labels = pod["metadata"].get("labels", {})
        app = (
            labels.get("serving.knative.dev/service")
            or labels.get("app.kubernetes.io/component")  # Knative's: broker-ingress, ...
            or labels.get("app.kubernetes.io/name")
            or labels.get("app")
            or pod["metadata"]["name"].rsplit("-", 2)[0]
        )
        where = f"{pod['metadata']['namespace']}/{app}"
        containers = {
            c["containerID"].rsplit("/", 1)[-1]: c["name"]
            for c in pod.get("status", {}).get("containerStatuses", [])
            if c.get("containerID")
        }
        for cid, name in containers.items():
            usage = folder / cid / "cpuacct.usage"
            if usage.exists():
                part = f"{where}:queue-proxy" if name == "queue-proxy" else where
                used[part] += int(usage.read_text()) / 1e9
    run = Path(_cluster_env()["STATE"]) / "run"
    for name in ("kube-apiserver", "etcd"):
        try:
            used[f"host/{name}"] += process_cpu(int((run / f"{name}.pid").read_text()))
        except (OSError, ValueError):
            continue
    return dict(used)


def cpu_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        k: round(after[k] - before.get(k, 0.0), 3)
        for k in after
        if after[k] - before.get(k, 0.0) >= 0.005
    }


# --- spans ----------------------------------------------------------------------------


def _value(attribute: dict[str, Any]) -> Any:
    return next(iter(attribute.get("value", {}).values()), None)


def spans_with_times(
    query: str, services: tuple[str, ...], since: float, until: float
) -> list[dict[str, Any]]:
    """Every span of the traces these services started in [since, until], with its times
    (Jaeger answers whole traces, at most 1,000 a query: a phase queries the planner's
    before the deadline and the due path's after it)."""
    seen: dict[str, dict[str, Any]] = {}
    for service in services:
        for resource in jaeger_traces(query, service, since, until).get("resourceSpans", []):
            attributes = resource.get("resource", {}).get("attributes", [])
            name = next((_value(a) for a in attributes if a["key"] == "service.name"), "")
            for scope in resource.get("scopeSpans", []):
                for span in scope.get("spans", []):
                    seen[span["spanId"]] = {
                        "service": name,
                        "name": span["name"],
                        "id": span["spanId"],
                        "parent": span.get("parentSpanId", ""),
                        "start": int(span["startTimeUnixNano"]) / 1e9,
                        "end": int(span["endTimeUnixNano"]) / 1e9,
                        "attributes": {a["key"]: _value(a) for a in span.get("attributes", [])},
                    }
    return list(seen.values())


def hops(
    spans: list[dict[str, Any]], added: dict[str, float], deleted: dict[str, float],
    deadline: float,
) -> dict[str, Any]:  # fmt: skip
    by_id = {s["id"]: s for s in spans}
    decisions: dict[str, dict[str, Any]] = {}
    reapers: dict[str, dict[str, Any]] = {}
    dues: dict[str, dict[str, Any]] = {}
    for span in spans:
        uid = span["attributes"].get("lapse.run.uid")
        if span["name"] == "schedule kubernetes" and uid:
            first = decisions.get(uid)
            if first is None or span["start"] < first["start"]:
                decisions[uid] = span
        elif span["name"] == "object-reaper" and uid:
            reapers[uid] = span
        elif span["name"].startswith("process lapse.due.kubernetes."):
            subject = str(span["attributes"].get("messaging.destination.name", ""))
            dues[subject.rsplit(".", 1)[-1]] = span
    found: dict[str, list[float]] = defaultdict(list)
    for uid, added_at in added.items():
        decision = decisions.get(uid)
        planner = by_id.get(decision["parent"]) if decision else None
        if decision and planner:
            found["added_to_planner_s"].append(planner["start"] - added_at)
            found["planning_s"].append(decision["end"] - planner["start"])
        due, reaper = dues.get(uid), reapers.get(uid)
        if due:
            found["deadline_to_bridge_s"].append(due["start"] - deadline)
        request = by_id.get(reaper["parent"]) if reaper else None
        start = request["start"] if request else reaper["start"] if reaper else None
        if due and start is not None:
            found["bridge_to_reaper_s"].append(start - due["start"])
        if reaper and start is not None:
            found["reaper_s"].append(reaper["end"] - start)
            if uid in deleted:
                found["reaper_to_watch_s"].append(deleted[uid] - reaper["end"])
    return {name: percentiles(found[name]) for name, _ in HOPS}


# --- one burst -------------------------------------------------------------------------


def burst(
    cluster: Cluster, namespace: str, count: int, ttl: int, *, jaeger: str | None,
    timeout: float = 600,
) -> dict[str, Any]:  # fmt: skip
    """`count` Workflows finished in the same second, due `ttl` s later; watched to the end."""
    batch = uuid.uuid4().hex[:6]
    watch = DeletionWatch(cluster, namespace, selector=f"lapse-bench={batch}")
    time.sleep(1)  # the watch is established
    finished_at = datetime.now(UTC).replace(microsecond=0)
    deadline = (finished_at + timedelta(seconds=ttl)).timestamp()
    items = [
        finished_workflow(f"kb-{batch}-{i:05d}", finished_at, f"{ttl}s",
                          labels={"lapse-bench": batch})
        for i in range(count)
    ]  # fmt: skip
    since = time.time()
    created = json_objects(
        cluster.kubectl(
            "-n", namespace, "create", "-o", "json", "-f", "-",
            stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
        )
    )  # fmt: skip
    written_s = time.time() - since
    uids = {
        o["metadata"]["uid"]
        for c in created
        for o in (c.get("items", [c]) if c.get("kind") == "List" else [c])
    }
    assert len(uids) == count, f"{len(uids)} of {count} Workflows created"
    try:
        poll(
            f"{count} Workflows deleted",
            lambda: uids <= set(watch.deleted()),
            timeout=max(deadline - time.time(), 0) + timeout,
            interval=0.5,
        )
    finally:
        watch.stop()
    deleted = {u: t for u, t in watch.deleted().items() if u in uids}
    added = {u: t for t, kind, u in watch.events if kind == "ADDED" and u in uids}
    times = sorted(deleted.values())
    late = [deleted[u] - deadline for u in uids]
    result: dict[str, Any] = {
        "objects": count,
        "ttl_s": ttl,
        "written_in_s": round(written_s, 2),
        "deleted": len(deleted),
        "early": sum(1 for x in late if x < 0),
        "lateness_s": percentiles(late),
        "deletions_per_s": round((count - 1) / (times[-1] - times[0]), 1)
        if len(times) > 1 and times[-1] > times[0]
        else None,
        "last_deleted_after_deadline_s": round(times[-1] - deadline, 3),
    }
    if jaeger:
        # Spans are exported in batches every half second (OTEL_BSP_SCHEDULE_DELAY): wait
        # until the reapers' spans are in, or give up after a minute and report what came.
        def due_spans() -> list[dict[str, Any]]:
            return spans_with_times(jaeger, SERVICES[1:], deadline - 1, time.time() + 60)

        def reaper_spans() -> list[dict[str, Any]] | None:
            spans = due_spans()
            done = sum(1 for s in spans if s["name"] == "object-reaper"
                       and s["attributes"].get("lapse.run.uid") in uids)  # fmt: skip
            return spans if done >= count else None

        try:
            spans = poll("the reapers' spans in Jaeger", reaper_spans, timeout=60, interval=3)
        except AssertionError:
            spans = due_spans()
        spans += spans_with_times(jaeger, SERVICES[:1], since - 5, deadline)
        result["hops"] = hops(spans, added, deleted, deadline)
    return result


# --- the object-reaper's scale ----------------------------------------------------------


def scale_reaper(cluster: Cluster, replicas: int, cpu: str) -> None:
    """min-scale = max-scale = replicas, each pod's function limited to `cpu` (a small
    request, so four fit beside Knative on two cores); waits for that many Ready pods of
    the new revision."""
    annotations = "/spec/template/metadata/annotations"
    patch = [
        {"op": "add", "path": f"{annotations}/autoscaling.knative.dev~1min-scale",
         "value": str(replicas)},
        {"op": "add", "path": f"{annotations}/autoscaling.knative.dev~1max-scale",
         "value": str(replicas)},
        {"op": "add", "path": f"{annotations}/autoscaling.knative.dev~1initial-scale",
         "value": str(replicas)},
        {"op": "add", "path": "/spec/template/spec/containers/0/resources",
         "value": {"limits": {"cpu": cpu}, "requests": {"cpu": "10m"}}},
    ]  # fmt: skip
    cluster.kubectl("-n", SYSTEM, "patch", "ksvc", REAPER, "--type", "json", "-p",
                    json.dumps(patch))  # fmt: skip

    def ready_pods() -> bool:
        service = cluster.get(SYSTEM, f"ksvc/{REAPER}")
        status = service.get("status", {})
        revision = status.get("latestCreatedRevisionName")
        if not revision or status.get("latestReadyRevisionName") != revision:
            return False
        pods = json.loads(cluster.kubectl(
            "-n", SYSTEM, "get", "pods", "-l", f"serving.knative.dev/revision={revision}",
            "-o", "json"))["items"]  # fmt: skip
        live = [p for p in pods if "deletionTimestamp" not in p["metadata"]]
        ready = [
            p
            for p in live
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p.get("status", {}).get("conditions", [])
            )
        ]
        others = json.loads(cluster.kubectl(
            "-n", SYSTEM, "get", "pods", "-l", f"serving.knative.dev/service={REAPER}",
            "-o", "json"))["items"]  # fmt: skip
        old = [p for p in others if p["metadata"]["labels"].get(
            "serving.knative.dev/revision") != revision]  # fmt: skip
        return len(ready) == replicas == len(live) and not old

    poll(f"{replicas} {REAPER} pods Ready", ready_pods, timeout=300, interval=2)


# --- lapse up on the host ----------------------------------------------------------------


@contextmanager
def lapse_up(cluster: Cluster, work: Path) -> Iterator[subprocess.Popen[bytes]]:
    config = work / "lapse.yaml"
    config.write_text(
        f"kubernetes: {{kubeconfig: '{cluster.kubeconfig}', qps: 100000, burst: 100000}}\n"
        "safety:\n"
        f"  namespaces: {{include: ['{UP_NAMESPACE}']}}\n"
        "  max_deletions_per_second: 1000000\n"
        "  mass_deletion_brake: {enabled: false}\n"
    )
    log = work / "lapse-up.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "lapse.cli", "--config", str(config), "up",
             "--state-dir", str(work / "state"), "--listen", ""],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "OTEL_SDK_DISABLED": "true"},
        )  # fmt: skip
    try:
        poll("lapse up running", lambda: b"lapse is running" in log.read_bytes()
             or process.poll() is not None, timeout=120, interval=0.5)  # fmt: skip
        assert process.poll() is None, log.read_text()[-3000:]
        yield process
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def process_cpu(pid: int) -> float:
    """CPU seconds a host process has used so far."""
    return report.cpu_seconds(Path(f"/proc/{pid}/stat").read_text(), os.sysconf("SC_CLK_TCK"))


# --- the run -------------------------------------------------------------------------


def phase(
    cluster: Cluster, namespace: str, count: int, ttl: int, jaeger: str | None,
    up_pid: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    before = cpu_seconds(cluster)
    up_before = process_cpu(up_pid) if up_pid else 0.0
    result = burst(cluster, namespace, count, ttl, jaeger=jaeger)
    used = cpu_between(before, cpu_seconds(cluster))
    if up_pid:
        used["host/lapse-up"] = round(process_cpu(up_pid) - up_before, 3)
    result["cpu_s"] = dict(sorted(used.items(), key=lambda kv: -kv[1]))
    result["cpu_ms_per_deletion"] = {k: round(v * 1000 / count, 2) for k, v in used.items()}
    return result


def print_phase(name: str, result: dict[str, Any]) -> None:
    late = result["lateness_s"]
    print(
        f"{name}: {result['deleted']}/{result['objects']} deleted, {result['early']} early; "
        f"{result['deletions_per_s']}/s; lateness p50 {late['p50']} s, p99 {late['p99']} s, "
        f"max {late['max']} s", flush=True,
    )  # fmt: skip
    hops = result.get("hops", {})
    for hop, what in HOPS:
        got = hops.get(hop)
        if got and got["n"]:
            print(f"    {what}: p50 {got['p50']} s, p99 {got['p99']} s (n {got['n']})")
    if hops and not any(got["n"] for got in hops.values()):
        # Empty hops would read as a phase with no delay anywhere.
        print("    where the time goes: none of this phase's spans were found in Jaeger")
    top = list(result["cpu_ms_per_deletion"].items())
    top.sort(key=lambda kv: -kv[1])
    print("    CPU ms per deletion: " + ", ".join(f"{k} {v}" for k, v in top[:10]), flush=True)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    env = _cluster_env()
    cluster = Cluster(
        env["KUBECTL"], env["KUBECONFIG"], env["PYTHON_IMAGE"], env["NODE_IP"],
        env["CONTAINERD_SOCK"], env.get("NETWORK_POLICY", "none"),
    )  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="lapse-bench-knative-"))
    (work / "overlay").mkdir()
    results: dict[str, Any] = {
        "versions": versions(cluster),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "burst": args.burst, "ttl_s": args.ttl, "reaper_cpu_limit": args.cpu,
    }  # fmt: skip
    async with scratch_database("postgresql") as database:
        _, relay = await asyncio.to_thread(
            deploy, cluster, work / "overlay", database, POSTGRES_ADMIN_URL,
            config=bench_config(),
        )  # fmt: skip
        try:
            jaeger_ip = cluster.get(OBSERVABILITY, "service/jaeger")["spec"]["clusterIP"]
            jaeger = f"{jaeger_ip}:{JAEGER_QUERY_PORT}"
            # The planner stays up (its cold start would be in every first plan).
            cluster.kubectl("-n", SYSTEM, "patch", "ksvc", "lapse-ttl-planner", "--type",
                            "json", "-p", json.dumps([{"op": "add", "path":
                            "/spec/template/metadata/annotations/autoscaling.knative.dev~1min-scale",
                            "value": "1"}]))  # fmt: skip
            kubectl_waiting(cluster, "-n", SYSTEM, "wait", "ksvc/lapse-ttl-planner",
                            "--for=condition=Ready", timeout=300)  # fmt: skip
            # A first small burst wakes everything (not reported).
            await asyncio.to_thread(burst, cluster, RUNS, 5, args.ttl, jaeger=None)
            for replicas in args.replicas:
                name = f"knative_reaper_{replicas}"
                try:
                    await asyncio.to_thread(scale_reaper, cluster, replicas, args.cpu)
                    results[name] = await asyncio.to_thread(
                        phase, cluster, RUNS, args.burst, args.ttl, jaeger
                    )
                except AssertionError as exc:  # a phase that timed out: said, and the next
                    results[name] = {"error": str(exc)[:2000]}
                    print(f"{name}: {exc}", flush=True)
                    continue
                print_phase(f"Knative, object-reaper x{replicas} ({args.cpu} each)",
                            results[name])  # fmt: skip
                save(args.out, results)
            rates = {n: results[f"knative_reaper_{n}"].get("deletions_per_s")
                     for n in args.replicas}  # fmt: skip
            if rates.get(1):
                results["knative_scale_out"] = {
                    str(n): round(rate / rates[1], 2) for n, rate in rates.items() if rate
                }
            if not args.skip_up:
                cluster.kubectl("create", "namespace", UP_NAMESPACE, check=False)
                with lapse_up(cluster, work) as process:
                    await asyncio.to_thread(burst, cluster, UP_NAMESPACE, 5, args.ttl,
                                            jaeger=None)  # fmt: skip
                    results["lapse_up"] = await asyncio.to_thread(
                        phase, cluster, UP_NAMESPACE, args.burst, args.ttl, None, process.pid
                    )
                print_phase("lapse up on the host (same API server)", results["lapse_up"])
        finally:
            relay.stop()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst", type=int, default=400, help="Workflows a phase (400)")
    parser.add_argument("--ttl", type=int, default=45,
                        help="their TTL, s: all planned before the deadline (45)")  # fmt: skip
    parser.add_argument("--replicas", default="1,2,4",
                        help="object-reaper replicas, one phase each (1,2,4)")  # fmt: skip
    parser.add_argument("--cpu", default="250m", help="each reaper pod's CPU limit (250m)")
    parser.add_argument("--skip-up", action="store_true", help="no `lapse up` phase")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.replicas = [int(n) for n in args.replicas.split(",")]
    results = asyncio.run(run(args))
    save(args.out, results)
    print(f"written {args.out}")
    return 0


def save(path: Path, results: dict[str, Any]) -> None:
    """Written after every phase, so a later phase's failure keeps the earlier figures."""
    results["when"] = datetime.now(UTC).isoformat(timespec="seconds")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
