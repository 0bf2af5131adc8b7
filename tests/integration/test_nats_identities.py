"""The identities of `lapse up`'s embedded nats-server on a real server (v2.15): who may
publish a schedule or a due message, who may only read, and that a schedule the process
identity puts still fires onto `lapse.due.>` although that identity may not publish there
(the server's internal publish is not held to user permissions).

Each refusal is checked where it matters: the message is not stored in the stream, and the
server said "Permissions Violation" to the client.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from nats.js.errors import NotFoundError

from lapse.config import NatsConfig
from lapse.edges.artifacts.captures import BUCKET as CAPTURES
from lapse.edges.artifacts.captures import NatsCaptures
from lapse.edges.nats import NatsRefused, connect, security_options
from lapse.edges.schedules import schedule_headers
from lapse.edges.streams import configured_streams, count_messages, ensure_streams, read_stream
from lapse.embedded.nats import EmbeddedNats, nats_server_binary
from lapse.embedded.nats_identities import (
    ADMIN,
    ARTIFACT_REAPER,
    BRIDGE,
    CREDENTIALS_DIR,
    DLQ_SINK,
    EMBEDDED,
    KUBERNETES,
    OBJECT_REAPER,
    PLANNER,
    PROCESS,
    READER,
    Identity,
    authorization,
    ensure_passwords,
    new_password,
    password_file,
)
from lapse.events.run import Target
from lapse.events.subjects import due_subject, event_subject, schedule_subject
from lapse.functions.artifact_reaper.capture import CapturedItem, RunCapture
from lapse.runtime.consumers import owned_durables

pytestmark = [pytest.mark.nats]

SCHED = "LAPSE_SCHED"


@dataclass
class Guarded:
    server: EmbeddedNats
    state_dir: Path

    def config(self, identity: Identity) -> NatsConfig:
        return NatsConfig(
            url=self.server.url,
            user=identity.user,
            password_file=password_file(self.state_dir, identity),
        )


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    state_dir = tmp_path_factory.mktemp("state")
    settings = authorization(ensure_passwords(state_dir), EMBEDDED, owned_durables())
    server = EmbeddedNats(state_dir / "nats", settings=settings).start()
    yield Guarded(server, state_dir)
    server.stop()


class Client:
    """A connection as one identity, collecting what the server reports asynchronously
    (a publish permission violation is an -ERR, not an answer to the publish)."""

    def __init__(self, nc: NATS, errors: list[str]) -> None:
        self.nc, self.errors = nc, errors
        self.js = nc.jetstream(timeout=2)

    async def violation(self, subject: str) -> None:
        """Wait (bounded) until the server reported a permission violation for `subject`."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if any(
                f'violation for publish to "{subject.lower()}"' in e.lower() for e in self.errors
            ):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"no permissions violation for {subject}: {self.errors}")


OpenAs = Callable[[Identity], Awaitable["Client"]]


@pytest.fixture
async def as_identity(guarded: Guarded) -> AsyncIterator[OpenAs]:
    opened: list[NATS] = []

    async def open_as(identity: Identity) -> Client:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        config = guarded.config(identity)
        nc = NATS()
        await nc.connect(
            guarded.server.url,
            error_cb=on_error,
            max_reconnect_attempts=0,
            **security_options(config),
        )
        opened.append(nc)
        return Client(nc, errors)

    yield open_as
    for nc in opened:
        await nc.close()


@pytest.fixture(scope="module")
async def streams(guarded: Guarded) -> None:
    # As `lapse infra apply` does: the admin creates the streams.
    nc = await connect(guarded.server.url, config=guarded.config(ADMIN))
    try:
        await ensure_streams(nc.jetstream(), configured_streams(NatsConfig()))
    finally:
        await nc.close()


async def stored(client: Client, subject: str) -> bool:
    try:
        await client.js.get_last_msg(
            SCHED
            if subject.startswith("lapse.")
            and (subject.startswith("lapse.sched") or subject.startswith("lapse.due"))
            else "LAPSE_EVENTS",
            subject,
        )
    except NotFoundError:
        return False
    return True


async def test_an_anonymous_client_is_refused(guarded: Guarded) -> None:
    with pytest.raises(NatsRefused, match="requires authentication"):
        await connect(guarded.server.url, config=NatsConfig(url=guarded.server.url))


async def test_a_wrong_password_is_refused(guarded: Guarded, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    config = NatsConfig(url=guarded.server.url, user=PROCESS.user, password_file=wrong)
    with pytest.raises(NatsRefused, match=r"nats\.password_file"):
        await connect(guarded.server.url, config=config)


async def test_the_password_files_are_private(guarded: Guarded) -> None:
    for identity in EMBEDDED:
        path = password_file(guarded.state_dir, identity)
        assert path.stat().st_mode & 0o777 == 0o600
    assert password_file(guarded.state_dir, PROCESS).parent.stat().st_mode & 0o777 == 0o700
    config = guarded.server.store_dir / "nats-server.conf"
    assert config.stat().st_mode & 0o777 == 0o600


async def test_a_schedule_by_the_process_fires_into_due_though_it_may_not_publish_there(
    streams: None, as_identity: OpenAs
) -> None:
    process = await as_identity(PROCESS)
    uid = str(uuid.uuid4())
    due = due_subject(Target.KUBERNETES, uid)
    # The process may not put a due message itself...
    await process.nc.publish(due, b"forged")
    await process.violation(due)
    assert not await stored(process, due)
    # ...but a schedule it puts is fired there by the server.
    deadline = datetime.now(UTC) + timedelta(seconds=1)
    await process.js.publish(
        schedule_subject(Target.KUBERNETES, uid),
        b"due event",
        headers={**schedule_headers(deadline, due), "Lapse-Observed": "apiserver"},
    )
    end = time.monotonic() + 15
    while not await stored(process, due):
        assert time.monotonic() < end, "the schedule did not fire"
        await asyncio.sleep(0.1)
    fired = await process.js.get_last_msg(SCHED, due)
    assert fired.data == b"due event"
    assert (fired.headers or {}).get("Lapse-Observed") == "apiserver"
    # The process consumes and acknowledges it as the reapers do ($JS.ACK is a publish),
    # through a durable it owns (only those: tests/integration/test_identity_matrix.py).
    name = owned_durables()[PROCESS.user][0]
    await process.js.add_consumer(
        SCHED,
        ConsumerConfig(durable_name=name, filter_subject=due, ack_policy=AckPolicy.EXPLICIT),
    )
    sub = await process.js.pull_subscribe(due, durable=name, stream=SCHED)
    (msg,) = await sub.fetch(1, timeout=5)
    await msg.in_progress()
    await msg.ack_sync()
    info = await process.js.consumer_info(SCHED, name)
    assert info.ack_floor is not None and info.ack_floor.stream_seq == fired.seq
    await process.js.delete_consumer(SCHED, name)
    # The one refusal is the forged due message: the schedule, the consumer, the fetch, the
    # in-progress mark and the ack were all allowed.
    assert [e for e in process.errors if "violation" in e.lower()] == [
        f'nats: permissions violation for publish to "{due}"'
    ]


@pytest.mark.parametrize(
    "subject",
    [
        schedule_subject(Target.KUBERNETES, "reader-sched"),
        due_subject(Target.KUBERNETES, "reader-due"),
        event_subject("dev.lapse.run.finished.v1"),
        "lapse.audit.dev.lapse.cleanup.completed.v1",
        "$KV.LAPSE_LIMITS.brake",
    ],
)
async def test_the_reader_publishes_nothing(
    streams: None, as_identity: OpenAs, subject: str
) -> None:
    reader = await as_identity(READER)
    await reader.nc.publish(subject, b"x", headers={"Lapse-Observed": "apiserver"})
    await reader.violation(subject)
    if subject.startswith(("lapse.sched", "lapse.due", "lapse.events")):
        assert not await stored(reader, subject)


async def test_the_reader_reads_but_cannot_change_a_stream(
    streams: None, as_identity: OpenAs
) -> None:
    reader = await as_identity(READER)
    # What the read-only commands do: info, direct gets, reading a stream message by
    # message and counting its messages, all without a consumer.
    info = await reader.js.stream_info(SCHED)
    assert info.config.name == SCHED
    with pytest.raises(NotFoundError):
        await reader.js.get_last_msg(SCHED, "lapse.*.kubernetes.none", direct=True)
    read = [seq async for seq, _, _ in read_stream(reader.js, SCHED, "lapse.>", limit=5)]
    assert read == sorted(read) and len(read) <= 5
    assert await count_messages(reader.js, SCHED, "lapse.sched.kubernetes.none.>") == 0
    # A consumer of its own is no longer one of them: refused (creating one could update
    # any of lapse's durables).
    with pytest.raises(Exception):  # noqa: B017 - the timeout of an unanswered request
        await reader.js.add_consumer(SCHED, ConsumerConfig(ack_policy=AckPolicy.NONE))
    await reader.violation("$JS.API.CONSUMER.CREATE." + SCHED)
    # A stream update could republish into lapse.due.> by the server's hand: refused.
    republish = StreamConfig(
        name=info.config.name,
        subjects=info.config.subjects,
        republish={"src": "lapse.sched.>", "dest": "lapse.due.>"},  # type: ignore[arg-type]
    )
    with pytest.raises(Exception):  # noqa: B017 - the timeout of an unanswered request
        await reader.js.update_stream(republish)
    await reader.violation("$JS.API.STREAM.UPDATE." + SCHED)
    with pytest.raises(Exception):  # noqa: B017
        await reader.js.purge_stream(SCHED)
    await reader.violation("$JS.API.STREAM.PURGE." + SCHED)
    # The reads before were all allowed: only the consumer and the two changes were refused.
    assert len([e for e in reader.errors if "violation" in e.lower()]) == 3, reader.errors


async def test_the_admin_replays_a_due_event(streams: None, as_identity: OpenAs) -> None:
    admin = await as_identity(ADMIN)
    due = due_subject(Target.KUBERNETES, str(uuid.uuid4()))
    ack = await admin.js.publish(due, b"replayed")
    assert ack.stream == SCHED
    assert (await admin.js.get_last_msg(SCHED, due)).data == b"replayed"
    assert admin.errors == []


@pytest.fixture(scope="module")
def kubernetes_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guarded]:
    """The users of infra/dev-nats/nats.conf (the same `permissions`), with passwords."""
    state_dir = tmp_path_factory.mktemp("k8s")
    (state_dir / CREDENTIALS_DIR).mkdir()
    passwords = {}
    for identity in KUBERNETES:
        passwords[identity.user] = secrets.token_urlsafe(16)
        password_file(state_dir, identity).write_text(passwords[identity.user])
    settings = authorization(passwords, KUBERNETES, owned_durables())
    server = EmbeddedNats(state_dir / "nats", settings=settings)
    server.start()
    yield Guarded(server, state_dir)
    server.stop()


@pytest.mark.parametrize(
    "identity", [i for i in KUBERNETES if i is not ADMIN], ids=lambda i: i.user
)
async def test_on_kubernetes_only_the_admin_may_put_a_due_event(
    kubernetes_server: Guarded, identity: Identity
) -> None:
    nc = NATS()
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    await nc.connect(
        kubernetes_server.server.url,
        error_cb=on_error,
        max_reconnect_attempts=0,
        **security_options(kubernetes_server.config(identity)),
    )
    try:
        client = Client(nc, errors)
        subjects = [due_subject(Target.KUBERNETES, "k8s")]
        if identity in (READER, BRIDGE, DLQ_SINK):
            # They never schedule, so they change no stream either: a stream's RePublish
            # onto lapse.due.> would be a due event put by the server's hand.
            subjects += [
                schedule_subject(Target.KUBERNETES, "k8s"),
                "$JS.API.STREAM.UPDATE.LAPSE_EVENTS",
                "$JS.API.STREAM.CREATE.KV_LAPSE_LIMITS",
            ]
        for subject in subjects:
            await nc.publish(subject, b"forged")
            await client.violation(subject)
    finally:
        await nc.close()


async def test_a_stream_republish_is_a_publish_by_the_servers_hand(
    streams: None, as_identity: OpenAs
) -> None:
    """Why changing streams is granted only to identities that may schedule: a RePublish
    puts messages onto lapse.due.> that no user permission is asked about."""
    admin = await as_identity(ADMIN)
    uid = str(uuid.uuid4())
    await admin.js.add_stream(
        StreamConfig(
            name="REPUBLISH_PROBE",
            subjects=["lapse.probe.>"],
            republish={"src": "lapse.probe.>", "dest": "lapse.due.>"},  # type: ignore[arg-type]
        )
    )
    try:
        marked = {"Lapse-Observed": "apiserver"}
        await admin.js.publish(f"lapse.probe.kubernetes.{uid}", b"x", headers=marked)
        due = due_subject(Target.KUBERNETES, uid)
        end = time.monotonic() + 5
        while not await stored(admin, due):
            assert time.monotonic() < end, "not republished into lapse.due"
            await asyncio.sleep(0.05)
        fired = await admin.js.get_last_msg(SCHED, due)
        assert (fired.headers or {}).get("Lapse-Observed") == "apiserver"
    finally:
        await admin.js.delete_stream("REPUBLISH_PROBE")


async def _connect_as(server: Guarded, identity: Identity) -> tuple[NATS, Client]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = NATS()
    await nc.connect(
        server.server.url,
        error_cb=on_error,
        max_reconnect_attempts=0,
        **security_options(server.config(identity)),
    )
    return nc, Client(nc, errors)


async def test_on_kubernetes_the_planner_captures_and_the_artifact_reaper_forgets(
    kubernetes_server: Guarded,
) -> None:
    """The artifact captures (`$KV.LAPSE_ARTIFACTS`): the planner writes them, the
    artifact-reaper (infra/components/artifacts) reads and removes them, through the real
    edge; another reaper may not write one."""
    uid = str(uuid.uuid4())
    capture = RunCapture(uid=uid, items=(CapturedItem(store="s3", key="a/b/c", tree=False),))
    planner, _ = await _connect_as(kubernetes_server, PLANNER)
    reaper, _ = await _connect_as(kubernetes_server, ARTIFACT_REAPER)
    other, other_client = await _connect_as(kubernetes_server, OBJECT_REAPER)
    try:
        await NatsCaptures(planner.jetstream(timeout=2)).put(capture)
        captures = NatsCaptures(reaper.jetstream(timeout=2))
        assert await captures.get(uid) == capture
        await captures.forget(capture)
        assert await captures.get(uid) is None
        subject = f"$KV.{CAPTURES}.run.{uid}"
        await other.publish(subject, b"forged")
        await other_client.violation(subject)
    finally:
        for nc in (planner, reaper, other):
            await nc.close()


def test_every_generated_password_is_a_string_to_nats_server(tmp_path: Path) -> None:
    """The dev NATS names each password by `$VARIABLE`, which nats-server lexes as a bare
    value: token_urlsafe's `-…` or `1-…` made it refuse the configuration now and then.
    Checked by the real server's own parser (`-t`), on many generated passwords at once."""
    count = 200
    users = ", ".join(f"{{user: u{i}, password: $PW{i}}}" for i in range(count))
    conf = tmp_path / "nats.conf"
    conf.write_text(f"authorization {{ users = [ {users} ] }}\n")
    env = {**os.environ, **{f"PW{i}": new_password() for i in range(count)}}
    checked = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(conf)], env=env, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr
    # The check can fail: a password of the old kind is refused by the same parser.
    env["PW0"] = "-" + new_password()
    refused = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(conf)], env=env, capture_output=True, text=True
    )
    assert refused.returncode != 0
