"""The policy watcher's list meeting a refused connection (issue 37's "policy watcher crashed:
... Max retries exceeded with url: /apis/lapse.dev/v1alpha1/lapsepolicies?limit=500 (...
Connection refused)"): a real refusal, from a loopback port nothing listens on. The list
is tried again, and the wait is what its supervisor shows; it ended the watcher before.
Through `lapse up`: tests/e2e/test_supervision.py."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from kubernetes import client

from lapse.edges.kubernetes import KubeObjects
from lapse.embedded.process import free_port
from lapse.events.kinds import DEFAULT_KINDS
from lapse.functions.policy_objects import PolicyBook
from lapse.runtime.outages import Backoff
from lapse.runtime.policy_watcher import PolicyWatcher
from lapse.runtime.supervisor import Supervisor
from tests.stack import wait_for


async def _nothing(*_: object) -> None:
    raise AssertionError("nothing is published while the API server is away")


async def _no_namespaces() -> list[str]:
    raise AssertionError("nothing is re-planned while the API server is away")


async def test_a_refused_policy_list_is_waited_out_and_shown_never_the_end() -> None:
    configuration = client.Configuration()
    configuration.host = f"https://127.0.0.1:{free_port()}"  # refused: nothing listens
    configuration.verify_ssl = False
    api_client = client.ApiClient(configuration)
    executor = ThreadPoolExecutor(max_workers=4)
    watcher = PolicyWatcher(
        KubeObjects(api_client, executor, DEFAULT_KINDS),
        PolicyBook(),
        DEFAULT_KINDS,
        _nothing,
        _no_namespaces,
    )
    stop = asyncio.Event()
    supervisor = Supervisor(stop, backoff=Backoff(first=0.2, cap=0.5))
    task = supervisor.start("policy watcher", lambda: watcher.run(stop))
    try:

        async def shown() -> bool:
            wait = supervisor.waiting().get("policy watcher")
            return wait is not None and wait.tries >= 3

        await wait_for(shown, timeout=20, interval=0.1)
        wait = supervisor.waiting()["policy watcher"]
        assert wait.reason.startswith("API server unreachable"), wait
        assert "refused" in wait.reason, wait
        assert not task.done() and not supervisor.fatal.done()
        assert not watcher.synced.is_set()
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        executor.shutdown(wait=False, cancel_futures=True)
        api_client.close()
