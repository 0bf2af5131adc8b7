"""What a restart of `lapse up` costs a run that finishes meanwhile (issue 27).

N finished Workflows are planned by one `lapse up` pipeline (in this process, embedded
kube-apiserver and NATS); it stops; JetStream's duplicate window is let pass (as on any
restart more than two minutes later, or the re-listed events are dropped as duplicates and
nothing is measured); NEW runs finish meanwhile, named to sort after every old one; a
second pipeline starts. Printed: how long after the restart each new run's schedule
existed (p50, p99, max), and how long the second start's re-list took, if there was one.

    .venv/bin/python -m bench.bench_restart --objects 20000 [--relist]

`--relist` forgets the stored watch position first (a first start, or 410 Gone): the
re-list then runs beside the live watch. A benchmark, never a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

from lapse.config import Streams, load_config
from lapse.edges.nats import connect
from lapse.edges.streams import count_messages
from lapse.embedded.nats import EmbeddedNats
from lapse.events.timeutil import format_rfc3339
from lapse.runtime.pipeline import Pipeline
from tests.conftest import kube_stack
from tests.e2e.test_lapse_up import finished_workflow
from tests.stack import wait_for

NEW = 20


def earlier(obj: dict[str, Any]) -> dict[str, Any]:
    """Finished ten minutes ago: long before the restart, as a pending run is."""
    then = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    obj["status"]["startedAt"] = obj["status"]["finishedAt"] = format_rfc3339(then)
    return obj


async def main(objects: int, relist: bool) -> dict[str, Any]:
    work = Path(mkdtemp(prefix="lapse-bench-restart-"))
    nats = EmbeddedNats(work / "nats").start()
    try:
        with kube_stack(work / "kube") as kube:
            return await measure(kube, nats, work, objects, relist)
    finally:
        nats.stop()


async def measure(kube: Any, nats: EmbeddedNats, work: Path, objects: int, relist: bool) -> Any:
    config_file = work / "lapse.yaml"
    config_file.write_text(
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        "kinds: [argo-workflow]\n"
        "policies: [{name: all, match: {}, kubernetes: {ttl: 1h}}]\n"
        "safety: {namespaces: {include: ['*']}}\n"
    )
    config = load_config(config_file, env={})
    ns = kube.namespace(f"restart-{uuid.uuid4().hex[:6]}")
    for start in range(0, objects, 50):
        batch = range(start, min(start + 50, objects))
        await asyncio.gather(
            *(kube.workflows.create(ns, earlier(finished_workflow(f"old-{i}"))) for i in batch)
        )
    nc = await connect(nats.url)
    js = nc.jetstream()
    sched = Streams().schedule

    async def pending() -> int:
        return await count_messages(js, sched, "lapse.sched.kubernetes.>")

    stop = asyncio.Event()
    first = Pipeline(config, nats_url=nats.url)
    task = asyncio.create_task(first.run(stop))
    await first.ready.wait()

    async def all_planned() -> bool:
        return await pending() >= objects

    await wait_for(all_planned, timeout=3600, interval=0.5)
    stop.set()
    await task
    # Let JetStream's duplicate window pass (as on a restart minutes later).
    info = await js.stream_info(Streams().events)
    cfg = info.config
    cfg.duplicate_window = 0.5
    await js.update_stream(cfg)
    await asyncio.sleep(3)
    cfg.duplicate_window = 120.0
    await js.update_stream(cfg)
    if relist:
        from lapse.edges.watch_positions import WatchPositions

        await WatchPositions(js).forget("argo-workflow")

    # NEW runs finish while lapse is down: they are in the new process's list, if it lists,
    # and their names sort after every old run's (a list comes in name order): the worst
    # place for them.
    for i in range(NEW):
        await kube.workflows.create(ns, finished_workflow(f"zz-new-{i}"))
    stop = asyncio.Event()
    second = Pipeline(config, nats_url=nats.url)
    started = time.monotonic()
    task = asyncio.create_task(second.run(stop))
    # One count for all (an ephemeral consumer per look): the k-th new schedule's time.
    seen: list[float] = []

    async def all_new_planned() -> bool:
        new = await pending() - objects
        seen.extend([time.monotonic() - started] * (new - len(seen)))
        return new >= NEW

    await wait_for(all_new_planned, timeout=3600, interval=0.1)
    watchers = getattr(second, "watchers", [])

    async def relist_over() -> bool:
        return not watchers or watchers[0].relist is None

    await wait_for(relist_over, timeout=3600, interval=0.1)
    relist_done = time.monotonic() - started
    stop.set()
    await task
    await nc.close()
    late = sorted(seen)
    return {
        "objects": objects,
        "forced_relist": relist,
        "new_planned_after_restart_p50_s": round(late[len(late) // 2], 2),
        "new_planned_after_restart_p99_s": round(
            late[min(len(late) - 1, int(len(late) * 0.99))], 2
        ),
        "new_planned_after_restart_max_s": round(late[-1], 2),
        "relists_at_restart": sum(getattr(w, "relists", 0) for w in watchers) if watchers else None,
        "until_relist_published_s": round(relist_done, 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=5000)
    parser.add_argument("--relist", action="store_true")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.objects, args.relist))))
