"""lapse deployed on the real cluster as docs/deploy.md says, and its due path proven there
(issue 17): lapse's images pushed to the cluster's registry, the run CRDs, the Secrets the
docs ask for, `kubectl apply -k infra/overlays/dev` (its NATS included), everything Ready;
then a Workflow written finished is deleted at its deadline, not before, through
ApiServerSource -> Broker -> ttl-planner -> NATS message schedule -> lapse-bridge ->
Broker -> object-reaper, and a reaper scaled to zero wakes for a due event.

The overlay is applied through a kustomization made in a temporary folder: the dev overlay
as its only resource, an `images:` list naming the pushed images, and one test setting
(the object-reaper's autoscaling window, so it scales to zero within a minute). Run by
`make test-cluster`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from lapse.embedded.kube import run_kind_crds
from tests.cluster.conftest import REPO, Cluster, poll

DEV_OVERLAY = REPO / "infra/overlays/dev"
SYSTEM = "lapse-system"
RUNS = "default"  # the namespace the dev overlay cleans
# Everything the install waits for after `kubectl apply` shares this budget (image pulls,
# Knative reconciling, NATS and the functions starting).
INSTALL_TIMEOUT = 360.0
REAPER = "lapse-object-reaper"
# The object-reaper's autoscaling window in this test (Knative's default is 60 s), so the
# scaled-to-zero case does not wait minutes.
REAPER_WINDOW = "6s"


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def finished_workflow(name: str, finished_at: datetime, ttl: str) -> dict[str, Any]:
    """A Workflow as Argo's controller leaves a finished one (no controller runs here)."""
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "labels": {"workflows.argoproj.io/completed": "true"},
            "annotations": {"lapse.dev/ttl": ttl},
        },
        "spec": {"entrypoint": "main", "templates": [{"name": "main", "container": {
            "image": "busybox", "command": ["true"]}}]},
        "status": {
            "phase": "Succeeded",
            "startedAt": rfc3339(finished_at - timedelta(seconds=3)),
            "finishedAt": rfc3339(finished_at),
        },
    }  # fmt: skip


class DeletionWatch:
    """`kubectl get --watch` on one Workflow, started before it is created: records when
    each watch event arrived (host clock = node clock, one machine)."""

    def __init__(self, cluster: Cluster, namespace: str, name: str) -> None:
        self.events: list[tuple[float, str, str]] = []  # (time.time(), type, uid)
        self._process = subprocess.Popen(
            [
                cluster.kubectl_bin, "--kubeconfig", cluster.kubeconfig, "-n", namespace,
                "get", "workflows.argoproj.io", "--field-selector", f"metadata.name={name}",
                "--watch", "--output-watch-events", "-o", "json",
            ],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        decoder = json.JSONDecoder()
        buffer = ""
        for line in self._process.stdout:
            buffer += line
            while buffer.strip():
                try:
                    event, end = decoder.raw_decode(buffer.lstrip())
                except json.JSONDecodeError:
                    break  # an object not complete yet
                buffer = buffer.lstrip()[end:]
                uid = event.get("object", {}).get("metadata", {}).get("uid", "")
                self.events.append((time.time(), event.get("type", ""), uid))

    def added(self, timeout: float = 30) -> None:
        poll("the watch saw the Workflow added", lambda: self._seen("ADDED"), timeout, 0.1)

    def deleted_at(self, uid: str, timeout: float) -> float:
        found = poll(
            "the Workflow deleted",
            lambda: next((t for t, kind, u in self.events if kind == "DELETED" and u == uid), 0),
            timeout,
            0.05,
        )
        return float(found)

    def _seen(self, kind: str) -> bool:
        return any(k == kind for _, k, _ in self.events)

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=10)


@dataclass
class Deployment:
    cluster: Cluster
    images: dict[str, str]
    timings: dict[str, float] = field(default_factory=dict)

    def pods(self, service: str) -> list[dict[str, Any]]:
        selector = f"serving.knative.dev/service={service}"
        out = self.cluster.kubectl("-n", SYSTEM, "get", "pods", "-l", selector, "-o", "json")
        items: list[dict[str, Any]] = json.loads(out)["items"]
        return [p for p in items if "deletionTimestamp" not in p["metadata"]]

    def diagnosis(self) -> str:
        """What an engineer looks at first when the chain breaks (in failure messages)."""
        k = self.cluster.kubectl
        parts = [
            k("-n", SYSTEM, "get", "pods,deploy,job,ksvc,broker,trigger,apiserversource,"
              "sinkbinding", "-o", "wide", check=False),
            k("-n", SYSTEM, "get", "events", "--sort-by=.lastTimestamp", check=False)[-3000:],
        ]  # fmt: skip
        for selector, container in (
            ("serving.knative.dev/service=lapse-ttl-planner", "function"),
            (f"serving.knative.dev/service={REAPER}", "function"),
            ("app.kubernetes.io/name=lapse-bridge", "bridge"),
        ):
            logs = k("-n", SYSTEM, "logs", "-l", selector, "-c", container, "--tail=25",
                     check=False)  # fmt: skip
            parts.append(f"--- logs {selector}\n{logs}")
        return "\n".join(parts)


def kubectl_waiting(cluster: Cluster, *args: str, timeout: float) -> None:
    """`kubectl wait` or `rollout status` given `timeout` (Cluster.kubectl stops at 120 s)."""
    command = [cluster.kubectl_bin, "--kubeconfig", cluster.kubeconfig, *args]
    result = subprocess.run(
        [*command, f"--timeout={int(timeout)}s"],
        capture_output=True,
        text=True,
        timeout=timeout + 30,
    )
    if result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")


def kubectl_apply_retrying(cluster: Cluster, *args: str, stdin: str | None = None) -> None:
    """Knative's webhooks refuse objects for a moment after they start: retry a little."""
    for attempt in range(8):
        try:
            cluster.kubectl("apply", *args, stdin=stdin)
            return
        except AssertionError:
            if attempt == 7:
                raise
            time.sleep(5)


def push_images() -> dict[str, str]:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/cluster/push-lapse-images.py")],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, f"push-lapse-images.py: {result.stderr[-3000:]}"
    images: dict[str, str] = json.loads(result.stdout)
    return images


def overlay_for(folder: Path, images: dict[str, str]) -> Path:
    """The dev overlay with the pushed images and the test's reaper window."""
    window_patch = [
        {
            "op": "add",
            "path": "/spec/template/metadata/annotations/autoscaling.knative.dev~1window",
            "value": REAPER_WINDOW,
        }
    ]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        # kustomize takes no absolute path: the dev overlay relative to this folder
        "resources": [os.path.relpath(DEV_OVERLAY, folder)],
        "images": [
            {"name": name, "newName": ref.rsplit(":", 1)[0], "newTag": ref.rsplit(":", 1)[1]}
            for name, ref in sorted(images.items())
        ],
        "patches": [
            {
                "target": {"group": "serving.knative.dev", "kind": "Service", "name": REAPER},
                "patch": json.dumps(window_patch),
            }
        ],
    }
    (folder / "kustomization.yaml").write_text(json.dumps(kustomization, indent=2))
    return folder


@pytest.fixture(scope="module")
def lapse(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    started = time.monotonic()
    images = push_images()
    deployment = Deployment(cluster, images)
    deployment.timings["images"] = time.monotonic() - started
    names = ("lapse", "ttl-planner", "object-reaper", "row-reaper")
    assert set(images) == {f"dev.local/lapse/{n}" for n in names}, images

    # The run CRDs the ApiServerSource watches (Argo's Workflow is the one this test uses).
    crds = {"apiVersion": "v1", "kind": "List", "items": run_kind_crds()}
    cluster.kubectl("apply", "--server-side", "-f", "-", stdin=json.dumps(crds))
    for crd in crds["items"]:
        name = crd["metadata"]["name"]
        cluster.kubectl("wait", f"crd/{name}", "--for=condition=Established", "--timeout=60s")

    # The Secret docs/deploy.md asks users to create (a throwaway value: the dev overlay
    # enables no database target, so nothing connects with it). lapse-nats is optional and
    # the dev NATS asks for no password.
    # (Applied, not created: a second run on the same cluster finds them.)
    secret = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SYSTEM}},
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "lapse-database", "namespace": SYSTEM},
                "stringData": {"url": "mysql://lapse:throwaway@mysql.invalid:3306/mlpipeline"},
            },
        ],
    }
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(secret))

    overlay = overlay_for(tmp_path_factory.mktemp("overlay"), images)
    rendered = cluster.kubectl("kustomize", str(overlay))
    for name, ref in images.items():
        assert name not in rendered.replace(ref, ""), f"{name} left in the rendered overlay"
    kubectl_apply_retrying(cluster, "-k", str(overlay))
    deployment.timings["applied"] = time.monotonic() - started

    until = time.monotonic() + INSTALL_TIMEOUT

    def left() -> float:
        return max(until - time.monotonic(), 5)

    try:
        kubectl_waiting(
            cluster,
            "-n",
            SYSTEM,
            "wait",
            "job/lapse-streams",
            "--for=condition=Complete",
            timeout=left(),
        )
        for ready in ("broker/lapse", "sinkbinding/lapse-bridge", "ksvc/lapse-ttl-planner",
                      f"ksvc/{REAPER}", "trigger/ttl-planner-apiserver-add",
                      "trigger/ttl-planner-apiserver-update", "trigger/object-reaper-due",
                      "apiserversource/lapse-workflows"):  # fmt: skip
            cluster.wait_ready(SYSTEM, ready, timeout=left())
        # After the SinkBinding gave the bridge its K_SINK (a new rollout), every
        # Deployment available.
        for name in ("nats", "lapse-bridge", "lapse-dlq-sink"):
            kubectl_waiting(
                cluster, "-n", SYSTEM, "rollout", "status", f"deploy/{name}", timeout=left()
            )
        bridge = cluster.get(SYSTEM, "deploy/lapse-bridge")["spec"]["template"]["spec"]
        assert any(e["name"] == "K_SINK" for e in bridge["containers"][0].get("env", [])), bridge
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{deployment.diagnosis()}") from None
    deployment.timings["ready"] = time.monotonic() - started
    print(
        "\nlapse deployed: images pushed in {images:.0f} s, applied at {applied:.0f} s, "
        "everything Ready at {ready:.0f} s".format(**deployment.timings)
    )
    yield deployment


@dataclass
class Written:
    """A finished Workflow written with `lapse.dev/ttl`, watched until it is deleted."""

    deployment: Deployment
    ttl_seconds: int
    prefix: str
    name: str = ""
    uid: str = ""
    deadline: float = 0.0
    created_at: float = 0.0
    deleted_at: float = 0.0
    reaper_pods_at_deadline: int = -1
    watch: DeletionWatch | None = None

    def write(self) -> Written:
        cluster = self.deployment.cluster
        self.name = f"{self.prefix}-{uuid.uuid4().hex[:8]}"
        self.watch = DeletionWatch(cluster, RUNS, self.name)
        time.sleep(1)  # the watch is established (its first list comes back empty)
        finished_at = datetime.now(UTC).replace(microsecond=0)
        workflow = finished_workflow(self.name, finished_at, f"{self.ttl_seconds}s")
        created = json.loads(
            cluster.kubectl(
                "-n", RUNS, "create", "-o", "json", "-f", "-", stdin=json.dumps(workflow)
            )
        )
        self.created_at = time.time()
        self.uid = created["metadata"]["uid"]
        self.deadline = (finished_at + timedelta(seconds=self.ttl_seconds)).timestamp()
        self.watch.added()
        return self

    @property
    def lateness(self) -> float:
        return self.deleted_at - self.deadline

    def deleted(self) -> Written:
        """Wait for the deletion; fails if it comes before the deadline or never."""
        assert self.watch is not None
        try:
            # Until the deadline the Workflow must stay; look at the reaper just before it.
            while time.time() < self.deadline - 1.5:
                assert not any(k == "DELETED" for _, k, _ in self.watch.events), (
                    f"{self.name} deleted {self.deadline - time.time():.1f} s before its deadline"
                )
                time.sleep(0.2)
            self.reaper_pods_at_deadline = len(self.deployment.pods(REAPER))
            try:
                self.deleted_at = self.watch.deleted_at(
                    self.uid, timeout=max(self.deadline - time.time(), 0) + 120
                )
            except AssertionError as exc:
                still = self.deployment.cluster.kubectl(
                    "-n", RUNS, "get", "workflow", self.name, "--ignore-not-found", "-o", "name",
                    check=False,
                )  # fmt: skip
                when = rfc3339(datetime.fromtimestamp(self.deadline, UTC))
                raise AssertionError(
                    f"{exc}: {self.name} (uid {self.uid}, deadline {when})"
                    f" {'still exists' if still else 'is gone, but no DELETED event was seen'}\n"
                    f"{self.deployment.diagnosis()}"
                ) from None
        finally:
            self.watch.stop()
        assert self.lateness >= 0, f"{self.name} deleted {-self.lateness:.2f} s before its deadline"
        return self


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
