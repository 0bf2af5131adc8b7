"""The one classification of a background task's failure, and the supervisor that waits
out every fault but a fatal one (lapse.runtime.faults.fault_of, lapse.runtime.supervisor).
The end-to-end proof, through `lapse up`, is tests/e2e/test_supervision.py."""

from __future__ import annotations

import asyncio
import json

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from nats import errors as nats_errors
from nats.js import errors as js_errors

from lapse.config import ConfigError
from lapse.functions.ports import RetryLater
from lapse.runtime.faults import fault_of
from lapse.runtime.outages import Backoff
from lapse.runtime.supervisor import Retrying, Supervisor

QUICK = Backoff(first=0.01, cap=0.05, jitter=0.0)


def refused() -> urllib3.exceptions.MaxRetryError:
    pool = urllib3.HTTPSConnectionPool("127.0.0.1", 6443)
    cause = urllib3.exceptions.NewConnectionError(pool, "[Errno 111] Connection refused")
    return urllib3.exceptions.MaxRetryError(pool, "/apis/lapse.dev/v1alpha1/x", cause)


def answered(status: int, retry_after: str | None = None) -> ApiException:
    exc = ApiException(status=status, reason="why")
    exc.body = json.dumps({"message": f"status {status}"})
    exc.headers = {"Retry-After": retry_after} if retry_after else {}
    return exc


@pytest.mark.parametrize(
    ("exc", "says"),
    [
        (refused(), "API server unreachable (the connection to the server 127.0.0.1:6443 was "),
        (ConnectionResetError(104, "Connection reset by peer"), "connection failed"),
        (urllib3.exceptions.ProtocolError("Connection aborted."), "API server unreachable"),
        (answered(503), "API server unavailable (answered 503: status 503)"),
        (answered(500), "API server unavailable"),
        (answered(408), "API server unavailable"),
        (nats_errors.ConnectionClosedError(), "NATS unavailable"),
        (nats_errors.TimeoutError(), "NATS unavailable"),
        (TimeoutError("read timed out"), "timed out"),
        (RetryLater("database unreachable", 7.0), "database unreachable"),
        (
            urllib3.exceptions.ReadTimeoutError(None, "/apis", "Read timed out."),  # type: ignore[arg-type]
            "API server unreachable",
        ),
        (
            js_errors.NotFoundError(code=404, err_code=10059, description="stream not found"),
            "NATS stream not found, waiting for it",
        ),
    ],
)
def test_an_outage_of_a_dependency_is_transient(exc: BaseException, says: str) -> None:
    fault = fault_of(exc)
    assert not fault.fatal and not fault.unexpected
    assert fault.reason.startswith(says) or says in fault.reason, fault.reason


def test_a_429_is_transient_and_keeps_its_retry_after() -> None:
    fault = fault_of(answered(429, retry_after="12"))
    assert not fault.fatal and fault.retry_after == 12.0
    assert QUICK.delay(1, fault.retry_after) >= 12.0


@pytest.mark.parametrize(
    "exc",
    [answered(401), ConfigError(["nats.url: missing"]), ConfigException("bad")],
)
def test_what_retrying_cannot_change_is_fatal(exc: BaseException) -> None:
    assert fault_of(exc).fatal


def test_a_403_is_waited_out_not_fatal() -> None:
    # RBAC is granted while lapse runs: exiting would make a CrashLoopBackOff of it.
    fault = fault_of(answered(403))
    assert not fault.fatal and not fault.unexpected
    assert "RBAC" in fault.reason


@pytest.mark.parametrize("exc", [KeyError("metadata"), answered(422)])
def test_anything_else_is_unexpected_and_waited_out(exc: BaseException) -> None:
    fault = fault_of(exc)
    assert fault.unexpected and not fault.fatal


async def test_a_task_failing_transiently_is_started_again_and_shows_why_meanwhile() -> None:
    stop = asyncio.Event()
    supervisor = Supervisor(stop, backoff=QUICK)
    runs = 0
    healthy = asyncio.Event()

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs <= 3:
            raise refused()
        healthy.set()
        await stop.wait()

    seen: list[str] = []

    async def watch() -> None:
        while not healthy.is_set():
            if (wait := supervisor.waiting().get("flaky")) is not None:
                seen.append(wait.reason)
            await asyncio.sleep(0.001)

    task = supervisor.start("flaky", flaky)
    await asyncio.wait_for(asyncio.gather(healthy.wait(), watch()), timeout=5)
    assert runs == 4 and not task.done() and not supervisor.fatal.done()
    assert seen and all(r.startswith("API server unreachable") for r in seen), seen
    stop.set()
    await asyncio.wait_for(task, timeout=1)


async def test_a_loop_inside_a_task_reports_its_wait_and_its_recovery() -> None:
    stop = asyncio.Event()
    supervisor = Supervisor(stop, backoff=QUICK)
    failing = asyncio.Event()
    recover = asyncio.Event()
    recovered = asyncio.Event()

    async def watcher() -> None:
        retrying = Retrying("listing things", QUICK)
        while not recover.is_set():
            failing.set()
            await retrying.wait_out(answered(503))
        retrying.succeeded()
        recovered.set()
        await stop.wait()

    task = supervisor.start("watcher", watcher)
    await asyncio.wait_for(failing.wait(), timeout=1)
    await asyncio.sleep(0.05)
    wait = supervisor.waiting()["watcher"]
    assert "API server unavailable" in wait.reason and wait.tries >= 1
    assert wait.next_try >= wait.since
    recover.set()
    await asyncio.wait_for(recovered.wait(), timeout=1)
    assert supervisor.waiting() == {}
    stop.set()
    await asyncio.wait_for(task, timeout=1)


async def test_a_fatal_failure_ends_the_task_and_is_handed_to_the_process() -> None:
    stop = asyncio.Event()
    supervisor = Supervisor(stop, backoff=QUICK)
    runs = 0

    async def forbidden() -> None:
        nonlocal runs
        runs += 1
        raise answered(401)

    task = supervisor.start("watcher", forbidden)
    fatal = await asyncio.wait_for(supervisor.fatal, timeout=1)
    assert isinstance(fatal, ApiException) and fatal.status == 401
    await asyncio.wait_for(task, timeout=1)
    assert runs == 1, "never retried"


async def test_a_stop_during_the_back_off_ends_the_task_at_once() -> None:
    stop = asyncio.Event()
    supervisor = Supervisor(stop, backoff=Backoff(first=60.0, cap=60.0))

    async def away() -> None:
        raise refused()

    task = supervisor.start("watcher", away)
    for _ in range(100):
        if "watcher" in supervisor.waiting():
            break
        await asyncio.sleep(0.01)
    assert supervisor.waiting()["watcher"].tries == 1
    stop.set()
    await asyncio.wait_for(task, timeout=1)
    assert not supervisor.fatal.done()
