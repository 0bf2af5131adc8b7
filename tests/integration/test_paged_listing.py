"""Large clusters: every list lapse makes of a run kind is paged, and listing stays flat in
memory whatever the cluster holds (docs/architecture.md, "Large clusters").

Against a real kube-apiserver that writes every LIST of a Workflow to its audit log: the
API server's own record says that each request carried a `limit`, and that a namespace
glob was listed one namespace at a time. Memory is Python's own count (tracemalloc) of
the peak while the pages are read and each object is adapted to a run (what the watcher,
`lapse plan` and `lapse reconcile` do with a page): with 5,000 Workflows it stays within
what 1,000 cost, and within a fixed bound.
"""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from nats.js import JetStreamContext

from bench.report import parse_timestamp
from lapse.config import LapseConfig
from lapse.edges.kubernetes import KubeObjects, finished_pages_within, list_metadata
from lapse.embedded.nats import EmbeddedNats
from lapse.events.adapters.objects import adapt
from lapse.events.errors import InvalidEvent
from lapse.events.kinds import ARGO_WORKFLOW
from lapse.events.models import RunFinished
from lapse.operations.reconcile import Options, reconcile
from lapse.runtime.resources import Resources
from tests.conftest import KubeStack
from tests.e2e.apiserver_audit import audited_kube_stack
from tests.unit.test_object_reaper_verdict import argo_workflow

pytestmark = [pytest.mark.kube, pytest.mark.nats]

PAGE = 100
PER_NAMESPACE = 1000
NAMESPACES = [f"paged-{i}" for i in range(5)]
# One page of Workflows decoded (about 100 KiB of JSON a page here), the page before it
# still being collected, and the client's own buffers: far below what 1,000 objects held
# at once would take (about 10 MiB).
BOUND = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KubeStack, Path]]:
    with audited_kube_stack(tmp_path_factory.mktemp("paged"), verbs=("list",)) as found:
        yield found


async def fill(objects: KubeObjects, namespace: str, count: int) -> None:
    """`count` finished Workflows in `namespace`, created 32 at a time."""
    slots = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        body = argo_workflow(f"wf-{i:05d}", namespace=namespace)
        async with slots:
            await objects.create(ARGO_WORKFLOW, namespace, body)

    await asyncio.gather(*(one(i) for i in range(count)))


async def read_all(objects: KubeObjects, scope: str | None) -> tuple[int, int, set[str | None]]:
    """(runs read, peak bytes allocated while reading, namespaces listed one by one)."""
    runs = 0
    listed: set[str | None] = set()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        async for namespace, page in finished_pages_within(
            objects, ARGO_WORKFLOW, scope, page_size=PAGE
        ):
            listed.add(namespace)
            for obj in page.items:
                try:
                    finished = adapt(obj, ARGO_WORKFLOW)
                except InvalidEvent:
                    continue
                runs += isinstance(finished, RunFinished)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    return runs, peak, listed


def workflow_lists(audit_log: Path) -> list[dict[str, Any]]:
    """Every LIST of Workflows the API server answered, as its audit log has it."""
    found = []
    for line in audit_log.read_text().splitlines():
        event = json.loads(line)
        if event.get("stage") == "ResponseComplete" and event.get("verb") == "list":
            found.append(event)
    return found


def query(event: dict[str, Any]) -> dict[str, list[str]]:
    return parse_qs(urlsplit(event["requestURI"]).query)


async def test_every_list_is_paged_and_memory_stays_flat(
    audited: tuple[KubeStack, Path],
) -> None:
    kube, audit_log = audited
    objects = KubeObjects(kube.api_client, kube.executor)
    for namespace in NAMESPACES:
        kube.namespace(namespace)
    kube.namespace("other")  # matches no glob below: never listed by it

    await fill(objects, NAMESPACES[0], PER_NAMESPACE)
    small, small_peak, _ = await read_all(objects, None)
    await asyncio.gather(*(fill(objects, ns, PER_NAMESPACE) for ns in NAMESPACES[1:]))
    large, large_peak, _ = await read_all(objects, None)
    globbed, glob_peak, listed = await read_all(objects, "paged-*")
    one, _, _ = await read_all(objects, NAMESPACES[2])

    assert (small, large, globbed, one) == (1000, 5000, 5000, 1000)
    # Five times the objects, not five times the memory: a page at a time.
    print(f"peak bytes: 1,000 {small_peak}; 5,000 {large_peak}; 5,000 by namespace {glob_peak}")
    assert large_peak < small_peak * 1.5 + 256 * 1024, (small_peak, large_peak)
    assert glob_peak < small_peak * 1.5 + 256 * 1024, (small_peak, glob_peak)
    assert max(small_peak, large_peak, glob_peak) < BOUND
    # The glob was listed one matching namespace at a time.
    assert listed == set(NAMESPACES)

    # keep_last's group LIST (every object of a namespace, for a field group) and the
    # metadata-only LIST reconcile makes for KFP runs are paged too.
    group = await objects.list_items(ARGO_WORKFLOW, NAMESPACES[3], label_selector="")
    assert len(group) == PER_NAMESPACE
    await list_metadata(kube.api_client, kube.executor, ARGO_WORKFLOW, limit=PAGE)

    lists = workflow_lists(audit_log)
    unpaged = [e["requestURI"] for e in lists if not query(e).get("limit")]
    assert not unpaged, unpaged
    # Ours (the test's CRD check lists with limit=1): each asked for at most a page.
    ours = [e for e in lists if query(e)["limit"] != ["1"]]
    assert all(int(query(e)["limit"][0]) <= 500 for e in ours)
    by_namespace = [e for e in ours if e["objectRef"].get("namespace")]
    count = {ns: sum(e["objectRef"]["namespace"] == ns for e in by_namespace) for ns in NAMESPACES}
    # 1,000 Workflows, 100 a page: 10 requests a namespace read whole (11 when the server
    # offers a token after the last full page); the glob read each, `one` the third again,
    # the group LIST (500 a page) the fourth.
    assert 10 <= count[NAMESPACES[0]] <= 11
    assert 20 <= count[NAMESPACES[2]] <= 22
    assert 12 <= count[NAMESPACES[3]] <= 14
    assert not any(e["objectRef"]["namespace"] == "other" for e in by_namespace)


async def test_reconcile_lists_a_glob_one_namespace_at_a_time(
    audited: tuple[KubeStack, Path], nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    kube, audit_log = audited
    objects = KubeObjects(kube.api_client, kube.executor)
    sizes = {"glob-a1": 3, "glob-a2": 2, "glob-b": 2}
    for namespace, count in sizes.items():
        kube.namespace(namespace)
        await fill(objects, namespace, count)
    config = LapseConfig.model_validate(
        {"nats": {"url": nats_server.url}, "kubernetes": {"kubeconfig": str(kube.kubeconfig)}}
    )
    started = time.time()
    async with Resources(config) as resources:
        summary = await reconcile(resources, Options(namespace="glob-a*", rows=False, page_size=2))
    assert summary.ok, summary.problems
    assert summary.runs is not None and summary.runs.listed == 5

    lists = [
        e
        for e in workflow_lists(audit_log)
        if parse_timestamp(e["requestReceivedTimestamp"]) >= started
    ]
    where = [e["objectRef"].get("namespace") for e in lists]
    # Each matching namespace, by pages of 2; never the whole kind, never glob-b.
    assert set(where) == {"glob-a1", "glob-a2"}, where
    assert all(query(e)["limit"] == ["2"] for e in lists)
    assert where.count("glob-a1") >= 2
