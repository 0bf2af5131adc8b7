"""The connections a process holds, opened once from the configuration and closed together.

Each is opened on first use, so a command or function only connects to what it needs
(`lapse plan` never touches NATS; the row-reaper never touches Kubernetes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

from kubernetes import client
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from sqlalchemy.ext.asyncio import AsyncEngine

from lapse.config import LapseConfig
from lapse.edges import database, nats
from lapse.edges.kubernetes import KubeObjects, Workflows, load_api_client
from lapse.edges.publishing import NatsEmitter
from lapse.edges.schedules import NatsScheduleStore
from lapse.errors import LapseError

# The official Kubernetes client is synchronous: its calls run on this many threads, which
# also bounds how many API requests one process has in flight.
KUBE_THREADS = 16
# Closing one connection (NATS drain, the database pool) waits no longer than this.
CLOSE_TIMEOUT = 5.0

log = logging.getLogger(__name__)


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

    async def emitter(self) -> NatsEmitter:
        return NatsEmitter(await self.jetstream(), self.config.nats.streams)

    def kube_client(self) -> client.ApiClient:
        if self._api_client is None:
            k = self.config.kubernetes
            self._api_client = load_api_client(
                str(k.kubeconfig) if k.kubeconfig else None,
                k.context,
                k.in_cluster,
                pool_size=KUBE_THREADS,
                qps=k.qps,
                burst=k.burst,
            )
        return self._api_client

    def kube_executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(KUBE_THREADS, thread_name_prefix="kube")
        return self._executor

    def workflows(self) -> Workflows:
        return Workflows(self.kube_client(), self.kube_executor())

    def objects(self) -> KubeObjects:
        """Run objects of the configured kinds (`kinds:` in lapse.yaml)."""
        return KubeObjects(self.kube_client(), self.kube_executor(), self.config.kinds)

    def database(self) -> AsyncEngine:
        if self._engine is None:
            if not self.config.database.url:
                raise MissingSetting("database.url is not set (LAPSE_DATABASE__URL)")
            self._engine = database.create_engine(self.config.database.url)
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
