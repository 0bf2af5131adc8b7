"""The JetStream streams lapse needs: their definitions (infra/nats/streams.yaml), creating
or updating them, and reading them without any consumer (audit, dead letters, counts)."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import yaml
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import Placement, StorageType, StreamConfig
from nats.js.errors import APIError, BadRequestError, NotFoundError

from lapse import infra
from lapse.config import ConfigError, NatsConfig, Streams
from lapse.config.schema import StreamPlacement
from lapse.functions.durations import parse_duration


def _seconds(value: str | int | float) -> float:
    """A definition's duration: a number of seconds, or text such as `7d` (one parser)."""
    if isinstance(value, int | float):
        return float(value)
    return parse_duration(value, what="streams.yaml duration").total_seconds()


def due_message_ttl() -> float:
    """Seconds a fired due message is kept (handled or not) before the server removes it."""
    return _seconds(_definitions()["schedule"].get("due_message_ttl", "7d"))


@functools.cache
def _definitions() -> dict[str, dict[str, Any]]:
    streams: dict[str, dict[str, Any]] = yaml.safe_load(infra.read_text("nats/streams.yaml"))[
        "streams"
    ]
    return streams


def configured_streams(nats: NatsConfig) -> list[StreamConfig]:
    """The streams as `nats:` configures them: names, replicas, placement, audit retention
    (what `lapse infra apply` and `lapse up` create or update)."""
    return stream_configs(
        nats.streams,
        replicas=nats.replicas,
        placement=nats.placement,
        audit_max_age=nats.audit_max_age,
    )


def stream_configs(
    names: Streams | None = None,
    *,
    replicas: int = 1,
    placement: StreamPlacement | None = None,
    audit_max_age: timedelta | None = None,
) -> list[StreamConfig]:
    names = names or Streams()
    where = None
    if placement is not None and (placement.cluster or placement.tags):
        where = Placement(cluster=placement.cluster, tags=list(placement.tags) or None)
    configs = []
    for key, spec in _definitions().items():
        max_age: str | float = spec.get("max_age", 0)
        if key == "audit" and audit_max_age is not None:
            max_age = audit_max_age.total_seconds()
        configs.append(
            StreamConfig(
                name=getattr(names, key),
                description=spec.get("description"),
                subjects=list(spec["subjects"]),
                storage=StorageType(spec.get("storage", "file")),
                max_age=_seconds(max_age),
                num_replicas=replicas,
                placement=where,
                allow_msg_schedules=bool(spec.get("allow_msg_schedules")) or None,
                allow_msg_ttl=bool(spec.get("allow_msg_ttl")) or None,
                allow_direct=bool(spec.get("allow_direct")) or None,
                # Publishers set Nats-Msg-Id to the CloudEvent id: duplicates within this
                # window are dropped by the server.
                duplicate_window=120.0,
            )
        )
    return configs


# JetStream's error codes for a stream it cannot place as asked.
NO_SUITABLE_PEERS = 10005
INSUFFICIENT_RESOURCES = 10023


class StreamRefused(ConfigError):
    """NATS refused a stream definition (400): the configuration must change."""


async def ensure_streams(js: JetStreamContext, configs: list[StreamConfig]) -> list[str]:
    """Create each stream or update it in place (a changed replica count or placement is
    applied by the servers). Returns what was done, one line each; a definition the servers
    refuse raises `StreamRefused` naming the keys to change."""
    done = []
    for cfg in configs:
        try:
            try:
                await js.stream_info(cfg.name or "")
            except NotFoundError:
                await js.add_stream(cfg)
                done.append(f"created {cfg.name}")
            else:
                await js.update_stream(cfg)
                done.append(f"updated {cfg.name}")
        except BadRequestError as exc:
            raise StreamRefused([_refusal(cfg, exc)]) from None
    return done


def _refusal(cfg: StreamConfig, exc: BadRequestError) -> str:
    reason = exc.description or str(exc)
    if exc.err_code in (NO_SUITABLE_PEERS, INSUFFICIENT_RESOURCES):
        where = cfg.placement
        wanted = f"{cfg.num_replicas} replica(s)"
        if where is not None:
            wanted += f" on servers with cluster={where.cluster} tags={where.tags or []}"
        return (
            f"nats.replicas, nats.placement: the NATS servers cannot hold stream {cfg.name} "
            f"with {wanted} ({reason}); a stream needs as many servers as replicas, each "
            "matching the placement"
        )
    return f"nats: the NATS server refused stream {cfg.name} ({reason})"


# Headers a direct get adds to each message it returns: where the message is, not what it
# says; dropped, so a message reads as it was stored.
_DIRECT_HEADERS = frozenset(
    {
        "Nats-Stream",
        "Nats-Subject",
        "Nats-Sequence",
        "Nats-Time-Stamp",
        "Nats-Num-Pending",
        "Nats-Last-Sequence",
        "Nats-UpTo-Sequence",
    }
)
# Where read_stream(with_subject=True) puts a message's subject.
SUBJECT_HEADER = "Nats-Subject"
_BATCH = 500
_TIMEOUT = 5.0


def _client(js: JetStreamContext) -> NATS:
    client = getattr(js, "_nc", None)
    assert isinstance(client, NATS), "a JetStream context of a connected client"
    return client


async def read_stream(
    js: JetStreamContext,
    stream: str,
    subject: str,
    *,
    start_seq: int | None = None,
    since: datetime | None = None,
    headers_only: bool = False,
    limit: int | None = None,
    with_subject: bool = False,
) -> AsyncIterator[tuple[int, dict[str, str], bytes]]:
    """Every message on `subject` stored now, oldest first; stops at what was the last
    message when it started. With `with_subject`, each message's own subject is in its
    headers as `Nats-Subject` (a hub's stream names the cluster there). Read by message
    gets, in batches where the stream allows direct gets, never through a consumer: a
    read-only identity may create none, since a consumer create can update any of lapse's
    durables (docs/security.md, "NATS identities"). `headers_only` is a hint: the bodies
    may be read anyway."""
    del headers_only  # a message get returns whole messages
    info = await js.stream_info(stream)
    last = info.state.last_seq
    if info.state.messages == 0:
        return
    start: dict[str, Any] = {}
    if start_seq is not None:
        start["seq"] = max(start_seq, 1)
    elif since is not None:
        start["start_time"] = since.isoformat()
    else:
        start["seq"] = 1
    seen = 0
    messages = (
        _direct_gets(_client(js), stream, subject, start, with_subject)
        if info.config.allow_direct
        else _message_gets(js, stream, subject, start, with_subject)
    )
    async for seq, headers, body in messages:
        if seq > last:
            return
        yield seq, headers, body
        seen += 1
        if seq >= last or (limit is not None and seen >= limit):
            return


async def _direct_gets(
    nc: NATS, stream: str, subject: str, start: dict[str, Any], with_subject: bool
) -> AsyncIterator[tuple[int, dict[str, str], bytes]]:
    """Batched direct gets (`$JS.API.DIRECT.GET.<stream>`, `batch`): each answer streams up
    to _BATCH messages, then a 204 (end of batch) or a 404 (none left)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        request = {**start, "next_by_subj": subject, "batch": _BATCH}
        while True:
            await nc.publish(
                f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox
            )
            after = None
            while True:
                msg = await sub.next_msg(timeout=_TIMEOUT)
                headers = dict(msg.headers or {})
                status = headers.get("Status")
                if status == "404":
                    return
                if status == "204":
                    break
                if status is not None:
                    raise APIError(code=int(status), description=headers.get("Description"))
                after = int(headers["Nats-Sequence"])
                kept = {k: v for k, v in headers.items() if k not in _DIRECT_HEADERS}
                if with_subject:
                    kept[SUBJECT_HEADER] = headers["Nats-Subject"]
                yield after, kept, msg.data
            if after is None:
                return
            request = {"seq": after + 1, "next_by_subj": subject, "batch": _BATCH}
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _message_gets(
    js: JetStreamContext, stream: str, subject: str, start: dict[str, Any], with_subject: bool
) -> AsyncIterator[tuple[int, dict[str, str], bytes]]:
    """One `$JS.API.STREAM.MSG.GET.<stream>` a message: for a stream without direct gets."""
    seq = start.get("seq")
    if seq is None:  # from a time: the first message at or after it says where to start
        answer = await _client(js).request(
            f"$JS.API.STREAM.MSG.GET.{stream}",
            json.dumps({**start, "next_by_subj": subject}).encode(),
            timeout=_TIMEOUT,
        )
        reply = json.loads(answer.data)
        if "error" in reply:
            error = APIError.from_error(reply["error"])
            if isinstance(error, NotFoundError):
                return
            raise error
        seq = int(reply["message"]["seq"])
    while True:
        try:
            msg = await js.get_msg(stream, seq, subject=subject, next=True)
        except NotFoundError:
            return
        seq = msg.seq or seq
        headers = dict(msg.headers or {})
        if with_subject:
            headers[SUBJECT_HEADER] = msg.subject or ""
        yield seq, headers, msg.data or b""
        seq += 1


async def stream_info_document(js: JetStreamContext, stream: str) -> dict[str, Any]:
    """The server's own stream info, as JSON: what nats-py's StreamInfo drops included (a
    source's `external` API prefix names the domain it comes from)."""
    answer = await _client(js).request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=_TIMEOUT)
    info: dict[str, Any] = json.loads(answer.data)
    if "error" in info:
        raise APIError.from_error(info["error"])
    return info


async def count_messages(js: JetStreamContext, stream: str, subject: str) -> int:
    """How many messages match `subject`, counted by the server (no body is read): one
    direct get says how many more match after the first; a stream without direct gets
    lists its subjects' counts. No consumer (see read_stream)."""
    info = await js.stream_info(stream)
    if info.state.messages == 0:
        return 0
    nc = _client(js)
    if info.config.allow_direct:
        request = {"seq": 1, "next_by_subj": subject, "batch": 1}
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            await nc.publish(
                f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox
            )
            headers = dict((await sub.next_msg(timeout=_TIMEOUT)).headers or {})
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if headers.get("Status") == "404":
            return 0
        if "Nats-Num-Pending" not in headers:
            raise APIError(code=int(headers.get("Status", 0)), description=str(headers))
        return 1 + int(headers["Nats-Num-Pending"])
    total, offset = 0, 0
    while True:
        answer = await nc.request(
            f"$JS.API.STREAM.INFO.{stream}",
            json.dumps({"subjects_filter": subject, "offset": offset}).encode(),
            timeout=_TIMEOUT,
        )
        reply = json.loads(answer.data)
        if "error" in reply:
            raise APIError.from_error(reply["error"])
        subjects = reply.get("state", {}).get("subjects") or {}
        total += sum(int(count) for count in subjects.values())
        offset += len(subjects)
        if not subjects or offset >= int(reply.get("total") or 0):
            return total
