"""The ASGI types lapse's HTTP entry points share (the ingress, the Knative function shell,
the bridge's health, the dead-letter sink), their one way to answer with a status and a
line of text, and the one gate in front of an endpoint that takes POSTed CloudEvents."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import hypercorn.config

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def respond(send: Send, status: int, text: str, *, retry_after: float | None = None) -> None:
    """A plain-text answer; `retry_after` (seconds, rounded up to at least 1) tells a sender
    that retries (the Knative Broker) when to come back."""
    headers = [(b"content-type", b"text/plain; charset=utf-8")]
    if retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(retry_after))).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text.encode()})


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer the server's lifespan messages (nothing to set up or tear down)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def posted_headers(scope: Scope, receive: Receive, send: Send) -> dict[str, str] | None:
    """For an endpoint that takes POSTed CloudEvents: answers lifespan, health probes
    (`/healthz`, `/readyz`) and anything but POST itself and returns None; for a POST,
    returns its headers, names lower-cased, for the caller to handle."""
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return None
    if scope["type"] != "http":
        return None
    if scope["path"] in ("/healthz", "/readyz"):
        await respond(send, 200, "ok")
        return None
    if scope["method"] != "POST":
        await respond(send, 405, "POST a CloudEvent")
        return None
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def server_config(bind: str) -> hypercorn.config.Config:
    """Hypercorn's settings for an endpoint on `bind` (HOST:PORT): no access log, and its
    own lines ("Running on ...", errors) through lapse's logging, in lapse's format. With
    hypercorn's default (`errorlog="-"`) it added a handler of its own: a plain line in
    `--log-format json`, and every line twice in text (its handler, then lapse's)."""
    import hypercorn.config

    config = hypercorn.config.Config()
    config.bind = [bind]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


# Where an endpoint with no address of its own listens (metrics beside an ingress turned off).
LOOPBACK = "127.0.0.1"


def host_of(bind: str | None) -> str | None:
    """The address part of hypercorn's `HOST:PORT` (`[::1]:8080` gives `::1`); None when
    `bind` is empty or names no host (a unix socket)."""
    if not bind or bind.startswith(("unix:", "fd://")):
        return None
    host, sep, _ = bind.rpartition(":")
    if not sep or not host:
        return None
    return host.removeprefix("[").removesuffix("]")
