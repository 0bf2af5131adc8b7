"""Every NATS identity against every subject and JetStream API call it could use to forge
or lose a deadline (issue 36), on a real nats-server with the generated configuration
(the Kubernetes identities: the embedded ones are among them).

Allowed and refused are told apart the same way: the request is published, then a PING;
the server answers a refused publish or subscription with a permissions violation before
its PONG, so what has not been reported by then was allowed.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from lapse.config import NatsConfig
from lapse.edges.nats import connect, security_options
from lapse.edges.streams import configured_streams, ensure_streams
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.nats_identities import (
    ADMIN,
    ARTIFACT_REAPER,
    BRIDGE,
    DLQ_SINK,
    KUBERNETES,
    OBJECT_REAPER,
    PLANNER,
    PROCESS,
    READER,
    ROW_REAPER,
    Identity,
    authorization,
    inbox_prefix,
)
from lapse.runtime.bridge import ROUTE as BRIDGE_DUE
from lapse.runtime.consumers import durable_name, owned_durables
from lapse.runtime.routing import load_routes

pytestmark = [pytest.mark.nats]

SCHED, AUDIT = "LAPSE_SCHED", "LAPSE_AUDIT"
# One durable of `lapse up`'s (the object-reaper's due events) and one of the bridge's.
REAPER_DUE = durable_name(next(r for r in load_routes() if r.function == "object-reaper"))
BRIDGE_DURABLE = durable_name(BRIDGE_DUE)


def _consumer_request(durable: str | None, **config: object) -> bytes:
    body = {"ack_policy": "explicit", "filter_subject": "", "max_deliver": 1, **config}
    if durable is not None:
        body["name"] = durable
    return json.dumps({"stream_name": SCHED, "config": body, "action": "update"}).encode()


@dataclass(frozen=True)
class Action:
    name: str
    kind: str  # "pub" or "sub"
    subject: str
    payload: bytes = b""


def actions(identity: Identity) -> list[Action]:
    other = READER if identity is not READER else PROCESS
    return [
        Action("subscribe _INBOX.>", "sub", "_INBOX.>"),
        Action("subscribe another's inboxes", "sub", f"{inbox_prefix(other.user)}.>"),
        Action("subscribe its own inboxes", "sub", f"{identity.inbox}.>"),
        Action("publish into another's inbox", "pub", f"{inbox_prefix(other.user)}.x"),
        # Updating lapse's durables, in each form the server takes: by name in the subject,
        # the legacy durable create, and a nameless create naming one in its body.
        *(
            Action(f"update {durable} by name", "pub",
                   f"$JS.API.CONSUMER.CREATE.{stream}.{durable}", _consumer_request(durable))
            for stream, durable in ((SCHED, REAPER_DUE), (SCHED, BRIDGE_DURABLE))
        ),
        Action(f"update {REAPER_DUE} (legacy durable create)", "pub",
               f"$JS.API.CONSUMER.DURABLE.CREATE.{SCHED}.{REAPER_DUE}"),
        Action(f"update {REAPER_DUE} by a nameless create", "pub",
               f"$JS.API.CONSUMER.CREATE.{SCHED}", _consumer_request(REAPER_DUE)),
        Action(f"fetch from {REAPER_DUE}", "pub",
               f"$JS.API.CONSUMER.MSG.NEXT.{SCHED}.{REAPER_DUE}", b'{"batch":1}'),
        Action("push consumer into another's inbox", "pub", f"$JS.API.CONSUMER.CREATE.{AUDIT}",
               _consumer_request(None, deliver_subject=f"{inbox_prefix(other.user)}.x")),
        Action("put the brake key", "pub", "$KV.LAPSE_LIMITS.brake.engaged", b"x"),
        Action("purge the brake's bucket", "pub", "$JS.API.STREAM.PURGE.KV_LAPSE_LIMITS"),
        Action("put a process's health report", "pub", "$KV.LAPSE_HEALTH.pod-1", b"x"),
        Action("put the safety net's last pass", "pub", "$KV.LAPSE_HEALTH.reconcile.pod-1",
               b"x"),
        # Taking, renewing or releasing a kind's watch lease (a lease written by anyone else
        # could stop lapse up's watch of that kind: a deletion late, never early).
        Action("write a watch lease", "pub", "$KV.LAPSE_LEASES.lease.c.argo-workflow", b"x"),
        Action("purge the watch leases' bucket", "pub", "$JS.API.STREAM.PURGE.KV_LAPSE_LEASES"),
        Action("publish lapse.due.>", "pub", "lapse.due.kubernetes.matrix"),
        Action("publish lapse.sched.>", "pub", "lapse.sched.kubernetes.matrix"),
        Action("publish an outcome (audit)", "pub",
               "lapse.audit.dev.lapse.cleanup.completed.v1"),
        Action("publish a failure (audit)", "pub", "lapse.audit.dev.lapse.cleanup.failed.v1"),
        Action("publish a dead letter", "pub", "lapse.dlq.dev.lapse.cleanup.failed.v1"),
    ]  # fmt: skip


WORKERS = {PROCESS, PLANNER, OBJECT_REAPER, ROW_REAPER, ARTIFACT_REAPER}
REAPERS = {PROCESS, OBJECT_REAPER, ROW_REAPER, ARTIFACT_REAPER}


def expected(identity: Identity, action: Action) -> bool:
    """Whether `identity` may do `action`."""
    name = action.name
    if name == "subscribe its own inboxes":
        return True
    if name.startswith(("subscribe", "publish into another")):
        return False
    if identity is ADMIN:
        return True  # the operator's repairs: everything but others' inboxes
    if name.startswith(("update", "fetch")):
        owner = (
            {PROCESS, BRIDGE} if BRIDGE_DURABLE in name and "nameless" not in name
            else {PROCESS} if "nameless" not in name
            else set()
        )  # fmt: skip
        return identity in owner
    if name == "push consumer into another's inbox":
        return False
    if name == "put the brake key":
        return identity in REAPERS
    if name == "purge the brake's bucket":
        return False
    if name == "put a process's health report":
        return identity in REAPERS
    if name == "put the safety net's last pass":
        # The planner's identity runs the safety net (the Deployment lapse-policy-watcher):
        # its last pass for `lapse status`, and no other key of the bucket.
        return identity in REAPERS | {PLANNER}
    if name == "write a watch lease":
        return identity is PROCESS  # only lapse up watches
    if name == "purge the watch leases' bucket":
        return False
    if name == "publish lapse.due.>":
        return False
    if name in ("publish lapse.sched.>", "publish an outcome (audit)"):
        return identity in WORKERS
    if name in ("publish a failure (audit)", "publish a dead letter"):
        return identity in WORKERS | {BRIDGE, DLQ_SINK}
    raise AssertionError(name)


@dataclass
class Server:
    server: EmbeddedNats
    passwords: dict[str, str]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    passwords = {identity.user: secrets.token_hex(16) for identity in KUBERNETES}
    settings = authorization(passwords, KUBERNETES, owned_durables())
    server = EmbeddedNats(Path(tmp_path_factory.mktemp("matrix")), settings=settings).start()
    yield Server(server, passwords)
    server.stop()


@pytest.fixture(scope="module")
async def streams(server: Server) -> AsyncIterator[None]:
    config = NatsConfig(
        url=server.server.url, user=ADMIN.user, password=server.passwords[ADMIN.user]
    )
    nc = await connect(server.server.url, config=config)
    await ensure_streams(nc.jetstream(), configured_streams(NatsConfig()))
    await nc.close()
    yield


async def refusals(nc: NATS, errors: list[str], todo: list[Action]) -> set[str]:
    """The actions of `todo` the server refused (a violation reported before its PONG)."""
    for action in todo:
        if action.kind == "sub":
            await nc.subscribe(action.subject)
        else:
            await nc.publish(action.subject, action.payload, reply=nc.new_inbox())
    await nc.flush(timeout=5)
    await asyncio.sleep(0.1)  # the error callback runs as a task of its own
    said = " ".join(errors).lower()
    return {
        action.name
        for action in todo
        if f"violation for {'subscription' if action.kind == 'sub' else 'publish'} to "
        f'"{action.subject.lower()}"' in said
    }


@pytest.mark.parametrize("identity", KUBERNETES, ids=lambda i: i.user)
async def test_what_each_identity_may_touch(
    server: Server, streams: None, identity: Identity
) -> None:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    config = NatsConfig(
        url=server.server.url, user=identity.user, password=server.passwords[identity.user]
    )
    nc = NATS()
    await nc.connect(
        server.server.url, error_cb=on_error, max_reconnect_attempts=0, **security_options(config)
    )
    try:
        denied = await refusals(nc, errors, actions(identity))
    finally:
        await nc.close()
    found = {a.name: a.name not in denied for a in actions(identity)}
    wanted = {a.name: expected(identity, a) for a in actions(identity)}
    assert found == wanted
