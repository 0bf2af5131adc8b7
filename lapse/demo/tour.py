"""The tour `lapse demo` gives: set up the sample runs, run the pipeline, follow the audit
trail live, and judge the end state against the API server and the database."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry.sdk.trace import ReadableSpan
from rich.live import Live
from sqlalchemy.ext.asyncio import AsyncEngine

from lapse import telemetry
from lapse.config import LapseConfig
from lapse.demo import artifacts, kfp, mlmd
from lapse.demo.artifacts import S3Access
from lapse.demo.progress import (
    DemoSummary,
    FootprintLeft,
    Leftovers,
    Timing,
    Tracker,
    summarize,
)
from lapse.demo.scenario import (
    ARTIFACT_BUCKET,
    MAX_TTL,
    NAMESPACE,
    PIPELINE_NAME,
    RUN_KINDS,
    Kind,
    Sample,
    artifact_prefix,
    run_object,
)
from lapse.demo.view import Output, change_line, live_table
from lapse.edges.kubernetes import KubeObjects, finished_pages
from lapse.events.errors import InvalidEvent
from lapse.events.kinds import ARGO_WORKFLOW, KindSpec
from lapse.events.nats_binding import from_nats
from lapse.events.subjects import AUDIT_PREFIX
from lapse.runtime.pipeline import Pipeline
from lapse.runtime.resources import Resources
from lapse.telemetry import names

log = logging.getLogger(__name__)

# Past the last deadline, how long the tour waits for stragglers before it judges.
GRACE_SECONDS: Final = 30.0
REFRESH_SECONDS: Final = 0.25
LIST_EVERY_SECONDS: Final = 1.0
SETUP_TIMEOUT: Final = 60.0
# Stopping drains NATS, whose client gives up after 30 s.
STOP_TIMEOUT: Final = 90.0


# --- setting up ----------------------------------------------------------------------------


async def tour(
    config: LapseConfig,
    nats_url: str,
    samples: list[Sample],
    out: Output,
    begun: float,
    report: Callable[[DemoSummary], None],
    s3: S3Access | None = None,
) -> None:
    """Set up, run the tour, and `report` the verdict as soon as it is known: stopping the
    pipeline and the servers afterwards can take a while."""
    async with Resources(config) as resources:
        workflows = resources.objects()
        engine = resources.database()
        await prepare_cluster(resources.kube_client(), workflows, samples)
        # Before the pipeline starts: it reflects the tables it deletes in at start-up.
        await kfp.create_tables(engine)
        await mlmd.create_tables(engine)
        kfp_runs = [(s.kfp_run_id, s.name) for s in samples if s.kfp_run_id is not None]
        await kfp.insert_runs(engine, kfp_runs, NAMESPACE)
        footprint = await plant_footprint(engine, samples, s3)
        # In-process spans, so the tour can show one run's whole path without a backend.
        recorder = telemetry.install_in_memory("lapse-demo")
        async with running_pipeline(config, nats_url) as pipeline:
            js = await resources.jetstream()
            out.note(
                f"ready after {time.monotonic() - begun:.1f}s; creating {len(samples)} finished "
                f"runs in namespace {NAMESPACE} ({_kinds(samples)}; {len(kfp_runs)} with KFP "
                "rows)"
            )
            if footprint is not None:
                out.note(footprint_plan(footprint))
            pool = resources.kube_client().configuration.connection_pool_maxsize
            tracker = Tracker(samples, datetime.now(UTC))
            async with following_audit(js, config.nats.streams.audit, tracker, out):
                out.started = time.monotonic()
                await create_all(workflows, samples, tracker.finished_at, at_once=pool)
                await follow(tracker, workflows, out, pipeline)
            tour_seconds = time.monotonic() - out.started
            leftovers = await inspect_leftovers(workflows, engine, samples, footprint)
            timing = Timing(out.started - begun, tour_seconds)
            report(summarize(tracker, leftovers, timing, kfp.ROWS_PER_RUN))
            # The footprint run's trace shows every reaper; else the first KFP run's.
            traced = (
                footprint.sample.name
                if footprint is not None
                else next((s.name for s in samples if s.kfp_run_id is not None), samples[0].name)
            )
            out.trace(traced, trace_of(recorder.spans(), traced))


def trace_of(spans: Sequence[ReadableSpan], name: str) -> str:
    """One run's traces as a tree: planner, schedule, and each reaper after its delay."""
    uids = {
        str(span.attributes.get(names.RUN_UID))
        for span in spans
        if span.attributes and span.attributes.get(names.RUN_NAME) == name
    }
    if not uids:
        return f"(no spans recorded for {name})"
    return telemetry.render_trace_tree(telemetry.spans_of_run(spans, uids.pop()))


@contextlib.asynccontextmanager
async def running_pipeline(config: LapseConfig, nats_url: str) -> AsyncIterator[asyncio.Task[None]]:
    """The whole pipeline as an asyncio task, ready when the body runs, stopped after it."""
    pipeline = Pipeline(config, nats_url=nats_url)
    stop = asyncio.Event()
    task = asyncio.create_task(pipeline.run(stop), name="pipeline")
    ready = asyncio.create_task(pipeline.ready.wait())
    await asyncio.wait([task, ready], timeout=SETUP_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        ready.cancel()
        stop.set()
        if task.done():
            task.result()  # raises what stopped it
        raise RuntimeError(f"the pipeline was not ready after {SETUP_TIMEOUT:.0f}s")
    try:
        yield task
    finally:
        stop.set()
        done, _ = await asyncio.wait([task], timeout=STOP_TIMEOUT)
        if not done:
            log.warning("the pipeline did not stop within %.0fs; leaving it", STOP_TIMEOUT)
            task.cancel()


async def prepare_cluster(
    api_client: client.ApiClient, objects: KubeObjects, samples: Sequence[Sample]
) -> None:
    """The demo namespace, each sample kind served, and its validation warmed up."""
    core = client.CoreV1Api(api_client)
    namespace = client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE))
    try:
        await asyncio.to_thread(core.create_namespace, namespace)
    except ApiException as exc:
        if exc.status != 409:
            raise
    custom = client.CustomObjectsApi(api_client)
    for sample in {s.run_kind.name: s for s in samples}.values():
        kind = sample.run_kind
        await poll(
            functools.partial(_served, objects, kind), what=f"{kind.describe()} to be served"
        )
        # The API server compiles a CRD's schema on the first create (about 2 s); a dry run
        # pays for that now instead of out of the first sample's few seconds of TTL.
        body, _ = run_object(sample, datetime.now(UTC))
        await asyncio.to_thread(
            custom.create_namespaced_custom_object,
            kind.group, kind.version, NAMESPACE, kind.resource, body, dry_run="All",
        )  # fmt: skip


async def _served(objects: KubeObjects, kind: KindSpec) -> bool:
    try:
        await objects.list_page(kind, NAMESPACE, limit=1)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


def _kinds(samples: Sequence[Sample]) -> str:
    counts: dict[str, int] = {}
    for sample in samples:
        counts[sample.run_kind.kind] = counts.get(sample.run_kind.kind, 0) + 1
    return ", ".join(f"{n} {kind}" for kind, n in counts.items())


async def poll(check: Callable[[], Awaitable[bool]], *, what: str) -> None:
    deadline = time.monotonic() + SETUP_TIMEOUT
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting for {what} after {SETUP_TIMEOUT:.0f}s")
        await asyncio.sleep(0.1)


# --- the tour itself -----------------------------------------------------------------------


async def create_all(
    objects: KubeObjects, samples: list[Sample], finished_at: datetime, *, at_once: int
) -> None:
    # No more at once than the client's connection pool holds, or urllib3 warns and
    # throws connections away.
    slots = asyncio.Semaphore(max(1, at_once))

    async def create(sample: Sample) -> None:
        kind = sample.run_kind
        body, status = run_object(sample, finished_at)
        async with slots:
            created = await objects.create(kind, NAMESPACE, body)
            if kind is not ARGO_WORKFLOW:  # written finished, as its controller would
                created["status"] = status
                await objects.replace_status(kind, NAMESPACE, sample.name, created)

    await asyncio.gather(*(create(sample) for sample in samples))


async def follow(
    tracker: Tracker, workflows: KubeObjects, out: Output, pipeline: asyncio.Task[None]
) -> None:
    """Until every run settled (or the last deadline is well past): refresh the view and
    look at the API server, where a kept run proves itself by still being there."""
    give_up = out.started + MAX_TTL + GRACE_SECONDS
    with contextlib.ExitStack() as stack:
        live = None
        if out.live:
            live = stack.enter_context(Live(console=out.console, auto_refresh=False))
        last_list = 0.0
        while True:
            if pipeline.done():
                pipeline.result()  # raises what stopped it
                raise RuntimeError("the pipeline stopped in the middle of the tour")
            now = time.monotonic()
            if now - last_list >= LIST_EVERY_SECONDS:
                last_list = now
                for change in tracker.observe(await object_names(workflows), datetime.now(UTC)):
                    if not out.live:
                        out.note(change_line(change, out.elapsed()))
            if live is not None:
                live.update(live_table(tracker, datetime.now(UTC), out.elapsed()), refresh=True)
            if tracker.settled or now > give_up:
                return
            await asyncio.sleep(REFRESH_SECONDS)


@contextlib.asynccontextmanager
async def following_audit(
    js: JetStreamContext, stream: str, tracker: Tracker, out: Output
) -> AsyncIterator[None]:
    """Feed every audit event into the tracker while the body runs."""
    subject = f"{AUDIT_PREFIX}.>"
    sub = await js.pull_subscribe(
        subject,
        stream=stream,
        config=ConsumerConfig(
            filter_subject=subject,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=30.0,
        ),
    )

    async def pump() -> None:
        while True:
            try:
                msgs = await sub.fetch(100, timeout=0.5)
            except TimeoutError:
                continue
            for msg in msgs:
                try:
                    change = tracker.apply(from_nats(dict(msg.headers or {}), msg.data))
                except InvalidEvent:
                    continue  # not lapse's: nothing to show
                if change is not None and not out.live:
                    out.note(change_line(change, out.elapsed()))

    task = asyncio.create_task(pump(), name="audit")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # A pull subscription left open holds up the connection's drain at close.
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def object_names(objects: KubeObjects) -> set[str]:
    """The demo's run objects still present, of every sample kind (all written finished)."""
    names: set[str] = set()
    for kind in RUN_KINDS:
        async for page in finished_pages(objects, kind, NAMESPACE):
            names.update(item["metadata"]["name"] for item in page.items)
    return names


@dataclass(frozen=True)
class Planted:
    """What the tour wrote of the footprint run beyond its object and KFP rows."""

    sample: Sample
    metadata: mlmd.Recorded
    s3: S3Access | None
    outputs: list[str]
    beside: list[str]


# MLMD's last update of the run: before the Workflow finished (lapse's row-reaper checks
# that the database's own account of the run ended no later than the run it planned).
_METADATA_AGE_MS: Final = 60_000


async def plant_footprint(
    engine: AsyncEngine, samples: Sequence[Sample], s3: S3Access | None
) -> Planted | None:
    """The footprint run's ML Metadata rows, and its outputs in the S3 server (with
    objects beside them that are not its own)."""
    sample = next((s for s in samples if s.kind is Kind.FOOTPRINT), None)
    if sample is None or sample.kfp_run_id is None:
        return None
    recorded = await mlmd.record_run(
        engine,
        run_id=sample.kfp_run_id,
        pipeline=PIPELINE_NAME,
        tasks=artifacts.output_uris(sample),
        updated_ms=int(time.time() * 1000) - _METADATA_AGE_MS,
    )
    if s3 is None or sample.artifacts_ttl is None:
        return Planted(sample, recorded, None, [], [])
    outputs, beside = artifacts.output_keys(sample), artifacts.beside_keys(sample)
    await artifacts.plant(s3, outputs + beside)
    return Planted(sample, recorded, s3, outputs, beside)


def footprint_plan(planted: Planted) -> str:
    """What the footprint run holds and when each part is due, before the tour starts."""
    sample = planted.sample
    parts = [
        f"object due {sample.object_ttl}s",
        f"KFP rows and {planted.metadata.rows} ML Metadata rows due {sample.rows_ttl}s",
    ]
    if planted.s3 is not None:
        prefix = artifact_prefix(sample)
        parts.append(
            f"{len(planted.outputs)} artifacts in s3://{ARTIFACT_BUCKET}/{prefix} "
            f"due {sample.artifacts_ttl}s ({len(planted.beside)} objects planted beside it "
            "must stay)"
        )
    else:
        parts.append(NO_S3_NOTE)
    return f"{sample.name}: one KFP run's footprint, " + "; ".join(parts) + " after finishing"


NO_S3_NOTE: Final = (
    "no S3 server (SeaweedFS is not built: `make seaweedfs` builds it), so the artifacts "
    "part was left out"
)


async def inspect_leftovers(
    workflows: KubeObjects,
    engine: AsyncEngine,
    samples: list[Sample],
    footprint: Planted | None = None,
) -> Leftovers:
    run_ids = [s.kfp_run_id for s in samples if s.kfp_run_id is not None]
    objects = await object_names(workflows)
    left = None
    if footprint is not None:
        s3 = footprint.s3
        left = FootprintLeft(
            run=footprint.sample.name,
            metadata_rows=footprint.metadata.rows,
            metadata_left=await mlmd.rows_left(engine, footprint.metadata),
            pipeline_context_kept=await mlmd.pipeline_context_present(engine, footprint.metadata),
            artifacts=len(footprint.outputs),
            artifacts_left=tuple(await artifacts.present(s3, footprint.outputs)) if s3 else (),
            beside=len(footprint.beside),
            beside_left=len(await artifacts.present(s3, footprint.beside)) if s3 else 0,
            note=None if s3 else NO_S3_NOTE,
        )
    return Leftovers(frozenset(objects), await kfp.rows_left(engine, run_ids), left)
