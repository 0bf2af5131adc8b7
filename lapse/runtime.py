"""The whole pipeline in one process: watcher, dispatcher and every routed function.

`lapse up` runs this; so do the end-to-end tests and `lapse demo`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import hypercorn.asyncio
import hypercorn.config

from functions.ports import Handler
from lapse.bus import NatsPublisher
from lapse.clients.nats import ensure_streams, stream_configs
from lapse.config import LapseConfig
from lapse.dispatcher import Dispatcher, Subscription
from lapse.ingress import Ingress
from lapse.resources import Resources
from lapse.routing import Route, load_routes
from lapse.watcher import WorkflowWatcher
from lapse.wiring import build_handler

log = logging.getLogger(__name__)


class Pipeline:
    def __init__(
        self,
        config: LapseConfig,
        *,
        nats_url: str | None = None,
        watch: bool = True,
        routes: list[Route] | None = None,
        listen: str | None = None,
    ) -> None:
        self.config = config
        self._nats_url = nats_url
        self._watch = watch
        self._routes = routes if routes is not None else load_routes()
        self._listen = listen
        self.ready = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        async with Resources(self.config, nats_url=self._nats_url) as resources:
            js = await resources.jetstream()
            nats = self.config.nats
            for line in await ensure_streams(
                js,
                stream_configs(
                    nats.streams, replicas=nats.replicas, audit_max_age=nats.audit_max_age
                ),
            ):
                log.info("streams: %s", line)
            emitter = await resources.emitter()
            handlers: dict[str, Handler | None] = {}
            for route in self._routes:
                if route.function not in handlers:
                    handlers[route.function] = await build_handler(route.function, resources)
                    if handlers[route.function] is None:
                        log.warning(
                            "%s has nothing to do with this configuration: not started",
                            route.function,
                        )
            subscriptions = [
                Subscription(route, handler)
                for route in self._routes
                if (handler := handlers[route.function]) is not None
            ]
            dispatcher = Dispatcher(js, emitter, nats, subscriptions)
            tasks: list[asyncio.Task[Any]] = [
                asyncio.create_task(dispatcher.run(), name="dispatcher")
            ]
            if self._watch:
                publisher = NatsPublisher(js, nats.streams)
                watcher = WorkflowWatcher(resources.workflows(), publisher.publish, emitter.emit)
                tasks.append(asyncio.create_task(watcher.run(stop), name="watcher"))
            running = sorted(name for name, handler in handlers.items() if handler is not None)
            if self._listen:
                tasks.append(
                    asyncio.create_task(
                        _serve_ingress(NatsPublisher(js, nats.streams), self._listen, stop),
                        name="ingress",
                    )
                )
                log.info("ingress: accepting CloudEvents on http://%s/", self._listen)
            log.info("lapse is running: %s", ", ".join(running))
            self.ready.set()
            stopped = asyncio.create_task(stop.wait(), name="stop")
            done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            # Stop taking new work, let in-flight handlers finish, then close connections.
            dispatcher.stop()
            for task in tasks:
                if task.get_name() == "watcher":
                    task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            stopped.cancel()
            crashed = [r for t, r in zip(tasks, results, strict=True) if t in done and r]
            if crashed and isinstance(crashed[0], BaseException):
                raise crashed[0]
            log.info("lapse stopped")


async def _serve_ingress(publisher: NatsPublisher, listen: str, stop: asyncio.Event) -> None:
    config = hypercorn.config.Config()
    config.bind = [listen]
    config.accesslog = None
    await hypercorn.asyncio.serve(Ingress(publisher.publish), config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
