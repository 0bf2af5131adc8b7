"""Hosts one lapse handler as a func-python function, exactly as Knative serves it.

func-python calls `start(cfg)` synchronously and does not await it, so the connections are
opened in a task started from there; until that task succeeds, `ready()` says why not and
requests get 503 (the Broker retries them), so a pod never reports ready with a broken
configuration.

Replies: the handlers publish what they produce to NATS themselves, so a handled event is
answered 202 with no body; a transient failure is 503 (Broker retries); a bug is 500.

Telemetry is configured from the OTEL_* environment in `start` and flushed in `stop`, so
a function scaled to zero loses no spans; each request is a SERVER span from the
request's `traceparent` (the Broker's hop context).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry.trace import Status, StatusCode

from lapse.config import ConfigError, load_config
from lapse.functions.ports import Handler, RetryLater
from lapse.runtime import shutdown
from lapse.runtime.asgi import Receive, Scope, Send, respond
from lapse.runtime.registry import FOLLOWERS, RENAMED, build_handler
from lapse.runtime.resources import Resources
from lapse.runtime.senders import SenderCheck, refused
from lapse.runtime.trust import trust_of_request
from lapse.telemetry import Telemetry, TelemetryError, configure, record_retry, server_span
from lapse.telemetry.names import HTTP_STATUS

log = logging.getLogger(__name__)


class FunctionShell:
    def __init__(self, name: str) -> None:
        self.name = name
        self._handler: Handler | None = None
        self._resources: Resources | None = None
        self._problem = "starting"
        # Started, but the configuration gives this function nothing to do (the row-reaper
        # without a database target): Ready, so its Trigger resolves, and anything routed
        # to it is refused with the reason until the configuration gives it work.
        self._idle = False
        self._setup: asyncio.Task[None] | None = None
        # Ends the policy follower (docs/policies.md, "On the Knative path").
        self._stopping = asyncio.Event()
        self._follower: asyncio.Task[None] | None = None  # held: the loop keeps only weak refs
        self._closing: asyncio.Task[None] | None = None  # held, as the follower is
        self._telemetry = Telemetry()
        # Who may deliver events here (the Broker's Triggers): lapse/runtime/senders.py.
        self._senders = SenderCheck.from_env(os.environ)

    def start(self, cfg: Mapping[str, str]) -> None:
        try:
            self._telemetry = configure(f"lapse-{self.name}")
        except TelemetryError as exc:
            # func-python swallows exceptions from start(): ready() must say it instead.
            self._problem = f"telemetry: {exc}"
            log.error("%s not ready: %s", self.name, self._problem)
            return
        self._setup = asyncio.get_event_loop().create_task(self._open(dict(cfg)))

    async def _open(self, env: dict[str, str]) -> None:
        try:
            config = load_config(env.get("LAPSE_CONFIG"), env=env)
            self._resources = Resources(config)
            if RENAMED.get(self.name, self.name) in FOLLOWERS:
                # Imported here: only the followers' images carry the Kubernetes client.
                from lapse.runtime.policy_watcher import follow

                # The policy objects are read before the first event is decided.
                self._follower = await follow(self._resources, self._stopping)
            self._handler = await build_handler(self.name, self._resources)
            # Started: no problem left to report (a started pod logged "not ready: starting").
            self._problem = ""
            if self._handler is None:
                self._idle = True
                log.warning("%s ready, idle: nothing to do with this configuration", self.name)
            else:
                log.info("%s ready", self.name)
        except ConfigError as exc:
            self._problem = f"configuration: {exc}"
        except Exception as exc:
            self._problem = f"start-up failed: {exc}"
        if self._problem:
            log.error("%s not ready: %s", self.name, self._problem)

    async def started(self) -> None:
        """Wait for start-up (for in-process use and tests)."""
        if self._setup is not None:
            await self._setup

    def stop(self) -> None:
        self._stopping.set()
        loop = asyncio.get_event_loop()
        if self._resources is not None:
            self._closing = loop.create_task(self._resources.close())
        # asyncio.run cancels what is left and waits for all of it: a task that swallows
        # its cancellation is named and cancelled again (lapse/runtime/shutdown.py).
        shutdown.guard(loop)
        # Synchronous on purpose: the process may be gone right after func-python's stop.
        self._telemetry.shutdown()

    def alive(self) -> bool:
        return True

    def ready(self) -> tuple[bool, str]:
        if self._idle:
            return (True, "idle: nothing to do with this configuration")
        return (self._handler is not None, self._problem or "ready")

    async def handle(self, scope: Scope, receive: Receive, send: Any) -> None:
        # func-python's `send` takes CloudEvents; its `.http` passes raw ASGI messages.
        raw: Send = getattr(send, "http", send)
        if await refused(self._senders, scope, raw):
            return
        if self._handler is None:
            # 503 either way: the Broker keeps the event (retries, then the dead-letter
            # sink, from where `lapse dlq replay` delivers it once this is fixed).
            why = "nothing to do with this configuration" if self._idle else "not ready"
            await respond(raw, 503, f"{self.name}: {why} {self._problem}".rstrip())
            return
        event = scope["event"]
        method, path = str(scope.get("method", "POST")), str(scope.get("path", "/"))
        with server_span(event, scope.get("headers", []), method=method, path=path) as span:
            try:
                await self._handler.handle(event, trust_of_request())
            except RetryLater as exc:
                record_retry(self.name, "RetryLater")
                span.set_attribute(HTTP_STATUS, 503)
                span.set_status(Status(StatusCode.ERROR, exc.reason))
                await respond(raw, 503, exc.reason, retry_after=exc.delay)
                return
            except Exception as exc:
                # func-python answers 500 and the Broker delivers again: a retry, and a bug.
                record_retry(self.name, type(exc).__name__)
                span.set_attribute(HTTP_STATUS, 500)
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
                raise
            span.set_attribute(HTTP_STATUS, 202)
            await respond(raw, 202, "")
