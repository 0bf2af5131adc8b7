"""A failed Kubernetes call reads as one line an operator can act on, as kubectl says it."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lapse.edges.kubernetes.client import describe_api_error, load_api_client
from lapse.embedded.process import free_port
from lapse.runtime.faults import fault_of


def _kubeconfig(tmp_path: Path, server: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": True}}
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    return str(path)


def test_a_refused_connection_names_the_server(tmp_path: Path) -> None:
    port = free_port()  # nothing listens on it
    api = load_api_client(_kubeconfig(tmp_path, f"https://127.0.0.1:{port}"))
    with pytest.raises(Exception) as caught:
        client.CoreV1Api(api).list_namespace(_request_timeout=5)
    line = describe_api_error(caught.value)
    assert line == (
        f"the connection to the server 127.0.0.1:{port} was refused - "
        "did you specify the right host or port?"
    )


def test_a_429_is_one_line_without_headers() -> None:
    error = ApiException(status=429, reason="Too Many Requests")
    error.headers = {"Retry-After": "3", "Audit-Id": "x", "Content-Type": "application/json"}
    error.body = '{"kind":"Status","message":"too many requests, please try again later"}'
    line = describe_api_error(error)
    assert line == (
        "the server answered 429 Too Many Requests: too many requests, please try again "
        "later (retry after 3s)"
    )
    assert "\n" not in line and "Audit-Id" not in line


def test_a_server_that_accepts_and_never_answers_times_out_as_an_outage(tmp_path: Path) -> None:
    """A black hole (connected, never answered): without a default timeout the call waited
    forever. A loopback socket that accepts and reads nothing stands in for the API server:
    only the client's timeout is under test."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        kubeconfig = _kubeconfig(tmp_path, f"https://127.0.0.1:{port}")
        api = load_api_client(kubeconfig, request_timeout=0.5)
        started = time.monotonic()
        with pytest.raises(Exception) as caught:
            client.CoreV1Api(api).list_namespace()
        took = time.monotonic() - started
    assert took < 5, took
    assert describe_api_error(caught.value) == (
        f"the server 127.0.0.1:{port} did not answer in time (i/o timeout)"
    )
    fault = fault_of(caught.value)
    assert not fault.fatal and not fault.unexpected, fault
