"""`lapse dlq` on a real NATS server: filters, show, purge, and what replay does with each
kind of entry (a due event of either target, a run event, input that was never an event)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from nats.js import JetStreamContext

from lapse.config import Streams
from lapse.edges.publishing import NatsEmitter, publish_event
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import build_event, parse_payload
from lapse.events.models import CleanupDue, CleanupFailed, RunFinished
from lapse.events.nats_binding import from_nats, to_nats
from lapse.events.original import capture_event, capture_message
from lapse.events.run import RunRef, Target
from lapse.events.subjects import due_subject
from lapse.events.types import EventType
from lapse.operations.dlq import MSG_TTL_HEADER, Filter, dead_letters, replay

pytestmark = [pytest.mark.nats]

STREAMS = Streams()


def run(name: str, uid: str, namespace: str = "team-a") -> RunRef:
    return RunRef.model_validate(
        {
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "Workflow",
            "namespace": namespace,
            "name": name,
            "uid": uid,
            "engine": "argo",
            "phase": "Succeeded",
            "finishedAt": "2026-11-21T10:00:00Z",
        }
    )


def due(ref: RunRef, target: Target) -> Any:
    payload = CleanupDue(
        run=ref,
        target=target,
        deadline=datetime(2026, 11, 21, 11, tzinfo=UTC),
        policy="test",
        scheduled_at=datetime(2026, 11, 21, 10, tzinfo=UTC),
    )
    return build_event(EventType.CLEANUP_DUE, source="/lapse/ttl-planner", data=payload)


async def fail(js: JetStreamContext, failed: CleanupFailed, source: str = "/test") -> None:
    await NatsEmitter(js, STREAMS).emit(
        build_event(EventType.CLEANUP_FAILED, source=source, data=failed)
    )


async def populate(js: JetStreamContext) -> dict[str, Any]:
    """Five dead letters, as the handlers and the ingress write them."""
    alpha = run("alpha", "11111111-1111-1111-1111-111111111111")
    beta = run("beta", "22222222-2222-2222-2222-222222222222", namespace="team-b")
    gamma = run("gamma", "33333333-3333-3333-3333-333333333333")
    rows_due = due(gamma, Target.DATABASE)
    finished = build_event(EventType.RUN_FINISHED, source="/watcher", data=RunFinished(run=beta))
    entries = [
        # 1, 2: the reaper refused alpha twice (two due events for one deadline).
        CleanupFailed(
            run=alpha,
            target=Target.KUBERNETES,
            reason="forbidden: cannot delete",
            stage="object-reaper",
            original=capture_event(due(alpha, Target.KUBERNETES)),
        ),
        CleanupFailed(
            run=alpha,
            target=Target.KUBERNETES,
            reason="forbidden: cannot delete (again)",
            stage="object-reaper",
            original=capture_event(due(alpha, Target.KUBERNETES)),
        ),
        # 3: the row-reaper gave up on gamma's rows.
        CleanupFailed(
            run=gamma,
            target=Target.DATABASE,
            reason="schema mismatch",
            stage="row-reaper",
            original=capture_event(rows_due),
        ),
        # 4: the planner could not use beta's finish.
        CleanupFailed(reason="bad annotation", stage="planner", original=capture_event(finished)),
        # 5: the ingress refused garbage.
        CleanupFailed(
            reason="400: not a CloudEvent",
            stage="ingress",
            original=capture_message({"content-type": "text/plain"}, b"junk"),
        ),
    ]
    for entry in entries:
        await fail(js, entry)
    # What the scheduler left of the refused deadlines: a due event is replayed only as lapse
    # stored it (lapse/operations/dlq.py: original_event).
    for stored in (due(alpha, Target.KUBERNETES), rows_due):
        data = stored.get_data()
        assert isinstance(data, dict)
        message = to_nats(stored)
        subject = due_subject(Target(data["target"]), data["run"]["uid"])
        await js.publish(subject, message.body, stream=STREAMS.schedule, headers=message.headers)
    return {"alpha": alpha, "beta": beta, "gamma": gamma, "finished": finished}


def lapse(nats: EmbeddedNats, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    config = tmp / "lapse.yaml"
    config.write_text(yaml.safe_dump({"nats": {"url": nats.url}}))
    return subprocess.run(
        [sys.executable, "-m", "lapse.cli", "--config", str(config), "dlq", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("LAPSE_")},
    )


def rows(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    # `list` prints a kubectl List (its items here); show, replay and purge one document.
    return found["items"] if isinstance(found, dict) and found.get("kind") == "List" else found


async def test_list_filters_show_and_purge(
    lapse_streams: JetStreamContext, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    await populate(lapse_streams)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return lapse(nats_server, tmp_path, *args)

    everything = rows(await asyncio.to_thread(cli, "list", "-o", "json"))
    assert [r["stage"] for r in everything] == [
        "object-reaper", "object-reaper", "row-reaper", "planner", "ingress",
    ]  # fmt: skip
    ids = [r["id"] for r in everything]
    team_a = rows(await asyncio.to_thread(cli, "list", "-n", "team-a", "-o", "json"))
    assert [r["name"] for r in team_a] == ["alpha", "alpha", "gamma"]
    by_target = rows(await asyncio.to_thread(cli, "list", "--target", "database", "-o", "json"))
    assert [r["name"] for r in by_target] == ["gamma"]
    by_reason = rows(await asyncio.to_thread(cli, "list", "--reason", "AGAIN", "-o", "json"))
    assert [r["id"] for r in by_reason] == [ids[1]]
    assert rows(await asyncio.to_thread(cli, "list", "--since", "1h", "-o", "json")) == everything
    # Into a pipe, as into a terminal: plain aligned columns, no box, no colour.
    table = await asyncio.to_thread(cli, "list")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["ID", "TIME", "NAMESPACE", "NAME", "TARGET", "STAGE", "REASON"]
    assert len(lines) == 6 and lines[1].split()[0] == str(ids[0])
    assert not set(table.stdout) & set("│─┃━┏┓┗┛┡┩└┘┌┐╭╮╰╯") and "\x1b" not in table.stdout

    shown = rows(await asyncio.to_thread(cli, "show", str(ids[4])))
    assert shown["stage"] == "ingress" and shown["original"]["data"] == "junk"
    assert (
        shown["replayProblem"].startswith("nothing to replay")
        or "CloudEvent" in shown["replayProblem"]
    )
    missing = await asyncio.to_thread(cli, "show", "999")
    assert missing.returncode == 2 and "no dead letter 999" in missing.stderr

    vague = await asyncio.to_thread(cli, "purge")
    assert vague.returncode == 2 and "--all" in vague.stderr
    both = await asyncio.to_thread(cli, "purge", "--all", "--stage", "ingress")
    assert both.returncode == 2
    dry = rows(
        await asyncio.to_thread(cli, "purge", "--stage", "ingress", "--dry-run", "-o", "json")
    )
    assert dry == {"dryRun": True, "removed": [ids[4]]}
    assert len(rows(await asyncio.to_thread(cli, "list", "-o", "json"))) == 5
    purged = rows(await asyncio.to_thread(cli, "purge", "--stage", "ingress", "-o", "json"))
    assert purged["removed"] == [ids[4]]
    assert [r["id"] for r in rows(await asyncio.to_thread(cli, "list", "-o", "json"))] == ids[:4]
    rows(await asyncio.to_thread(cli, "purge", "--all", "-o", "json"))
    assert rows(await asyncio.to_thread(cli, "list", "-o", "json")) == []


async def test_replay_sends_each_entry_where_its_route_consumes_it(
    lapse_streams: JetStreamContext,
) -> None:
    js = lapse_streams
    made = await populate(js)
    letters = [x async for x in dead_letters(js, STREAMS.dlq)]
    report = await replay(js, STREAMS, letters)

    alpha, gamma = made["alpha"], made["gamma"]
    sent = {r["subject"]: r for r in report.replayed}
    # The two refusals of alpha's deadline are one replay.
    kube = sent[due_subject(Target.KUBERNETES, alpha.uid)]
    assert kube["ids"] == [letters[0].seq, letters[1].seq]
    assert set(sent) == {
        due_subject(Target.KUBERNETES, alpha.uid),
        due_subject(Target.DATABASE, gamma.uid),
        "lapse.events.dev.lapse.run.finished.v1",
    }
    assert sorted(report.removed) == [x.seq for x in letters[:4]]
    # The ingress's garbage cannot be replayed: it stays, with the reason.
    assert [x["stage"] for x in report.left] == ["ingress"]
    assert [x.seq async for x in dead_letters(js, STREAMS.dlq)] == [letters[4].seq]

    # A replayed due event is where the scheduler fires it, as the same due deadline under a
    # new id, and expires like a fired one.
    msg = await js.get_last_msg(STREAMS.schedule, due_subject(Target.KUBERNETES, alpha.uid))
    event = from_nats(msg.headers, msg.data)
    assert parse_payload(event, CleanupDue).run.uid == alpha.uid
    assert event.get_id().endswith(f".replay.{letters[1].seq}")
    assert msg.headers is not None and msg.headers[MSG_TTL_HEADER].endswith("s")
    rows_msg = await js.get_last_msg(STREAMS.schedule, due_subject(Target.DATABASE, gamma.uid))
    assert parse_payload(from_nats(rows_msg.headers, rows_msg.data), CleanupDue).target is (
        Target.DATABASE
    )
    finished = await js.get_last_msg(STREAMS.events, "lapse.events.dev.lapse.run.finished.v1")
    again = from_nats(finished.headers, finished.data)
    assert again.get_data() == made["finished"].get_data()

    # Nothing left to replay twice.
    second = await replay(js, STREAMS, [x async for x in dead_letters(js, STREAMS.dlq)])
    assert second.replayed == [] and len(second.left) == 1


async def test_a_refusal_without_its_original_replays_the_kept_due_message(
    lapse_streams: JetStreamContext,
) -> None:
    """The object reaper's refusal names the run and target only; the due message the
    scheduler fired is still kept on its subject, and that is what replay sends."""
    js = lapse_streams
    ref = run("delta", "44444444-4444-4444-4444-444444444444")
    fired = due(ref, Target.KUBERNETES)
    await publish_event(js, due_subject(Target.KUBERNETES, ref.uid), STREAMS.schedule, fired)
    await fail(
        js,
        CleanupFailed(run=ref, target=Target.KUBERNETES, reason="forbidden", stage="object-reaper"),
    )
    lost = run("epsilon", "55555555-5555-5555-5555-555555555555")
    await fail(
        js,
        CleanupFailed(
            run=lost, target=Target.KUBERNETES, reason="forbidden", stage="object-reaper"
        ),
    )
    letters = [x async for x in dead_letters(js, STREAMS.dlq, Filter(stage="object-reaper"))]
    report = await replay(js, STREAMS, letters, dry_run=True)
    assert [r["name"] for r in report.replayed] == ["delta"]
    assert [r["name"] for r in report.left] == ["epsilon"]
    assert "lapse reconcile" in report.left[0]["problem"]
    assert report.removed == []  # a dry run changes nothing
    assert len([x async for x in dead_letters(js, STREAMS.dlq)]) == 2
    since = datetime.now(UTC) + timedelta(hours=1)
    assert [x async for x in dead_letters(js, STREAMS.dlq, Filter(since=since))] == []
