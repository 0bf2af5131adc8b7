"""The reaper's DELETE, sent from the event loop: HTTP/1.1 (h11) on keep-alive connections.

The official client is synchronous: each call is a hop to a worker thread, urllib3 and
http.client's header parsing (the `email` package), then the client's deserialisation of
the answer: 1.36 ms of CPU a DELETE against the embedded kube-apiserver over TLS, the hot
path of a drain (bench/README.md, "Where lapse's CPU goes"). Only the DELETE goes this way;
every other call stays on the client. The protocol is h11's (framing, chunked bodies,
keep-alive state); only the sockets are asyncio's: about 0.3 ms of CPU a request against a
local server. httpx, built on the same h11, cost 1.8 ms a request on one connection and
8 ms at 64 in flight in the same measurement (its pool and anyio's locks), more than the
threaded client.

It speaks to the API server exactly as the client does: the same host, CA, client
certificate and `Authorization` header (read from the client's configuration on a worker
thread every `AUTH_FOR` seconds, since its refresh hook may run an exec plugin), with the
same per-request timeout. What it does not know how to do (a proxy, a host that is not
http(s), TLS without hostname checks tied to another name) is left to the client: `of()`
returns None and the caller keeps the threaded call.

A failed exchange is never sent again here (the client is configured the same way: a
DELETE whose answer was lost is the reaper's to judge on redelivery). An answer other than
2xx raises the client's own `ApiException`, with the server's body and headers, so the one
mapping of failures (`client.api_failure`) reads it as it reads the client's.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import quote, urlsplit

import h11
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3 import HTTPHeaderDict

# How long the Authorization header read from the client's configuration is used before
# it is read again (a token file rotated by the kubelet, an exec plugin's token expiring).
AUTH_FOR: Final = 10.0
# A connection idle longer than this is closed rather than reused: the server (or a load
# balancer in front of it) may have closed it meanwhile, and a DELETE sent on a dead
# connection fails without an answer.
IDLE_FOR: Final = 20.0
MAX_IDLE: Final = 64
READ_SIZE: Final = 64 * 1024


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    protocol: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))
    idle_since: float = field(default_factory=time.monotonic)

    def usable(self) -> bool:
        return (
            self.protocol.our_state is h11.IDLE
            and not self.reader.at_eof()
            and not self.writer.is_closing()
            and time.monotonic() - self.idle_since < IDLE_FOR
        )

    def close(self) -> None:
        self.writer.close()


@dataclass(frozen=True)
class Answer:
    status: int
    reason: str
    headers: HTTPHeaderDict
    body: bytes


class LoopHttp:
    """Requests to one API server from the running event loop, on a pool of keep-alive
    connections per loop."""

    def __init__(
        self,
        host: str,
        port: int,
        tls: ssl.SSLContext | None,
        server_hostname: str | None,
        auth: Callable[[], Mapping[str, str]],
    ) -> None:
        self._host = host
        self._port = port
        self._tls = tls
        self._server_hostname = server_hostname
        self._auth = auth
        self._headers: tuple[float, list[tuple[str, str]]] | None = None
        self._idle: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[_Connection]] = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def of(cls, api_client: client.ApiClient) -> LoopHttp | None:
        """For the API server `api_client` talks to, or None where the client's own call
        must stay (see the module's docstring)."""
        conf = api_client.configuration
        url = urlsplit(str(conf.host))
        if url.scheme not in ("http", "https") or not url.hostname or url.path.strip("/"):
            return None
        if conf.proxy or getattr(conf, "assert_hostname", None) is not None:
            return None
        if conf.username or conf.password:  # basic auth: not in `auth_settings`
            return None
        tls = None
        if url.scheme == "https":
            tls = ssl.create_default_context(cafile=conf.ssl_ca_cert or None)
            if conf.cert_file:
                tls.load_cert_chain(conf.cert_file, conf.key_file or None)
            if not conf.verify_ssl:
                tls.check_hostname = False
                tls.verify_mode = ssl.CERT_NONE
        port = url.port or (443 if url.scheme == "https" else 80)
        server_hostname = getattr(conf, "tls_server_name", None) or url.hostname
        return cls(url.hostname, port, tls, server_hostname, _auth_of(conf))

    async def request(
        self,
        method: str,
        path: str,
        body: bytes,
        *,
        timeout: float,
        content_type: str = "application/json",
    ) -> Answer:
        """One request; its answer when the status is 2xx, else the client's
        `ApiException`. OSError (TimeoutError included) when no answer came."""
        headers = [
            *await self._head(),
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
        ]
        connection: _Connection | None = None
        try:
            async with asyncio.timeout(timeout):
                connection = await self._connection()
                protocol = connection.protocol
                connection.writer.write(
                    protocol.send(h11.Request(method=method, target=quote(path), headers=headers))
                    + protocol.send(h11.Data(data=body))
                    + protocol.send(h11.EndOfMessage())
                )
                answer = await _read_answer(connection)
        except (TimeoutError, h11.ProtocolError, ConnectionError, ssl.SSLError) as exc:
            if connection is None and isinstance(exc, ConnectionError):
                raise  # no connection at all (refused, reset): `_connection` named the server
            if connection is not None:
                connection.close()
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"the server {self._host}:{self._port} did not answer") from exc
            raise ConnectionError(
                f"the connection to the server {self._host}:{self._port} was broken: "
                f"{type(exc).__name__}"
            ) from exc
        except BaseException:
            if connection is not None:
                connection.close()
            raise
        if protocol.our_state is h11.DONE and protocol.their_state is h11.DONE:
            protocol.start_next_cycle()
            self._release(connection)
        else:  # the server said "Connection: close", or the exchange did not end cleanly
            connection.close()
        if not 200 <= answer.status < 300:
            error = ApiException(status=answer.status, reason=answer.reason)
            error.body = answer.body.decode("utf-8", "replace")
            error.headers = answer.headers
            raise error
        return answer

    async def _head(self) -> list[tuple[str, str]]:
        """Host and Authorization, read again every AUTH_FOR seconds (on a worker thread:
        the client's refresh hook may run a command)."""
        now = time.monotonic()
        if self._headers is None or now - self._headers[0] > AUTH_FOR:
            # The loop's default pool, not the Kubernetes calls' (it may be all busy).
            auth = await asyncio.get_running_loop().run_in_executor(None, self._auth)
            head = [("Host", f"{self._host}:{self._port}"), *auth.items()]
            head.append(("Accept", "application/json"))
            self._headers = (now, head)
        return self._headers[1]

    async def _connection(self) -> _Connection:
        idle = self._idle.setdefault(asyncio.get_running_loop(), [])
        while idle:
            connection = idle.pop()
            if connection.usable():
                return connection
            connection.close()
        try:
            reader, writer = await asyncio.open_connection(
                self._host,
                self._port,
                ssl=self._tls,
                server_hostname=self._server_hostname if self._tls else None,
            )
        except OSError as exc:
            exc.server = f"{self._host}:{self._port}"  # type: ignore[attr-defined]  # for describe_connection_failure
            raise
        return _Connection(reader, writer)

    def _release(self, connection: _Connection) -> None:
        idle = self._idle.setdefault(asyncio.get_running_loop(), [])
        if len(idle) >= MAX_IDLE:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    def close(self) -> None:
        """Close the idle connections (those of loops still alive)."""
        for idle in list(self._idle.values()):
            for connection in idle:
                connection.close()
            idle.clear()


_SHARED: weakref.WeakKeyDictionary[client.ApiClient, LoopHttp | None] = weakref.WeakKeyDictionary()


def loop_http_of(api_client: client.ApiClient) -> LoopHttp | None:
    """The one `LoopHttp` of `api_client` (its connections shared by every caller), or None
    where the client's own call must stay."""
    if api_client not in _SHARED:
        _SHARED[api_client] = LoopHttp.of(api_client)
    return _SHARED[api_client]


def close_loop_http(api_client: client.ApiClient) -> None:
    http = _SHARED.pop(api_client, None)
    if http is not None:
        http.close()


def _auth_of(conf: client.Configuration) -> Callable[[], dict[str, str]]:
    def headers() -> dict[str, str]:
        settings = conf.auth_settings()
        return {
            str(s["key"]): str(s["value"])
            for s in settings.values()
            if s.get("in") == "header" and s.get("value")
        }

    return headers


async def _read_answer(connection: _Connection) -> Answer:
    """The answer to the request just sent, read whole (h11 frames it)."""
    protocol = connection.protocol
    response: h11.Response | None = None
    body: list[bytes] = []
    while True:
        event = protocol.next_event()
        if event is h11.NEED_DATA:
            # b"" at the end of the stream: h11 turns a premature one into a ProtocolError.
            protocol.receive_data(await connection.reader.read(READ_SIZE))
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            break
        elif isinstance(event, h11.ConnectionClosed):
            raise ConnectionError("the server closed the connection before answering")
    assert response is not None  # h11 gives the Response before any Data or the end
    headers = HTTPHeaderDict()
    for name, value in response.headers:
        headers.add(name.decode("latin-1"), value.decode("latin-1"))
    return Answer(response.status_code, response.reason.decode("latin-1"), headers, b"".join(body))
