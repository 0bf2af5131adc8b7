"""The reaper's DELETE from the event loop (lapse/edges/kubernetes/loop_http.py): answers
the real API server gives only under load (429 with Retry-After, a chunked body), from a
small local HTTP server that answers them on demand. The DELETE itself against the real
kube-apiserver: tests/integration/test_object_reaper.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lapse.edges.kubernetes.client import api_failure, describe_api_error
from lapse.edges.kubernetes.loop_http import LoopHttp
from lapse.embedded.process import free_port

THROTTLED = json.dumps({"kind": "Status", "message": "too many requests, slow down"}).encode()


class Server:
    """Answers each request with the next of `answers`; counts connections and requests."""

    def __init__(self, answers: list[bytes]) -> None:
        self.answers = answers
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while self.answers:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            self.requests.append(head + await reader.readexactly(length))
            writer.write(self.answers.pop(0))
            await writer.drain()
        writer.close()


def http(port: int) -> LoopHttp:
    conf = client.Configuration()
    conf.host = f"http://127.0.0.1:{port}"
    conf.api_key = {"authorization": "Bearer t0ken"}
    made = LoopHttp.of(client.ApiClient(conf))
    assert made is not None
    return made


@pytest.fixture
async def serve() -> AsyncIterator[tuple[Server, int]]:
    server = Server([])
    port = free_port()
    listening = await asyncio.start_server(server.handle, "127.0.0.1", port)
    yield server, port
    listening.close()


async def test_a_429_is_the_clients_own_exception_with_its_retry_after(
    serve: tuple[Server, int],
) -> None:
    server, port = serve
    server.answers = [
        b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\nContent-Length: %d\r\n\r\n%s"
        % (len(THROTTLED), THROTTLED)
    ]
    with pytest.raises(ApiException) as raised:
        await http(port).request("DELETE", "/apis/g/v1/namespaces/n/r/x", b"{}", timeout=5)
    failure = api_failure(raised.value)
    assert failure is not None
    assert (failure.status, failure.retry_after) == (429, 3.0)
    assert failure.message == "too many requests, slow down"
    assert b"authorization: Bearer t0ken" in server.requests[0]


async def test_a_chunked_answer_is_read_whole_and_the_connection_kept(
    serve: tuple[Server, int],
) -> None:
    server, port = serve
    chunked = (
        b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{"a\r\n4\r\n":1}\r\n0\r\n\r\n'
    )
    plain = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    server.answers = [chunked, plain]
    loop_http = http(port)
    first = await loop_http.request("DELETE", "/a", b"{}", timeout=5)
    second = await loop_http.request("DELETE", "/b", b"{}", timeout=5)
    assert (first.body, second.body) == (b'{"a":1}', b"{}")
    assert server.connections == 1


async def test_a_refused_connection_names_the_server() -> None:
    port = free_port()  # nothing listens on it
    with pytest.raises(OSError) as raised:
        await http(port).request("DELETE", "/a", b"{}", timeout=5)
    assert describe_api_error(raised.value) == (
        f"the connection to the server 127.0.0.1:{port} was refused"
    )


def test_a_proxy_is_left_to_the_client() -> None:
    conf = client.Configuration()
    conf.host = "https://10.0.0.1:6443"
    conf.proxy = "http://proxy:3128"
    assert LoopHttp.of(client.ApiClient(conf)) is None
