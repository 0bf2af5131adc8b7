"""The connections a process holds, opened once from the configuration and closed together.

Each is opened on first use, so a command or function only connects to what it needs
(`lapse plan` never touches NATS; the row-reaper never touches Kubernetes). The Kubernetes
client and SQLAlchemy are imported there too, when their connection is first opened: a
function's image carries only the clients that function uses (images/README.md), so this
module, which every function loads, must not import the others'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from lapse.config import LapseConfig
from lapse.edges import nats
from lapse.edges.publishing import NatsEmitter
from lapse.edges.schedules import NatsScheduleStore
from lapse.errors import LapseError
from lapse.functions.policy_objects import PolicyBook
from lapse.runtime.outages import PatientEmitter

if TYPE_CHECKING:
    from kubernetes import client
    from sqlalchemy.ext.asyncio import AsyncEngine

    from lapse.edges.kubernetes import KubeObjects, OwnDeletions, Workflows

# The official Kubernetes client is synchronous: its calls run on this many threads, which
# also bounds how many API requests one process has in flight.
KUBE_THREADS = 16
# Closing one connection (NATS drain, the database pool) waits no longer than this.
CLOSE_TIMEOUT = 5.0

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


class DaemonThreadPool(ThreadPoolExecutor):
    """A fixed pool of daemon threads for blocking client calls (the Kubernetes client).

    A ThreadPoolExecutor's threads are joined when the interpreter exits, so one call
    blocked on a server that takes requests and answers none (a kube-apiserver whose etcd
    is gone) held `lapse up` for minutes after it had stopped: the root of the shutdown
    hang. A daemon thread does not: once lapse has given up on the call (its due event was
    not acknowledged and is delivered again) the process exits without it. Only `submit`
    and `shutdown` are used; the base class is kept for the type the edges expect."""

    def __init__(self, threads: int, name: str) -> None:
        super().__init__(threads, thread_name_prefix=name)
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._closed = False
        self._workers = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
            for i in range(threads)
        ]
        for worker in self._workers:
            worker.start()

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        if self._closed:
            raise RuntimeError("cannot schedule new calls after shutdown")
        future: Future[T] = Future()
        self._calls.put((future, lambda: fn(*args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        if cancel_futures:
            with contextlib.suppress(queue.Empty):
                while (queued := self._calls.get_nowait()) is not None:
                    queued[0].cancel()
        for _ in self._workers:
            self._calls.put(None)
        if wait:
            for worker in self._workers:
                worker.join()

    def _work(self) -> None:
        # One call per frame of `_run`: a worker waiting for its next call must hold nothing
        # of its last one. Kept in this loop's locals, each idle thread's last result stayed
        # alive, and after a re-list that was a page of 500 objects per thread (measured:
        # RSS +26 MiB after planning 20,000 runs at start, +17 MiB without it).
        while self._run(self._calls.get()):
            pass

    @staticmethod
    def _run(call: tuple[Future[Any], Callable[[], Any]] | None) -> bool:
        """Run one call into its future; False once told to stop."""
        if call is None:
            return False
        future, run = call
        if future.set_running_or_notify_cancel():
            try:
                result = run()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
        return True


class MissingSetting(LapseError):
    """A command needs a server that the configuration does not name."""


class Resources:
    def __init__(self, config: LapseConfig, *, nats_url: str | None = None) -> None:
        self.config = config
        self._nats_url = nats_url or config.nats.url
        self._nc: NATS | None = None
        self._api_client: client.ApiClient | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._engine: AsyncEngine | None = None
        self._own_deletions: OwnDeletions | None = None
        self._policies: PolicyBook | None = None

    async def __aenter__(self) -> Resources:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def jetstream(self) -> JetStreamContext:
        if self._nc is None:
            if not self._nats_url:
                raise MissingSetting(
                    "nats.url is not set (LAPSE_NATS__URL); `lapse up` starts an embedded server"
                )
            self._nc = await nats.connect(self._nats_url, config=self.config.nats)
        return self._nc.jetstream()

    async def schedules(self) -> NatsScheduleStore:
        return NatsScheduleStore(await self.jetstream(), self.config.nats.streams)

    async def emitter(self) -> PatientEmitter:
        """Where handlers emit their outcomes: waiting out a stream leader's election in
        place, so an outcome stays the one the handler reached (lapse/runtime/outages.py)."""
        return PatientEmitter(NatsEmitter(await self.jetstream(), self.config.nats.streams))

    def kube_client(self) -> client.ApiClient:
        if self._api_client is None:
            from lapse.edges.kubernetes import load_api_client

            k = self.config.kubernetes
            self._api_client = load_api_client(
                str(k.kubeconfig) if k.kubeconfig else None,
                k.context,
                k.in_cluster,
                pool_size=KUBE_THREADS,
                qps=k.qps,
                burst=k.burst,
                request_timeout=k.request_timeout,
            )
        return self._api_client

    def kube_executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = DaemonThreadPool(KUBE_THREADS, "kube")
        return self._executor

    def workflows(self) -> Workflows:
        from lapse.edges.kubernetes import Workflows

        return Workflows(self.kube_client(), self.kube_executor())

    def objects(self) -> KubeObjects:
        """Run objects of the configured kinds (`kinds:` in lapse.yaml)."""
        from lapse.edges.kubernetes import KubeObjects, OwnDeletions

        if self._own_deletions is None:
            self._own_deletions = OwnDeletions()
        return KubeObjects(
            self.kube_client(), self.kube_executor(), self.config.kinds, self._own_deletions
        )

    def policies(self) -> PolicyBook:
        """The policies in effect, shared by the planner and the reaper of this process:
        lapse.yaml's, and the policy objects once `lapse up`'s policy watcher has read them
        (lapse/runtime/policy_watcher.py)."""
        if self._policies is None:
            self._policies = PolicyBook(tuple(self.config.policies))
        return self._policies

    def database(self) -> AsyncEngine:
        if self._engine is None:
            settings = self.config.database
            if not settings.url:
                raise MissingSetting("database.url is not set (LAPSE_DATABASE__URL)")
            from lapse.edges import database

            self._engine = database.create_engine(
                settings.url,
                connect_timeout=settings.connect_timeout,
                pool_timeout=settings.pool_timeout,
            )
        return self._engine

    async def close(self) -> None:
        """Close everything, each within CLOSE_TIMEOUT: a graceful close waits on the peer,
        and after a network fault (a database black-holed, then back) a pooled connection's
        close could wait a minute, holding the process past its shutdown grace period."""
        if self._nc is not None:
            try:
                await asyncio.wait_for(self._nc.drain(), CLOSE_TIMEOUT)
            except Exception as exc:
                log.warning("NATS did not drain within %.0fs (%s): closing", CLOSE_TIMEOUT, exc)
                with contextlib.suppress(Exception):
                    await self._nc.close()
            self._nc = None
        if self._engine is not None:
            try:
                await asyncio.wait_for(self._engine.dispose(), CLOSE_TIMEOUT)
            except TimeoutError:
                log.warning("database connections did not close within %.0fs", CLOSE_TIMEOUT)
                await self._engine.dispose(close=False)  # let them go without the goodbye
            self._engine = None
        if self._api_client is not None:
            self._api_client.close()
            self._api_client = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
