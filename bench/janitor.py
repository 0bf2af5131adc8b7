"""A sweeper in the style of kube-janitor, written here for the comparison benchmark.

    python bench/janitor.py --kubeconfig PATH --namespace NS [--interval 5] [--no-events]

Every `--interval` seconds after the previous sweep ended: LIST every Workflow in the
namespace (pages of `--page-size`), and for each one whose deadline has passed, DELETE it
(by name, no preconditions) and, like kube-janitor, record a Kubernetes Event saying so.
One object at a time, nothing remembered between sweeps.

The deadline is Argo's: `status.finishedAt` + `spec.ttlStrategy` (secondsAfterFailure for
Failed, secondsAfterSuccess for Succeeded, else secondsAfterCompletion), so it deletes the
same objects at the same deadlines as the other tools. (kube-janitor itself reads a
`janitor/ttl` annotation counted from creation.) It stops by itself after `--max-seconds`.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

GROUP_PATH = "/apis/argoproj.io/v1alpha1"
FAILED_PHASES = ("Failed", "Error")


def deadline(workflow: dict[str, Any]) -> float | None:
    """When a finished Workflow is due (epoch seconds), or None: not finished, no TTL."""
    labels = workflow.get("metadata", {}).get("labels") or {}
    status = workflow.get("status") or {}
    finished = status.get("finishedAt")
    if labels.get("workflows.argoproj.io/completed") != "true" or not finished:
        return None
    strategy = (workflow.get("spec") or {}).get("ttlStrategy") or {}
    phase = status.get("phase")
    seconds = None
    if phase in FAILED_PHASES and strategy.get("secondsAfterFailure") is not None:
        seconds = strategy["secondsAfterFailure"]
    elif phase == "Succeeded" and strategy.get("secondsAfterSuccess") is not None:
        seconds = strategy["secondsAfterSuccess"]
    elif strategy.get("secondsAfterCompletion") is not None:
        seconds = strategy["secondsAfterCompletion"]
    if seconds is None:
        return None
    at = datetime.fromisoformat(str(finished).replace("Z", "+00:00")).timestamp()
    return at + float(seconds)


def expired(workflow: dict[str, Any], now: float) -> bool:
    """The sweeper's whole decision: past its deadline (and not already being deleted)."""
    if (workflow.get("metadata") or {}).get("deletionTimestamp"):
        return False
    due = deadline(workflow)
    return due is not None and now >= due


def client_from_kubeconfig(path: Path) -> httpx.Client:
    """An HTTP client for the kubeconfig's current context (server, CA, bearer token)."""
    config = yaml.safe_load(path.read_text())
    context = next(c for c in config["contexts"] if c["name"] == config["current-context"])
    cluster = next(c for c in config["clusters"] if c["name"] == context["context"]["cluster"])
    user = next(u for u in config["users"] if u["name"] == context["context"]["user"])
    return httpx.Client(
        base_url=cluster["cluster"]["server"],
        verify=cluster["cluster"]["certificate-authority"],
        headers={
            "Authorization": f"Bearer {user['user']['token']}",
            "User-Agent": "bench-janitor",
        },
        timeout=60,
    )


def event_for(workflow: dict[str, Any], namespace: str) -> dict[str, Any]:
    meta = workflow["metadata"]
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": namespace},
        "involvedObject": {
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "Workflow",
            "name": meta["name"],
            "namespace": namespace,
            "uid": meta.get("uid"),
        },
        "reason": "TimeToLiveExpired",
        "message": "Workflow was deleted: its TTL expired",
        "type": "Normal",
        "source": {"component": "bench-janitor"},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


READY = "janitor: working"  # the benchmark's ready marker: its first LIST page was answered


def sweep(
    api: httpx.Client,
    namespace: str,
    page_size: int,
    events: bool,
    answered: Callable[[], object] = lambda: None,
) -> tuple[int, int]:
    """One full pass: (objects listed, objects deleted). `answered` after each page."""
    listed = deleted = 0
    token: str | None = None
    while True:
        params: dict[str, str | int] = {"limit": page_size}
        if token:
            params["continue"] = token
        page = api.get(f"{GROUP_PATH}/namespaces/{namespace}/workflows", params=params)
        if page.status_code == 410 and token:
            # A sweep of 100,000 objects, deleting one at a time, outlives the API server's
            # compaction of the list's snapshot (5 minutes): its continue token expires. The
            # list starts over (client-go's pager falls back to a full list the same way);
            # what this sweep deleted is no longer listed.
            print("janitor: the list's continue token expired (410); listing again", flush=True)
            token = None
            continue
        page.raise_for_status()
        answered()
        body = page.json()
        for workflow in body.get("items", []):
            listed += 1
            if not expired(workflow, time.time()):
                continue
            name = workflow["metadata"]["name"]
            gone = api.delete(f"{GROUP_PATH}/namespaces/{namespace}/workflows/{name}")
            if gone.status_code == 404:
                continue
            gone.raise_for_status()
            deleted += 1
            if events:
                event = event_for(workflow, namespace)
                api.post(f"/api/v1/namespaces/{namespace}/events", json=event)
        token = body.get("metadata", {}).get("continue")
        if not token:
            return listed, deleted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between sweeps")
    parser.add_argument("--page-size", type=int, default=500)
    parser.add_argument("--no-events", dest="events", action="store_false")
    parser.add_argument("--max-seconds", type=float, default=3600, help="stop after this long")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    api = client_from_kubeconfig(args.kubeconfig)
    stop_at = time.monotonic() + args.max_seconds
    ready = functools.cache(lambda: print(READY, flush=True))  # said once
    print(f"janitor: sweeping {args.namespace} every {args.interval:g}s", flush=True)
    while time.monotonic() < stop_at:
        started = time.monotonic()
        try:
            listed, deleted = sweep(api, args.namespace, args.page_size, args.events, ready)
            took = time.monotonic() - started
            print(f"janitor: listed {listed}, deleted {deleted} in {took:.2f}s", flush=True)
        except httpx.HTTPError as exc:
            print(f"janitor: sweep failed: {exc}", flush=True)
        time.sleep(args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
