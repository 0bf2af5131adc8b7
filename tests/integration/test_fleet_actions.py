"""An action from the fleet's hub, carried out by the cluster's responder on a real
nats-server (one server plays hub and cluster: the routing between them is
tests/e2e/test_fleet.py's): the answer is the cluster's own command's, a verb it does not
know and a change asked as a question are refused with the reason, and a cluster nobody
answers for is said at once, not after the timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from lapse.config import LapseConfig
from lapse.edges.nats import connect
from lapse.edges.streams import configured_streams, ensure_streams
from lapse.embedded.fleet_identities import action_subject, reply_prefix
from lapse.embedded.nats import EmbeddedNats
from lapse.operations.fleet_actions import ActionFailed, ask, serve_actions

pytestmark = [pytest.mark.nats]


@pytest.fixture
async def cluster(own_nats: EmbeddedNats) -> AsyncIterator[NATS]:
    """A client of the server with the responder of cluster `east` running on it."""
    config = LapseConfig.model_validate({"nats": {"url": own_nats.url}})
    nc = await connect(own_nats.url)
    await ensure_streams(nc.jetstream(), configured_streams(config.nats))
    stop = asyncio.Event()
    answering = asyncio.create_task(serve_actions(nc, config, "east", stop))
    await asyncio.sleep(0)  # let it subscribe before asking
    await nc.flush()
    try:
        yield nc
    finally:
        stop.set()
        await answering
        await nc.close()


async def test_the_cluster_carries_out_what_it_knows_and_refuses_the_rest(
    cluster: NATS,
) -> None:
    async def asked(verb: str, body: dict[str, object]) -> dict[str, object]:
        return await ask(cluster, "east", verb, body, timeout=10)

    engaged = await asked("brake-engage", {"target": "kubernetes", "seconds": 30})
    assert engaged["cluster"] == "east"
    assert str(engaged["brake"]["kubernetes"]).startswith("engaged until")  # type: ignore[index]
    status = await asked("brake-status", {})
    assert str(status["brake"]["kubernetes"]).startswith("engaged since")  # type: ignore[index]
    assert status["brake"]["database"] == "not engaged"  # type: ignore[index]
    assert (await asked("dlq-list", {}))["items"] == []
    with pytest.raises(ActionFailed, match="say which entries"):
        await asked("dlq-replay", {"filter": {}})

    # By hand, as a client that skips `ask`'s choice of subject.
    async def answer(subject: str) -> bytes:
        inbox = f"{reply_prefix('east')}.by-hand"
        sub = await cluster.subscribe(inbox, max_msgs=1)
        await cluster.publish(subject, b"{}", reply=inbox)
        return (await sub.next_msg(timeout=10)).data

    assert b"unknown action 'schedules-purge'" in await answer(
        action_subject("east", "act", "schedules-purge")
    )
    # A change asked on the read subject (where the hub's reader may publish).
    said = await answer(action_subject("east", "read", "brake-release"))
    assert b'"refused"' in said and b"changes the cluster" in said
    # A request whose answer could reach no one is not carried out.
    await cluster.publish(action_subject("east", "act", "brake-release"), b"{}", reply="x.y")
    # The next action on the same subject is handled after it (one at a time, in order).
    await asked("brake-engage", {"target": "database", "seconds": 30})
    assert str((await asked("brake-status", {}))["brake"]["kubernetes"]).startswith(  # type: ignore[index]
        "engaged since"
    )


async def test_a_cluster_nobody_answers_for_is_said_at_once(cluster: NATS) -> None:
    started = time.monotonic()
    with pytest.raises(ActionFailed, match="no lapse up of cluster 'west'"):
        await ask(cluster, "west", "brake-status", {}, timeout=30)
    assert time.monotonic() - started < 5
