"""One API client, and the helpers every Kubernetes call shares.

The official client is synchronous, so every call goes through a bounded thread pool
(`request`) and never blocks the event loop; the reaper's DELETE alone is sent from the
event loop itself (`request_on_loop`, loop_http.py), the hot path of a drain. Every
request is counted (`lapse.kubernetes.requests`, and per deletion), and inside a trace it
is a CLIENT span named after its URL template, a child of the handler's span. Handlers never see the
client's exceptions: `api_failure` turns them into a status and a one-line message.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config import incluster_config
from opentelemetry.util.types import AttributeValue

from lapse.edges.kubernetes.loop_http import LoopHttp
from lapse.functions.ratelimit import TokenBucket
from lapse.telemetry import client_span, count_kubernetes_request, end_client_span
from lapse.telemetry.names import HTTP_METHOD, SERVER_ADDRESS, SERVER_PORT, URL_TEMPLATE

K8S_NAMESPACE = "k8s.namespace.name"


class RateLimiter:
    """kubectl's client-side limit (`kubernetes.qps`, `kubernetes.burst`): every request
    takes a token first and, when none is free, its thread waits for one. Calls run on
    worker threads (see `request`), so waiting never blocks the event loop; nothing is
    dropped."""

    def __init__(self, qps: float, burst: int) -> None:
        self._bucket = TokenBucket(qps, burst, now=time.monotonic())
        self._lock = threading.Lock()
        self.delayed = 0  # requests that had to wait for a token

    def wait(self) -> float:
        """Take a token, sleeping until it is due; the seconds slept."""
        delay = self.reserve()
        if delay > 0:
            time.sleep(delay)
        return delay

    def reserve(self) -> float:
        """Take a token without waiting; the seconds until it is due (a caller on the event
        loop sleeps them there)."""
        with self._lock:
            delay = self._bucket.reserve(time.monotonic())
            if delay > 0:
                self.delayed += 1
        return delay


# How long a request (a list, a get, a delete) waits for the API server to connect and
# then to send each part of its answer (`kubernetes.request_timeout`).
REQUEST_TIMEOUT = 30.0


class TimedApiClient(client.ApiClient):  # type: ignore[misc]
    """An ApiClient whose every request without a timeout of its own gets `request_timeout`
    (connect, and each read). The client's default is none: an API server that accepts and
    never answers (a black hole: packets dropped, a proxy that lost the connection) held a
    list, or a watch, forever, and a watcher never heard of the outage nor of its end."""

    def __init__(
        self, configuration: client.Configuration, request_timeout: float = REQUEST_TIMEOUT
    ) -> None:
        super().__init__(configuration)
        self.request_timeout = request_timeout

    def request(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("_request_timeout") is None:
            kwargs["_request_timeout"] = (self.request_timeout, self.request_timeout)
        return super().request(*args, **kwargs)


class RateLimitedApiClient(TimedApiClient):
    """An ApiClient whose every HTTP request (get, list, watch, delete) passes the limiter."""

    def __init__(
        self,
        configuration: client.Configuration,
        limiter: RateLimiter,
        request_timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        super().__init__(configuration, request_timeout)
        self.limiter = limiter

    def request(self, *args: Any, **kwargs: Any) -> Any:
        self.limiter.wait()
        return super().request(*args, **kwargs)


def request_timeout_of(api_client: client.ApiClient) -> float:
    """The timeout `api_client` gives a request without one of its own."""
    timeout = getattr(api_client, "request_timeout", None)
    return float(timeout) if isinstance(timeout, int | float) else REQUEST_TIMEOUT


def in_a_pod() -> bool:
    """What the kubelet gives every pod: the API server's address in the environment and a
    ServiceAccount token mounted (client-go's and kubectl's in-cluster signal)."""
    return bool(os.environ.get(incluster_config.SERVICE_HOST_ENV_NAME)) and os.path.exists(
        incluster_config.SERVICE_TOKEN_FILENAME
    )


def kubeconfig_found() -> bool:
    """A kubeconfig the client's usual lookup would read ($KUBECONFIG, ~/.kube/config)."""
    return bool(os.environ.get("KUBECONFIG")) or os.path.exists(
        os.path.expanduser(config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION)
    )


def load_api_client(
    kubeconfig: str | None = None,
    context: str | None = None,
    in_cluster: bool = False,
    *,
    pool_size: int = 16,
    qps: float | None = None,
    burst: int | None = None,
    request_timeout: float = REQUEST_TIMEOUT,
) -> client.ApiClient:
    """`pool_size` should match the threads making calls: urllib3's default pool (10) is
    smaller than lapse's thread pool, and each call past it pays a new TLS handshake.
    With `qps`, requests are limited to `qps` per second with bursts of `burst`. Every
    request waits at most `request_timeout` seconds to connect and for each read (a watch
    asks for longer reads: `KubeObjects.watch`).

    Found as kubectl finds it: an explicit kubeconfig or context, else $KUBECONFIG or
    ~/.kube/config, else, inside a pod, the pod's ServiceAccount (`in_cluster` forces it)."""
    configuration = client.Configuration()
    if in_cluster or (
        kubeconfig is None and context is None and not kubeconfig_found() and in_a_pod()
    ):
        config.load_incluster_config(client_configuration=configuration)
    else:
        if kubeconfig is not None and not os.path.isfile(os.path.expanduser(kubeconfig)):
            # The client would say "Invalid kube-config file. No configuration found.",
            # naming neither the file nor that it is missing.
            raise config.ConfigException(f"kubeconfig file {kubeconfig} not found")
        config.load_kube_config(
            config_file=kubeconfig, context=context, client_configuration=configuration
        )
    configuration.connection_pool_maxsize = pool_size
    # urllib3's default (3 tries more) would retry a read error or timeout, so a call blocked
    # up to four request timeouts before lapse heard of the outage and a DELETE whose answer
    # was lost was sent again blind; and it slept out a 429's Retry-After on the thread, then
    # raised without the status. Only a connection that could not be made is tried again
    # here; every answer, 429 and its Retry-After included, is the handler's to judge.
    configuration.retries = urllib3.Retry(
        total=2, connect=2, read=0, status=0, other=0, redirect=False,
        respect_retry_after_header=False, raise_on_status=False,
    )  # fmt: skip
    if qps is not None:
        limiter = RateLimiter(qps, burst or max(1, int(qps)))
        return RateLimitedApiClient(configuration, limiter, request_timeout)
    return TimedApiClient(configuration, request_timeout)


def continue_after_expiry(exc: ApiException) -> str | None:
    """A list's continue token expires with etcd compaction (410). The server then offers
    a token that continues without the list's snapshot; None if it offered none."""
    try:
        status = json.loads(exc.body or "")
    except (TypeError, ValueError):
        return None
    token = status.get("metadata", {}).get("continue") if isinstance(status, dict) else None
    return token if isinstance(token, str) and token else None


@dataclass(frozen=True)
class ApiCallFailure:
    """A failed API call: HTTP `status` (None when no response came back), the server's own
    message, and its Retry-After in seconds when it sent one."""

    status: int | None
    message: str
    retry_after: float | None = None


def api_failure(exc: BaseException) -> ApiCallFailure | None:
    """Describe an exception raised by the client, or None if it is not an API or transport
    failure (a bug, which the caller lets propagate)."""
    if isinstance(exc, ApiException):
        return ApiCallFailure(
            exc.status or None, _status_message(exc), _retry_after(exc.headers or {})
        )
    # urllib3 raises its own exceptions (MaxRetryError, timeouts) for connection failures;
    # OSError covers what escapes it (refused sockets, TLS).
    if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
        return ApiCallFailure(None, describe_connection_failure(exc))
    return None


def describe_connection_failure(exc: BaseException) -> str:
    """One line an operator can act on, as kubectl says it ("the connection to the server
    127.0.0.1:6443 was refused"), instead of urllib3's nested repr of its pool, URL and
    cause."""
    pool = getattr(exc, "pool", None)
    server = f"{pool.host}:{pool.port}" if pool is not None else "the API server"
    server = getattr(exc, "server", None) or server  # set by loop_http on a connection
    cause: BaseException = exc
    while isinstance(cause, urllib3.exceptions.MaxRetryError) and cause.reason is not None:
        cause = cause.reason
    text = str(cause)
    if isinstance(cause, urllib3.exceptions.NewConnectionError):
        if "refused" in text.lower():
            return (
                f"the connection to the server {server} was refused - "
                "did you specify the right host or port?"
            )
        if isinstance(cause, urllib3.exceptions.NameResolutionError):
            return f"the server {server} could not be resolved (no such host)"
        reason = text.rsplit(": ", 1)[-1]
        return f"no connection to the server {server}: {reason}"
    if isinstance(cause, urllib3.exceptions.ConnectTimeoutError):
        return f"the server {server} did not accept a connection in time (i/o timeout)"
    if isinstance(cause, urllib3.exceptions.ReadTimeoutError | TimeoutError):
        return f"the server {server} did not answer in time (i/o timeout)"
    if isinstance(cause, urllib3.exceptions.SSLError):
        return f"TLS with the server {server} failed: {text.rsplit(': ', 1)[-1]}"
    if isinstance(cause, urllib3.exceptions.ProtocolError):
        return f"the connection to the server {server} was broken: {text.split(': ', 1)[0]}"
    if isinstance(cause, ConnectionRefusedError):
        return f"the connection to the server {server} was refused"
    return f"the server {server}: {type(cause).__name__}: {text}"


def describe_api_error(exc: BaseException) -> str:
    """A failed call as one line: the API server's own message with its status, or the
    connection failure; never the client's dump of HTTP headers and body (a 429 printed
    whole is a screenful)."""
    if isinstance(exc, ApiException):
        failure = api_failure(exc)
        assert failure is not None
        status = f"{exc.status} {exc.reason}" if exc.status else "no status"
        line = f"the server answered {status}: {failure.message}"
        if failure.retry_after is not None:
            line += f" (retry after {failure.retry_after:g}s)"
        return line
    if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
        return describe_connection_failure(exc)
    return f"{type(exc).__name__}: {exc}"


def _status_message(exc: ApiException) -> str:
    # The API server answers errors with a Status object whose message is the useful part
    # ("... is forbidden: User x cannot delete resource ..."), not the HTTP reason.
    body = exc.body
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str) and body:
        try:
            status = json.loads(body)
        except ValueError:
            return body[:1000]
        if isinstance(status, dict) and isinstance(status.get("message"), str):
            return str(status["message"])
    return str(exc.reason or f"HTTP {exc.status}")


def _retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: rare from the API server, and the default delay is fine


def server_attributes(api_client: client.ApiClient) -> dict[str, AttributeValue]:
    url = urlsplit(str(api_client.configuration.host))
    attributes: dict[str, AttributeValue] = {SERVER_ADDRESS: url.hostname or ""}
    if url.port or url.scheme:
        attributes[SERVER_PORT] = url.port or (443 if url.scheme == "https" else 80)
    return attributes


async def request(
    executor: ThreadPoolExecutor,
    server: dict[str, AttributeValue],
    method: str,
    template: str,
    namespace: str | None,
    call: Callable[[], tuple[Any, int, Any]],
) -> Any:
    """Run one `*_with_http_info` call on the pool: counted, and a CLIENT span in a trace."""
    attributes: dict[str, AttributeValue] = {HTTP_METHOD: method, URL_TEMPLATE: template, **server}
    if namespace is not None:
        attributes[K8S_NAMESPACE] = namespace
    span = client_span(f"{method} {template}", attributes)
    status: int | None = None
    error: str | None = None
    try:
        data, status, _ = await asyncio.get_running_loop().run_in_executor(executor, call)
        return data
    except ApiException as exc:
        status = exc.status or None
        error = str(status) if status else type(exc).__name__
        raise
    except BaseException as exc:
        error = type(exc).__name__
        raise
    finally:
        count_kubernetes_request(method, status)
        end_client_span(span, status=status, error=error)


async def request_on_loop(
    http: LoopHttp,
    api_client: client.ApiClient,
    server: dict[str, AttributeValue],
    method: str,
    template: str,
    namespace: str | None,
    path: str,
    body: dict[str, Any],
    timeout: float | None,
) -> None:
    """`request`'s counterpart for a call made from the event loop (`LoopHttp`: the
    reaper's DELETE): the client's rate limit, then counted and a CLIENT span alike."""
    limiter = getattr(api_client, "limiter", None)
    if isinstance(limiter, RateLimiter) and (delay := limiter.reserve()) > 0:
        await asyncio.sleep(delay)
    attributes: dict[str, AttributeValue] = {HTTP_METHOD: method, URL_TEMPLATE: template, **server}
    if namespace is not None:
        attributes[K8S_NAMESPACE] = namespace
    span = client_span(f"{method} {template}", attributes)
    status: int | None = None
    error: str | None = None
    seconds = timeout if timeout is not None else request_timeout_of(api_client)
    try:
        answer = await http.request(method, path, json.dumps(body).encode(), timeout=seconds)
        status = answer.status
    except ApiException as exc:
        status = exc.status or None
        error = str(status) if status else type(exc).__name__
        raise
    except BaseException as exc:
        error = type(exc).__name__
        raise
    finally:
        count_kubernetes_request(method, status)
        end_client_span(span, status=status, error=error)


def timeout_kwargs(seconds: float | None) -> dict[str, Any]:
    """The client's per-request timeout keyword, when one is wanted: whole seconds, because
    the client takes only an int (or a tuple) and silently ignores a float, so a call to an
    API server that answers nothing (its etcd gone) waited for the server's own timeout, or
    forever."""
    return {"_request_timeout": max(1, math.ceil(seconds))} if seconds is not None else {}
