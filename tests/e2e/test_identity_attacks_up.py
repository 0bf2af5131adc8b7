"""Internal identities can no longer forge or lose deadlines (issue 36), through `lapse up`
on a NATS configured with the Kubernetes identities (infra/dev-nats/nats.conf, generated
from lapse/embedded/nats_identities.py), as an operator runs it against that NATS.

The attacks, each as the finding played it:
- the bridge identity listens on `_INBOX.>` for `lapse up`'s pull inboxes, then points a
  push consumer of the audit stream (which it may write) at each and publishes a due event
  carrying `Lapse-Observed` there: an object with a 1 h TTL was deleted a second later;
- the reader identity (the CLI's) updates lapse's due durable to `max_deliver: 1` and an
  empty filter (a due message lost for good, another target's never handled);
- the dead-letter sink identity writes a `deleted` outcome that `lapse history` showed.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from lapse.config import NatsConfig
from lapse.edges.nats import security_options
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.nats_identities import (
    ADMIN,
    BRIDGE,
    DLQ_SINK,
    KUBERNETES,
    PROCESS,
    READER,
    Identity,
    authorization,
)
from lapse.events.builder import build_event
from lapse.events.models import CleanupCompleted, CleanupDue
from lapse.events.nats_binding import to_nats
from lapse.events.observed import observed_mark
from lapse.events.run import Engine, RunRef, Target
from lapse.events.types import EventType, Outcome
from lapse.runtime.consumers import durable_name
from lapse.runtime.routing import load_routes
from tests.conftest import KubeStack, kube_stack
from tests.e2e.test_nats_auth_up import LAPSE, LapseUp, clean_env, workflow
from tests.stack import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]

REAPER_DUE = durable_name(
    next(r for r in load_routes() if r.function == "object-reaper" and "due" in r.name)
)


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    with kube_stack(tmp_path_factory.mktemp("kube-identities")) as stack:
        yield stack


class Passwords:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.values = {identity.user: secrets.token_hex(16) for identity in KUBERNETES}
        directory.mkdir(parents=True, exist_ok=True)
        for user, value in self.values.items():
            (directory / user).write_text(value)

    def file(self, identity: Identity) -> Path:
        return self.directory / identity.user


@pytest.fixture
def k8s_nats(tmp_path: Path) -> Iterator[tuple[EmbeddedNats, Passwords]]:
    from lapse.runtime.consumers import owned_durables

    passwords = Passwords(tmp_path / "passwords")
    settings = authorization(passwords.values, KUBERNETES, owned_durables())
    server = EmbeddedNats(tmp_path / "nats", settings=settings).start()
    yield server, passwords
    server.stop()


async def open_as(url: str, passwords: Passwords, identity: Identity) -> tuple[NATS, list[str]]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    config = NatsConfig(url=url, user=identity.user, password_file=passwords.file(identity))
    nc = NATS()
    await nc.connect(url, error_cb=on_error, max_reconnect_attempts=0, **security_options(config))
    return nc, errors


def forged_due_with_ttl(obj: dict[str, Any], ttl: str) -> tuple[dict[str, str], bytes]:
    """A due event for `obj`, with lapse's mark, claiming a version whose TTL annotation is
    `ttl` (the object's own says an hour) and whose deadline has passed."""
    meta = obj["metadata"]
    past = datetime.now(UTC) - timedelta(hours=1)
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace=meta["namespace"], name=meta["name"], uid=meta["uid"], phase="Succeeded",
        finished_at=past, resource_version=meta["resourceVersion"],
        annotations={"lapse.dev/ttl": ttl},
    )  # fmt: skip
    due = CleanupDue(
        run=run, target=Target.KUBERNETES, deadline=past, policy="annotation",
        scheduled_at=past,
    )  # fmt: skip
    message = to_nats(build_event(EventType.CLEANUP_DUE, source="/forged", data=due))
    return {**message.headers, **observed_mark()}, message.body


def env_as(
    base: dict[str, str], url: str, passwords: Passwords, identity: Identity
) -> dict[str, str]:
    return {
        **base,
        "LAPSE_NATS__URL": url,
        "LAPSE_NATS__USER": identity.user,
        "LAPSE_NATS__PASSWORD_FILE": str(passwords.file(identity)),
    }


async def test_no_internal_identity_forges_or_loses_a_deadline(
    tmp_path: Path, kube: KubeStack, k8s_nats: tuple[EmbeddedNats, Passwords]
) -> None:
    server, passwords = k8s_nats
    url = server.url
    ns = kube.namespace(f"ids-{uuid.uuid4().hex[:6]}")
    base = {
        **clean_env(tmp_path),
        "LAPSE_KUBERNETES__KUBECONFIG": str(kube.kubeconfig),
        "LAPSE_SAFETY__NAMESPACES__INCLUDE": ns,
    }
    # `lapse infra apply` as the admin, as the streams Job does; then `lapse up`.
    applied = await asyncio.to_thread(
        subprocess.run, [*LAPSE, "infra", "apply"], capture_output=True, text=True,
        env=env_as(base, url, passwords, ADMIN), timeout=60,
    )  # fmt: skip
    assert applied.returncode == 0, applied.stderr
    up = LapseUp(tmp_path, env_as(base, url, passwords, PROCESS))
    attackers: list[NATS] = []
    try:
        await wait_for(up.running, timeout=90, interval=0.3)
        # A finished Workflow whose TTL is an hour: its deadline is far away.
        kept = await kube.workflows.create(
            ns, workflow("kept", "Succeeded", **{"lapse.dev/ttl": "1h"})
        )
        # The bridge listens for lapse up's inboxes (a pull waiting answers 408 there).
        bridge, bridge_errors = await open_as(url, passwords, BRIDGE)
        attackers.append(bridge)
        inboxes: set[str] = set()

        async def heard(msg: Msg) -> None:
            # A consumer's delivery shows its stored subject: only a status message (a
            # pull's 404 or 408) arrives under the inbox's own name.
            if msg.subject.startswith("_INBOX.") and (msg.headers or {}).get("Status"):
                inboxes.add(msg.subject)

        await bridge.subscribe("_INBOX.>", cb=heard)
        await bridge.flush()
        await asyncio.sleep(2.5)  # two fetch timeouts of every route
        # ...and, for each inbox heard, a push consumer of the audit stream delivering there
        # and a forged due event with lapse's mark on its subject.
        for n, inbox in enumerate(sorted(inboxes)):
            # A new event each time: the audit stream drops a repeated Nats-Msg-Id.
            headers, body = forged_due_with_ttl(kept, "1s")
            forged = f"lapse.audit.dev.lapse.cleanup.failed.v1.{n}"
            request = {
                "stream_name": "LAPSE_AUDIT",
                "config": {"deliver_subject": inbox, "filter_subject": forged,
                           "ack_policy": "none", "deliver_policy": "all"},
            }  # fmt: skip
            # With a reply subject, or the server does not take the request.
            await bridge.publish(
                "$JS.API.CONSUMER.CREATE.LAPSE_AUDIT",
                json.dumps(request).encode(),
                reply=bridge.new_inbox(),
            )
            await bridge.flush()
            await bridge.publish(forged, body, headers=headers)
        await bridge.flush()
        heard_inboxes = len(inboxes)

        # The reader (the CLI's identity) updates the object-reaper's due durable: one
        # delivery only, and every subject.
        reader, reader_errors = await open_as(url, passwords, READER)
        attackers.append(reader)
        update = {
            "stream_name": "LAPSE_SCHED", "action": "update",
            "config": {"name": REAPER_DUE, "durable_name": REAPER_DUE, "filter_subject": "",
                       "ack_policy": "explicit", "max_deliver": 1},
        }  # fmt: skip
        await reader.publish(
            f"$JS.API.CONSUMER.CREATE.LAPSE_SCHED.{REAPER_DUE}",
            json.dumps(update).encode(),
            reply=reader.new_inbox(),
        )
        await reader.flush()

        # The dead-letter sink writes a `deleted` outcome for the kept Workflow.
        sink, sink_errors = await open_as(url, passwords, DLQ_SINK)
        attackers.append(sink)
        meta = kept["metadata"]
        run = RunRef(
            engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
            namespace=ns, name="kept", uid=meta["uid"], phase="Succeeded",
        )  # fmt: skip
        outcome = to_nats(
            build_event(
                EventType.CLEANUP_COMPLETED,
                source="/forged",
                data=CleanupCompleted.of(
                    run=run,
                    target=Target.KUBERNETES,
                    outcome=Outcome.DELETED,
                    completed_at=datetime.now(UTC),
                ),
            )
        )
        await sink.publish(
            "lapse.audit.dev.lapse.cleanup.completed.v1", outcome.body, headers=outcome.headers
        )
        await sink.flush()

        # The proof the pipeline is live and deleting meanwhile: a Workflow due in a second
        # goes (through the object-reaper's durable the reader tried to change).
        await kube.workflows.create(ns, workflow("done", "Succeeded", **{"lapse.dev/ttl": "1s"}))

        async def done_gone() -> bool:
            names = {w["metadata"]["name"] for w in (await kube.workflows.list(ns))["items"]}
            return "done" not in names

        await wait_for(done_gone, timeout=60, interval=0.3)
        still = await kube.workflows.get(ns, "kept")
        assert still is not None and still["metadata"]["uid"] == meta["uid"], (
            f"deleted early ({heard_inboxes} inboxes heard)"
        )
        # Every step was refused by the server.
        assert any('subscription to "_inbox.>"' in e for e in bridge_errors), bridge_errors
        assert any("consumer.create.lapse_sched" in e for e in reader_errors), reader_errors
        assert any("cleanup.completed" in e for e in sink_errors), sink_errors
        # The durable is as lapse made it, and history shows no forged deletion.
        admin, _ = await open_as(url, passwords, ADMIN)
        attackers.append(admin)
        info = await admin.jetstream().consumer_info("LAPSE_SCHED", REAPER_DUE)
        assert info.config.max_deliver == -1 and info.config.filter_subject
        history = await asyncio.to_thread(
            subprocess.run, [*LAPSE, "history", "-o", "json"], capture_output=True, text=True,
            env=env_as(base, url, passwords, READER), timeout=60,
        )  # fmt: skip
        assert history.returncode == 0, history.stderr
        assert "/forged" not in history.stdout and meta["uid"] not in history.stdout
    finally:
        for nc in attackers:
            await nc.close()
        assert up.stop() == 0, up.log.read_text()[-3000:]
