"""`lapse history` and `lapse status` against a real NATS server: formats, filters by
namespace, kind and target, and --watch redrawing until Ctrl-C."""

from __future__ import annotations

import json
import re
import select
import signal
import subprocess
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import yaml
from nats.js import JetStreamContext

from lapse.cli.watch import CLEAR
from lapse.config import Streams
from lapse.edges import health
from lapse.edges.publishing import NatsEmitter
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import build_event
from lapse.events.models import CleanupCompleted
from lapse.events.run import Engine, RunRef, Target
from lapse.events.types import EventType, Outcome
from lapse.functions.artifact_reaper.handler import Tally, describe
from tests.cli.conftest import Shell

pytestmark = [pytest.mark.nats]

KINDS = {
    "Workflow": (Engine.ARGO, "argoproj.io/v1alpha1"),
    "Job": (Engine.JOB, "batch/v1"),
}


async def record(
    js: JetStreamContext,
    namespace: str,
    name: str,
    kind: str,
    target: Target,
    outcome: Outcome = Outcome.DELETED,
    detail: str | None = None,
) -> None:
    """One cleanup outcome on the audit stream, as a reaper emits it."""
    engine, api_version = KINDS[kind]
    run = RunRef(
        engine=engine,
        api_version=api_version,
        kind=kind,
        namespace=namespace,
        name=name,
        uid=str(uuid.uuid4()),
        phase="Succeeded",
    )
    now = datetime.now(UTC)
    completed = CleanupCompleted.of(
        run=run,
        target=target,
        outcome=outcome,
        completed_at=now,
        deadline=now - timedelta(seconds=1),
        detail=detail,
        dry_run=outcome is Outcome.DRY_RUN,
    )
    event = build_event(EventType.CLEANUP_COMPLETED, source="/test", data=completed, target=target)
    await NatsEmitter(js, Streams()).emit(event)


async def some_history(js: JetStreamContext) -> tuple[str, str]:
    a, b = f"hist-a-{uuid.uuid4().hex[:6]}", f"hist-b-{uuid.uuid4().hex[:6]}"
    await record(js, a, "train", "Workflow", Target.KUBERNETES)
    await record(js, a, "train", "Workflow", Target.DATABASE)
    await record(js, a, "nightly", "Job", Target.KUBERNETES)
    await record(js, b, "other", "Workflow", Target.KUBERNETES)
    return a, b


def _json(shell: Shell, nats: EmbeddedNats, *args: str) -> object:
    result = shell(*args, "--nats-url", nats.url, "-o", "json")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    # history's is a kubectl List (its items here); status's a report
    return found["items"] if found.get("kind") == "List" else found


async def test_history_filters_and_formats(
    shell: Shell, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    a, b = await some_history(lapse_streams)
    rows = _json(shell, nats_server, "history", "-A")
    assert isinstance(rows, list)
    assert {(r["namespace"], r["name"], r["target"]) for r in rows} == {
        (a, "train", "kubernetes"),
        (a, "train", "database"),
        (a, "nightly", "kubernetes"),
        (b, "other", "kubernetes"),
    }
    in_a = _json(shell, nats_server, "history", "-n", a)
    assert {r["namespace"] for r in in_a} == {a} and len(in_a) == 3  # type: ignore[union-attr]
    jobs = _json(shell, nats_server, "history", "--kind", "job")
    assert [(r["name"], r["kind"]) for r in jobs] == [("nightly", "Job")]  # type: ignore[union-attr]
    rows_only = _json(shell, nats_server, "history", "-n", a, "--target", "database")
    assert [(r["name"], r["target"]) for r in rows_only] == [("train", "database")]  # type: ignore[union-attr]

    as_yaml = shell("history", "-n", a, "--nats-url", nats_server.url, "-o", "yaml")
    assert yaml.safe_load(as_yaml.stdout) == {"apiVersion": "v1", "kind": "List", "items": in_a}
    url = ("--nats-url", nats_server.url)
    by_path = shell("history", "-n", a, *url, "-o", "jsonpath={.items[*].name}")
    assert by_path.stdout.split(" ") == [r["name"] for r in in_a]  # type: ignore[index]
    columns = shell("history", "-n", a, *url, "--no-headers", "-o", "custom-columns=N:.name")
    assert columns.stdout.split() == [r["name"] for r in in_a]  # type: ignore[index]
    names = shell("history", "-n", a, "--kind", "Job", "--nats-url", nats_server.url, "-o", "name")
    assert names.stdout.split() == ["job.batch/nightly"]
    table = shell("history", "-n", a, "--nats-url", nats_server.url).stdout.splitlines()
    assert table[0].split()[:3] == ["TIME", "NAMESPACE", "NAME"] and len(table) == 4
    bare = shell("history", "-n", a, "--no-headers", "--nats-url", nats_server.url)
    assert len(bare.stdout.splitlines()) == 3 and "NAMESPACE" not in bare.stdout


async def test_history_shows_the_bytes_the_artifact_reaper_freed_and_their_total(
    shell: Shell, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    ns = f"hist-art-{uuid.uuid4().hex[:6]}"
    # The details as the artifact reaper writes them (its own `describe`).
    two = describe(Tally(objects=2, bytes=1536))
    big = describe(Tally(objects=3, bytes=3 * 1024 * 1024))
    dry = describe(Tally(objects=9, bytes=999), dry_run=True)
    await record(lapse_streams, ns, "a", "Workflow", Target.ARTIFACTS, detail=two)
    await record(lapse_streams, ns, "b", "Workflow", Target.ARTIFACTS, detail=big)
    await record(lapse_streams, ns, "c", "Workflow", Target.ARTIFACTS, Outcome.DRY_RUN, dry)
    await record(lapse_streams, ns, "a", "Workflow", Target.KUBERNETES)
    rows = _json(shell, nats_server, "history", "-n", ns)
    assert isinstance(rows, list)
    freed = {(r["name"], r["target"]): (r["objectsDeleted"], r["bytesFreed"]) for r in rows}
    assert freed == {
        ("a", "artifacts"): (2, 1536),
        ("b", "artifacts"): (3, 3 * 1024 * 1024),
        ("c", "artifacts"): (None, None),  # a dry run frees nothing
        ("a", "kubernetes"): (None, None),  # an object's size is not recorded
    }
    table = shell("history", "-n", ns, "--nats-url", nats_server.url).stdout.splitlines()
    header = table[0].split()
    assert "FREED" in header
    cells = {tuple(line.split()[2:4]): line for line in table[1:5]}
    assert "1.5 KiB" in cells[("a", "artifacts")] and "3.0 MiB" in cells[("b", "artifacts")]
    assert "KiB" not in cells[("a", "kubernetes")] + cells[("c", "artifacts")]
    assert table[5] == (
        f"freed in total: 3.0 MiB ({3 * 1024 * 1024 + 1536} bytes) in 5 objects, "
        "artifacts of 2 runs"
    )
    assert len(table) == 6
    # Without headers the table is rows alone, and json stays a list of rows.
    bare = shell("history", "-n", ns, "--no-headers", "--nats-url", nats_server.url).stdout
    assert len(bare.splitlines()) == 4 and "in total" not in bare
    only = _json(shell, nats_server, "history", "-n", ns, "--target", "kubernetes")
    assert isinstance(only, list) and len(only) == 1
    none = shell("history", "-n", ns, "--target", "kubernetes", "--nats-url", nats_server.url)
    assert "in total" not in none.stdout


async def test_status_filters_and_formats(
    shell: Shell, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    await some_history(lapse_streams)
    report = _json(shell, nats_server, "status", "--target", "kubernetes", "--kind", "Workflow")
    assert isinstance(report, dict)
    assert set(report["pending"]) == {"kubernetes"}
    assert report["nats"] == {"url": nats_server.url, "from": "--nats-url"}
    assert {(r["kind"], r["target"]) for r in report["recent"]} == {("Workflow", "kubernetes")}
    as_yaml = shell("status", "--nats-url", nats_server.url, "-o", "yaml")
    assert yaml.safe_load(as_yaml.stdout)["deadLetters"] == 0
    url = ("--nats-url", nats_server.url)
    assert shell("status", *url, "-o", "jsonpath={.deadLetters}").stdout == "0"
    one_row = shell("status", *url, "-o", "custom-columns=DLQ:.deadLetters,NATS:.nats.url")
    assert [line.split() for line in one_row.stdout.splitlines()] == [
        ["DLQ", "NATS"],
        ["0", nats_server.url],
    ]
    bad = shell("status", *url, "-o", "jsonpath={.a")
    assert bad.returncode == 2 and "jsonpath" in bad.stderr
    text = shell("status", "--nats-url", nats_server.url).stdout
    assert f"nats:          {nats_server.url}   (from --nats-url)" in text


def _read_until(process: subprocess.Popen[str], wanted: int, timeout: float = 60) -> list[str]:
    """Lines of stdout until `wanted` lines have come (or the timeout)."""
    assert process.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while len(lines) < wanted and time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
    return lines


def _interrupt(process: subprocess.Popen[str]) -> tuple[int, str]:
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    return process.returncode, err


async def test_history_watch_prints_each_change_and_exits_0_on_ctrl_c(
    shell: Shell, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    a, _ = await some_history(lapse_streams)
    watcher = shell.popen(
        "history", "-n", a, "-w", "--interval", "0.2", "-o", "json", "--nats-url", nats_server.url
    )
    try:
        first = _read_until(watcher, 1)
        assert len(json.loads(first[0])["items"]) == 3, first
        await record(lapse_streams, a, "late", "Workflow", Target.KUBERNETES)
        second = _read_until(watcher, 1)
        assert second, "no redraw after a new outcome"
        assert "late" in {r["name"] for r in json.loads(second[0])["items"]}
    finally:
        code, err = _interrupt(watcher)
    assert code == 0, err
    assert "Traceback" not in err


async def test_status_watch_redraws_in_place_and_exits_0_on_ctrl_c(
    shell: Shell, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    await some_history(lapse_streams)
    watcher = shell.popen("status", "-w", "--interval", "0.2", "--nats-url", nats_server.url)
    try:
        lines = _read_until(watcher, 40)
    finally:
        code, err = _interrupt(watcher)
    frames = "".join(lines).count(CLEAR)
    assert frames >= 2, "".join(lines)
    assert "Every 0.2s: lapse status" in "".join(lines)
    assert code == 0, err


async def test_status_shows_a_relist_while_it_runs(
    shell: Shell, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    kv = await health.bucket(lapse_streams)
    process = f"host-{uuid.uuid4().hex[:6]}"
    await health.report_relist(kv, health.Relisting(process, "argo-workflow", 1500, 12, 7.4))
    text = shell("status", "--nats-url", nats_server.url).stdout
    assert (
        f"re-listing:    argo-workflow ({process}): 1500 objects listed, 12 published again, "
        "for 7s" in text
    )
    report = _json(shell, nats_server, "status")
    assert isinstance(report, dict)
    assert {"kind": "argo-workflow", "process": process, "listed": 1500, "published": 12,
            "seconds": 7} in report["relisting"]  # fmt: skip
    assert all(w["process"] != process for w in report["waiting"])  # not a wait
    await health.relist_over(kv, process, "argo-workflow")
    report = _json(shell, nats_server, "status")
    assert isinstance(report, dict)
    assert all(r["process"] != process for r in report["relisting"])


async def test_status_shows_a_background_task_waiting_out_an_outage(
    shell: Shell, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    kv = await health.bucket(lapse_streams)
    process = f"host-{uuid.uuid4().hex[:6]}"
    now = time.time()
    reason = "API server unreachable (the connection to the server 127.0.0.1:6443 was refused)"
    wait = health.TaskWait(reason, since=now - 42, next_try=now + 20)
    await health.report(kv, process, {}, {"watcher argo-workflow": wait})
    text = shell("status", "--nats-url", nats_server.url).stdout
    line = next(ln for ln in text.splitlines() if process in ln)
    assert line.startswith(f"waiting:       watcher argo-workflow ({process}): {reason} since ")
    found = re.search(r"\((\d+)s\), next try in (\d+)s$", line)
    assert found is not None, line
    waited, next_try, took = int(found[1]), int(found[2]), time.time() - now
    assert 42 <= waited <= 42 + took + 1 and 20 - took - 1 <= next_try <= 20, line
    report = _json(shell, nats_server, "status")
    assert isinstance(report, dict)
    (task,) = [t for t in report["tasks"] if t["process"] == process]
    assert task["task"] == "watcher argo-workflow" and task["state"] == "waiting", task
    # "seconds" is rounded to the nearest second, so it may lead the clock by half of one
    assert task["reason"] == reason and 42 <= task["seconds"] <= 42.5 + time.time() - now, task
    assert task["nextTryInSeconds"] <= 20, task
    assert all(w["process"] != process for w in report["waiting"])  # no events wait
    await health.report(kv, process, {}, {})  # recovered
    report = _json(shell, nats_server, "status")
    assert isinstance(report, dict)
    assert all(t["process"] != process for t in report["tasks"])
