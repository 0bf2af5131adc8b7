"""The whole pipeline in one process: watcher, dispatcher and every routed function.

`lapse up` runs this; so do the end-to-end tests and `lapse demo`.

Every background task is started with `Supervisor.start` (lapse.runtime.supervisor), never
with a bare `asyncio.create_task`: an outage of a dependency is waited out and shown in
`lapse status`, and only a fatal failure (configuration, 401/403) or a signal ends the
process. A task added here gets that by being started the same way.

Telemetry is configured from the OTEL_* environment when the pipeline starts (unless the
process already set it up, as tests and the demo do) and flushed when it ends. While
metrics go somewhere, the stream-backed gauges (pending schedules per target, dead-letter
depth) are refreshed every `backlog_interval` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import hypercorn.asyncio
from nats.js import JetStreamContext

from lapse import telemetry
from lapse.config import LapseConfig, Streams
from lapse.edges import health
from lapse.edges.kubernetes.policies import namespace_names
from lapse.edges.nats import unreachable
from lapse.edges.publishing import NatsPublisher
from lapse.edges.streams import configured_streams, count_messages, ensure_streams
from lapse.edges.watch_leases import WatchLeases
from lapse.edges.watch_positions import WatchPositions
from lapse.events.run import Target
from lapse.events.subjects import SCHEDULE_PREFIX
from lapse.functions.ports import Handler, RetryLater
from lapse.functions.trust import Provenance
from lapse.runtime.asgi import LOOPBACK, host_of, server_config
from lapse.runtime.dispatcher import Dispatcher, Subscription
from lapse.runtime.ingress import Ingress, nats_ingress
from lapse.runtime.policy_watcher import PolicyWatcher
from lapse.runtime.registry import build_handler
from lapse.runtime.resources import Resources
from lapse.runtime.routing import Route, load_routes, pushed_types, relist_lane
from lapse.runtime.supervisor import Retrying, Supervisor, drain
from lapse.runtime.watch_lease import LeaseKeeper
from lapse.runtime.watcher import KindWatcher, report_relists

log = logging.getLogger(__name__)

# How long in-flight work may take to finish after a stop before it is cut short.
SHUTDOWN_GRACE = 20.0
# How often a process that waits out an outage reports it (lapse.edges.health).
HEALTH_INTERVAL = 5.0
# How often the NATS connection's state is looked at.
NATS_CHECK_INTERVAL = 0.5


class Pipeline:
    def __init__(
        self,
        config: LapseConfig,
        *,
        nats_url: str | None = None,
        watch: bool = True,
        routes: list[Route] | None = None,
        listen: str | None = None,
        metrics_host: str | None = None,
        backlog_interval: float = 15.0,
    ) -> None:
        self.config = config
        self._nats_url = nats_url
        self._watch = watch
        self._routes = routes if routes is not None else load_routes()
        self._listen = listen
        self._metrics_host = metrics_host
        self._backlog_interval = backlog_interval
        self.ready = asyncio.Event()
        self.watchers: list[KindWatcher] = []
        # With kubernetes.watch_lease on: which kinds' watches this process runs.
        self.leases: LeaseKeeper | None = None
        self.policy_watcher: PolicyWatcher | None = None
        self.supervisor: Supervisor | None = None
        self.dispatcher: Dispatcher | None = None

    async def run(self, stop: asyncio.Event) -> None:
        # Metrics no further than the ingress (loopback when it is off), unless told.
        exporting = telemetry.configure(
            metrics_host=self._metrics_host, http_host=host_of(self._listen) or LOOPBACK
        )
        try:
            main = asyncio.create_task(self._run(stop), name="pipeline")
            stopped = asyncio.create_task(stop.wait(), name="stop")
            await asyncio.wait([main, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not self.ready.is_set() and not main.done():
                # Stopped while starting (e.g. waiting for the database): nothing is in
                # flight yet, so there is nothing to finish.
                started = self.supervisor.running() if self.supervisor is not None else []
                for task in started:  # e.g. the policy watcher, waiting for the API server
                    task.cancel()
                main.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await main
                log.info("lapse stopped before it was running")
                return
            await main
        finally:
            exporting.shutdown()

    async def _run(self, stop: asyncio.Event) -> None:
        async with Resources(self.config, nats_url=self._nats_url) as resources:
            js = await resources.jetstream()
            await self._ensure_streams(js)
            emitter = await resources.emitter()
            # Before anything starts: a limit NATS cannot honour, or an ingress reachable
            # beyond loopback without a token, is a configuration error.
            ingress = (
                await nats_ingress(js, self.config, listen=self._listen) if self._listen else None
            )
            # Every background task runs under it: no outage of a dependency ends lapse up.
            supervisor = self.supervisor = Supervisor(stop)
            # From here on, even while the policy objects are being read at the start: a
            # lapse up started while the API server is away says what it waits for.
            replicas = self.config.nats.replicas
            report = partial(_report_health, js, lambda: self.dispatcher, supervisor, replicas)
            supervisor.start("health", report)
            supervisor.start("nats connection", partial(_watch_nats, js))
            # Policy objects are read before any run is planned (docs/policies.md).
            if self._watch:
                await self._watch_policies(resources, js, stop, supervisor)
            subscriptions = await self._subscribe(resources)
            if ingress is not None:
                # What the ingress stores, a handler here reads: the types of the routes
                # whose function is running (a function with nothing to do is not).
                ingress.accepted = pushed_types(s.route for s in subscriptions)
            dispatcher = self.dispatcher = Dispatcher(js, emitter, self.config.nats, subscriptions)
            # The dispatcher and the ingress finish their in-flight work when stopped; the
            # watchers and the reporters are simply cancelled.
            draining = [supervisor.start("dispatcher", dispatcher.run)]
            streams = self.config.nats.streams
            if self._watch:
                publish = NatsPublisher(js, streams, provenance=Provenance.READ_BY_LAPSE).publish
                # A re-list's events go on their own lane (consumed beside the live one).
                relist = NatsPublisher(
                    js, streams, provenance=Provenance.READ_BY_LAPSE, relist=True
                ).publish
                positions = WatchPositions(js, replicas=self.config.nats.replicas)
                watchers = [
                    KindWatcher(
                        resources.objects(),
                        kind,
                        publish,
                        emitter.emit,
                        positions=positions,
                        publish_relist=relist,
                        watch_timeout=self.config.kubernetes.watch_timeout,
                    )
                    for kind in self.config.kinds  # one watch per configured kind
                ]
                self.watchers = watchers
                lease = self.config.kubernetes.watch_lease
                if lease.enabled:  # each kind watched by one of the processes sharing NATS
                    leases = WatchLeases(
                        js,
                        resources.objects().cluster,
                        health.process_key(),
                        ttl=lease.ttl.total_seconds(),
                        replicas=replicas,
                    )
                    self.leases = LeaseKeeper(leases, watchers, start=supervisor.start_part)
                    supervisor.start("watch leases", partial(self.leases.run, stop))
                else:
                    for watcher in watchers:
                        supervisor.start(f"watcher {watcher.kind.name}", partial(watcher.run, stop))
                supervisor.start(
                    "relist progress", partial(report_relists, js, watchers, replicas=replicas)
                )
            if telemetry.metrics_enabled():
                # The artifacts target has schedules only where object stores are set.
                targets = [
                    t for t in Target if t is not Target.ARTIFACTS or self.config.artifacts.stores
                ]
                poll = partial(_poll_backlog, js, streams, targets, self._backlog_interval)
                supervisor.start("backlog", poll)
            if self._listen and ingress is not None:
                serve = partial(_serve_ingress, ingress, self._listen, stop)
                draining.append(supervisor.start("ingress", serve))
                log.info("ingress: accepting CloudEvents on http://%s/", self._listen)
            running = sorted({s.route.function for s in subscriptions})
            log.info("lapse is running: %s", ", ".join(running))
            self.ready.set()
            fatal = await supervisor.until_stopped()
            stop.set()  # everything stops together (the ingress waits for `stop`)
            dispatcher.stop()
            cancelled = [t for t in supervisor.running() if t not in draining]
            for task in cancelled:
                task.cancel()
            await drain([*draining, *cancelled], SHUTDOWN_GRACE)
            if fatal is not None:
                raise fatal
            log.info("lapse stopped")

    async def _watch_policies(
        self,
        resources: Resources,
        js: JetStreamContext,
        stop: asyncio.Event,
        supervisor: Supervisor,
    ) -> None:
        """Start the policy watcher and wait until it has read the policy objects (an API
        server away meanwhile is waited out, said in the log and in `lapse status`)."""
        # Re-planned runs go on the re-list lane: a live finish never waits behind them.
        publish = NatsPublisher(
            js, self.config.nats.streams, provenance=Provenance.READ_BY_LAPSE, relist=True
        )
        watcher = PolicyWatcher(
            resources.objects(),
            resources.policies(),
            self.config.kinds,
            publish.publish,
            lambda: namespace_names(resources.kube_client(), resources.kube_executor()),
            configured=self.config.policies,
            watch_timeout=self.config.kubernetes.watch_timeout,
        )
        self.policy_watcher = watcher
        supervisor.start("policy watcher", partial(watcher.run, stop))
        synced = asyncio.create_task(watcher.synced.wait())
        stopped = asyncio.create_task(stop.wait())
        waits: list[asyncio.Future[Any]] = [synced, stopped, supervisor.fatal]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            synced.cancel()
            stopped.cancel()
        if supervisor.fatal.done():
            raise supervisor.fatal.result()  # e.g. no right to read: say why

    async def _ensure_streams(self, js: JetStreamContext) -> None:
        for line in await ensure_streams(js, configured_streams(self.config.nats)):
            log.info("streams: %s", line)

    async def _subscribe(self, resources: Resources) -> list[Subscription]:
        """One subscription per route whose function has something to do here."""
        handlers: dict[str, Handler | None] = {}
        for route in self._routes:
            if route.function not in handlers:
                handlers[route.function] = await build_handler(route.function, resources)
                if handlers[route.function] is None:
                    # INFO: with no database target configured (every `make run`) the
                    # row-reaper is rightly idle; a warning there is a false alarm.
                    log.info(
                        "%s has nothing to do with this configuration: not started",
                        route.function,
                    )
        routes = [*self._routes]
        if self._watch:  # the watcher's re-list lane, beside each route it feeds
            routes += [lane for route in self._routes if (lane := relist_lane(route))]
        return [
            Subscription(route, handler)
            for route in routes
            if (handler := handlers[route.function]) is not None
        ]


async def _report_health(
    js: JetStreamContext,
    dispatcher: Callable[[], Dispatcher | None],
    supervisor: Supervisor,
    replicas: int,
) -> None:
    """While a function or a background task waits out an outage, say so where `lapse
    status` looks (every HEALTH_INTERVAL, and once when it is over)."""
    key = health.process_key()
    kv = None
    was_waiting = False
    while True:
        await asyncio.sleep(HEALTH_INTERVAL)
        running = dispatcher()  # None while starting
        now = asyncio.get_running_loop().time()
        waiting = running.outages.describe(now) if running is not None else {}
        tasks = {
            name: health.TaskWait(w.reason, w.since, w.next_try)
            for name, w in supervisor.waiting().items()
        }
        if not waiting and not tasks and not was_waiting:
            continue
        try:
            kv = kv or await health.bucket(js, replicas=replicas)
            await health.report(kv, key, waiting, tasks)
            was_waiting = bool(waiting or tasks)
        except Exception as exc:  # NATS reconnecting: the next round tries again
            log.debug("health report failed: %s", exc)


async def _watch_nats(js: JetStreamContext) -> None:
    """The NATS connection as a task of its own, so its outage is shown like any other.
    nats-py reconnects by itself (forever); meanwhile no loop of lapse fails loudly (a fetch
    only finds nothing), so without this a NATS away was seen only in the log's warnings.
    The wait is in the `lapse.outage.duration` gauge at once, and in `lapse status` when
    NATS is reachable by the process again but the wait is not over yet."""
    retrying = Retrying("reconnect")
    loop = asyncio.get_running_loop()
    next_report = 0.0
    while True:
        reason = unreachable(js)
        if reason is None:
            retrying.succeeded()
            next_report = 0.0
        elif loop.time() >= next_report:
            # nats-py tries every half second; this says so at the back-off's pace.
            next_report = loop.time() + retrying.delay(RetryLater(reason, delay=0.0))
        await asyncio.sleep(NATS_CHECK_INTERVAL)


async def _poll_backlog(
    js: JetStreamContext, streams: Streams, targets: list[Target], interval: float
) -> None:
    """Feed the stream-backed gauges; counted by the server, no message is read."""
    while True:
        try:
            pending = {
                target.value: await count_messages(
                    js, streams.schedule, f"{SCHEDULE_PREFIX}.{target.value}.>"
                )
                for target in targets
            }
            dlq = (await js.stream_info(streams.dlq)).state.messages
            telemetry.observe_backlog(pending, dlq)
        except Exception as exc:  # NATS reconnecting: the gauges keep their last values
            log.debug("backlog poll failed: %s", exc)
        await asyncio.sleep(interval)


async def _serve_ingress(ingress: Ingress, listen: str, stop: asyncio.Event) -> None:
    config = server_config(listen)
    await hypercorn.asyncio.serve(ingress, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    await ingress.flush()
