"""The embedded SeaweedFS admits only who holds its keys: every TCP port it listens on
(master, volume server, filer, S3 gateway, their gRPC ports) refuses an unauthenticated
GET, PUT or DELETE of anything that reads or changes data (401/403, or no HTTP answer at
all), its gRPC ports want a client certificate, while a client with the S3 keys still
reads, lists and deletes (lapse/embedded/seaweedfs.py).

What still answers without credentials, by SeaweedFS' design, and is allowed here by name:
health probes, the master's UI and the volume server's /status (the volumes' ids, sizes
and collections: no object, no key), the master's redirect of a file id to the volume
server (which refuses it), and 400/404/405 to requests that name nothing."""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import uuid
from pathlib import Path

import obstore
import pytest
from obstore.store import S3Store

from lapse.embedded.seaweedfs import REGION, EmbeddedSeaweedFS
from tests.conftest import ARTIFACT_BUCKET

# What a local user without the keys would try: the object through the filer (its HTTP
# API serves /buckets/<bucket>/<key>) and the volume server (by file id), the master's
# assignment of a writable file id (with a write token when JWTs are on), a collection's
# (= bucket's) deletion, the UIs and status pages.
PATHS = (
    "/",
    "/buckets/",
    "/buckets/{bucket}/{key}",
    "/{bucket}/{key}",
    "/dir/assign",
    "/dir/lookup?volumeId=1",
    "/dir/status",
    "/col/delete?collection={bucket}",
    "/vol/grow?count=1",
    "/vol/status",
    "/1,0123456789",
    "/ui/index.html",
    "/status",
)
REFUSED = {401, 403}
# Answered without credentials and carrying no data (see above).
STATUS_PAGES = {"/", "/ui/index.html", "/status", "/healthz", "/1,0123456789"}
NOTHING_THERE = {400, 404, 405}


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (from /proc: no tool needed)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def answer(port: int, method: str, path: str) -> int | str:
    """The HTTP status, or why there was none (a gRPC port speaks no HTTP/1.1)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request(method, path, body=b"forged" if method == "PUT" else None)
        return connection.getresponse().status
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__
    finally:
        connection.close()


# A client's first bytes in HTTP/2 (what gRPC speaks): the preface and an empty SETTINGS.
H2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def grpc_without_credentials(port: int) -> str | None:
    """How the port answers an HTTP/2 client with no certificate, in clear text and over
    TLS: 'plaintext' or 'tls' when it answered with HTTP/2 (SETTINGS), else None."""
    for how in ("plaintext", "tls"):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                sock: socket.socket = raw
                if how == "tls":
                    context = ssl.create_default_context()
                    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
                    context.set_alpn_protocols(["h2"])
                    sock = context.wrap_socket(raw)
                sock.sendall(H2_HELLO)
                head = sock.recv(9)
        except (OSError, ssl.SSLError):
            continue
        if len(head) == 9 and head[3] == 0x04:  # a SETTINGS frame: it speaks HTTP/2
            return how
    return None


def s3(server: EmbeddedSeaweedFS) -> S3Store:
    return S3Store(
        ARTIFACT_BUCKET,
        endpoint=server.endpoint,
        region=REGION,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
        client_options={"allow_http": True},
    )


@pytest.mark.late_build
async def test_no_port_answers_without_credentials(seaweedfs: EmbeddedSeaweedFS) -> None:
    assert seaweedfs.process is not None
    store = s3(seaweedfs)
    key = f"runs/auth-{uuid.uuid4().hex[:6]}/model.tgz"
    await obstore.put_async(store, key, b"the model")
    ports = listening_ports(seaweedfs.process.pid)
    if (master := getattr(seaweedfs, "master", None)) is not None:
        ports |= listening_ports(master.pid)
    assert set(seaweedfs.ports.values()) - {0} <= ports, ports

    answered: dict[str, int | str] = {}
    for port in sorted(ports):
        for path in (*PATHS, "/healthz"):
            target = path.format(bucket=ARTIFACT_BUCKET, key=key)
            for method in ("GET", "PUT", "DELETE"):
                answered[f"{method} :{port}{target}"] = answer(port, method, target)
    admitted = {
        request: status
        for request, status in answered.items()
        if isinstance(status, int)
        and status not in REFUSED | NOTHING_THERE
        and request.split(":", 1)[1].lstrip("0123456789") not in STATUS_PAGES
    }
    assert admitted == {}, f"answered without credentials: {admitted}"
    # The object itself, by the filer's path, through every port: refused or not there.
    by_path = {
        request: status
        for request, status in answered.items()
        if key in request and isinstance(status, int) and status not in REFUSED | {400, 404}
    }
    assert by_path == {}, by_path
    grpc = {port: how for port in ports if (how := grpc_without_credentials(port))}
    assert grpc == {}, f"gRPC without a client certificate: {grpc}"

    # Nothing above removed or changed it, and the keys still read, list and delete.
    assert bytes(await (await obstore.get_async(store, key)).bytes_async()) == b"the model"
    listed = [meta["path"] async for page in obstore.list(store, "runs/") for meta in page]
    assert key in listed
    await obstore.delete_async(store, key)
