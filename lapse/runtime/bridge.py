"""The bridge: due events and cleanup outcomes leave NATS for an HTTP sink (the Broker).

On Knative the delay still lives in NATS message schedules; when one fires, its due event
must reach the Broker so the reapers' Triggers see it. The reapers publish their outcomes
(`dev.lapse.cleanup.completed.v1`) to the audit stream; the bridge delivers those to the
Broker too, so an extension (a notifier, an artifact cleaner: examples/notify-on-cleanup)
needs only its own Trigger. The bridge is the local dispatcher with one subscription per
route (shared durable consumers, so replicas split the work) whose handler POSTs each
event to the sink in binary content mode, the way a Knative ContainerSource or
SinkBinding is given `K_SINK`:

- 2xx: delivered, the message is acked;
- no answer, 404, 408, 409, 429, 5xx: what the Broker itself retries, so it is waited out
  with the dispatcher's back-off (`Retry-After` honoured), never dead-lettered;
- any other 4xx: the sink will refuse it again; after `nats.max_deliver` tries it goes to
  the dead letters with the sink's answer.

The POST continues the trace: its `traceparent` header is the dispatcher's CONSUMER span,
which links back to where the deletion was scheduled (docs/architecture.md).

Its dispatchers and health server run under the Supervisor (lapse/runtime/supervisor.py),
as `lapse up`'s tasks do: NATS away, or a stream not made yet, is waited out and the task
started again; only a configuration error ends the bridge, saying why.

Telemetry comes from the OTEL_* environment (service `lapse-bridge`), as for `lapse up`.

Outcomes have a dispatcher of their own: a slow or failing subscriber of outcomes holds
only outcome deliveries, never a due event. Their durable consumer starts at the end of
the audit stream when it is created (an upgrade does not replay the audit history to the
Broker); from then on each outcome is delivered at least once.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Final

import httpx
import hypercorn.asyncio
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings.http import to_binary_event
from opentelemetry import propagate

from lapse import telemetry
from lapse.config import LapseConfig
from lapse.errors import LapseError
from lapse.events.types import EventType
from lapse.functions.ports import RetryLater
from lapse.functions.trust import Trust
from lapse.runtime.asgi import (
    LOOPBACK,
    Receive,
    Scope,
    Send,
    host_of,
    lifespan,
    respond,
    server_config,
)
from lapse.runtime.dispatcher import Dispatcher, Subscription
from lapse.runtime.resources import Resources
from lapse.runtime.routing import Route
from lapse.runtime.senders import bearer_header
from lapse.runtime.supervisor import Supervisor, drain

log = logging.getLogger(__name__)

ROUTE: Final = Route(name="bridge-due", function="bridge", filters={"type": EventType.CLEANUP_DUE})
OUTCOMES: Final = Route(
    name="bridge-outcomes", function="bridge", filters={"type": EventType.CLEANUP_COMPLETED}
)
# What Knative's Broker retries itself (network errors and 5xx too).
RETRIED: Final = frozenset({404, 408, 409, 429})
REQUEST_TIMEOUT: Final = 30.0
# How long in-flight deliveries may take to finish after a stop before they are cut short.
SHUTDOWN_GRACE: Final = 20.0


class SinkRefused(LapseError):
    """The sink answered with a 4xx it would answer again."""


class SinkForwarder:
    """A handler that delivers each event to an HTTP sink and produces nothing itself."""

    def __init__(self, sink: str, client: httpx.AsyncClient) -> None:
        self.sink = sink
        self._client = client

    async def handle(
        self, event: BaseCloudEvent, trust: Trust = Trust.CLAIM
    ) -> list[BaseCloudEvent]:
        # `trust` stays here: over HTTP the receiver takes everything as a claim
        # (lapse/runtime/trust.py), so nothing of it is sent on.
        message = to_binary_event(event)
        headers = dict(message.headers)
        propagate.inject(headers)  # the hop: this delivery's span
        headers.update(bearer_header())  # who sends: the Broker checks (EventPolicy)
        try:
            response = await self._client.post(self.sink, headers=headers, content=message.body)
        except httpx.TransportError as exc:
            raise RetryLater(f"sink {self.sink} unreachable: {type(exc).__name__}: {exc}") from exc
        status = response.status_code
        if 200 <= status < 300:
            return []
        text = " ".join(response.text.split())[:200]
        if status in RETRIED or status >= 500:
            raise RetryLater(f"sink answered {status}: {text}", _retry_after(response))
        raise SinkRefused(f"sink refused the event: HTTP {status}: {text}")


def _retry_after(response: httpx.Response) -> float:
    try:
        return float(response.headers.get("retry-after", "1"))
    except ValueError:
        return 1.0


class Bridge:
    """`lapse bridge`: consume due events, deliver them to `sink`; health on `listen`."""

    def __init__(
        self,
        config: LapseConfig,
        sink: str,
        *,
        listen: str | None,
        metrics_host: str | None = None,
    ) -> None:
        self.config = config
        self.sink = sink
        self._listen = listen
        self._metrics_host = metrics_host
        self.ready = asyncio.Event()
        self.supervisor: Supervisor | None = None

    async def run(self, stop: asyncio.Event) -> None:
        # From the OTEL_* environment, as `lapse up` and the functions do: without it the
        # CONSUMER span that links a due event back to where it was scheduled, and the
        # traceparent the POST carries on, existed nowhere on Knative.
        exporting = telemetry.configure(
            "lapse-bridge",
            metrics_host=self._metrics_host,
            http_host=host_of(self._listen) or LOOPBACK,
        )
        try:
            await self._run(stop)
        finally:
            exporting.shutdown()

    async def _run(self, stop: asyncio.Event) -> None:
        async with (
            Resources(self.config) as resources,
            httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as client,
        ):
            js = await resources.jetstream()
            emitter = await resources.emitter()
            forwarder = SinkForwarder(self.sink, client)
            # Every task under one supervisor, as in `lapse up`: a dependency's fault (NATS
            # away, a stream not there yet) is waited out and started again, never the
            # end of the bridge; a configuration error ends it, saying why.
            supervisor = self.supervisor = Supervisor(stop)
            dispatchers = {
                route.name: Dispatcher(
                    js, emitter, self.config.nats, [Subscription(route, forwarder, from_now=new)]
                )
                for route, new in ((ROUTE, False), (OUTCOMES, True))
            }
            # The dispatchers finish their in-flight deliveries when stopped.
            draining = [supervisor.start(name, d.run) for name, d in dispatchers.items()]
            if self._listen:
                draining.append(supervisor.start("health", partial(self._serve_health, stop)))
            self.ready.set()
            log.info(
                "bridge: delivering %s and %s to %s", ROUTE.subject, OUTCOMES.subject, self.sink
            )
            fatal = await supervisor.until_stopped()
            stop.set()
            self.ready.clear()
            for dispatcher in dispatchers.values():
                dispatcher.stop()
            await drain(draining, SHUTDOWN_GRACE)
            if fatal is not None:
                raise fatal

    async def _serve_health(self, stop: asyncio.Event) -> None:
        config = server_config(self._listen or "")
        await hypercorn.asyncio.serve(self._health, config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/healthz":
            await respond(send, 200, "ok")
        elif scope["path"] == "/readyz":
            ready = self.ready.is_set()
            await respond(send, 200 if ready else 503, "ready" if ready else "starting")
        else:
            await respond(send, 404, "health: /healthz, /readyz")
