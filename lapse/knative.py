"""Hosts one lapse handler as a func-python function, exactly as Knative serves it.

func-python calls `start(cfg)` synchronously and does not await it, so the connections are
opened in a task started from there; until that task succeeds, `ready()` says why not and
requests get 503 (the Broker retries them), so a pod never reports ready with a broken
configuration.

Replies: the handlers publish what they produce to NATS themselves, so a handled event is
answered 202 with no body; a transient failure is 503 (Broker retries); a bug is 500.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from functions.ports import Handler, RetryLater
from lapse.config import ConfigError, load_config
from lapse.resources import Resources
from lapse.wiring import build_handler

log = logging.getLogger(__name__)

Send = Callable[..., Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class FunctionShell:
    def __init__(self, name: str) -> None:
        self.name = name
        self._handler: Handler | None = None
        self._resources: Resources | None = None
        self._problem = "starting"
        self._setup: asyncio.Task[None] | None = None

    def start(self, cfg: Mapping[str, str]) -> None:
        self._setup = asyncio.get_event_loop().create_task(self._open(dict(cfg)))

    async def _open(self, env: dict[str, str]) -> None:
        try:
            config = load_config(env.get("LAPSE_CONFIG"), env=env)
            self._resources = Resources(config)
            self._handler = await build_handler(self.name, self._resources)
            self._problem = "" if self._handler else "nothing to do with this configuration"
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
        if self._resources is not None:
            asyncio.get_event_loop().create_task(self._resources.close())

    def alive(self) -> bool:
        return True

    def ready(self) -> tuple[bool, str]:
        return (self._handler is not None, self._problem or "ready")

    async def handle(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if self._handler is None:
            await _respond(send, 503, f"{self.name} not ready: {self._problem}")
            return
        event = scope["event"]
        try:
            await self._handler.handle(event)
        except RetryLater as exc:
            await _respond(send, 503, exc.reason, retry_after=exc.delay)
            return
        await _respond(send, 202, "")


async def _respond(send: Send, status: int, text: str, retry_after: float | None = None) -> None:
    headers = [[b"content-type", b"text/plain"]]
    if retry_after is not None:
        headers.append([b"retry-after", str(max(1, round(retry_after))).encode()])
    # func-python wraps `send`; `.http` passes a raw ASGI message through.
    raw = getattr(send, "http", send)
    await raw({"type": "http.response.start", "status": status, "headers": headers})
    await raw({"type": "http.response.body", "body": text.encode()})
