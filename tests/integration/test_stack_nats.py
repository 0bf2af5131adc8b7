"""The NATS server works through lapse's own connection helper and stream definitions."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from nats.js.api import ConsumerConfig

from lapse.config import Streams
from lapse.edges.nats import connect
from lapse.edges.streams import ensure_streams, stream_configs
from lapse.embedded.nats import EmbeddedNats
from lapse.events.run import Target
from lapse.events.subjects import due_subject, schedule_subject


async def test_streams_are_created_idempotently(nats_server: EmbeddedNats) -> None:
    nc = await connect(nats_server.url)
    js = nc.jetstream()
    names = Streams(schedule="T1_SCHED", events="T1_EVENTS", audit="T1_AUDIT", dlq="T1_DLQ")
    try:
        first = await ensure_streams(js, stream_configs(names))
        second = await ensure_streams(js, stream_configs(names))
        assert first == [f"created T1_{k}" for k in ("SCHED", "EVENTS", "AUDIT", "DLQ")]
        assert second == [f"updated T1_{k}" for k in ("SCHED", "EVENTS", "AUDIT", "DLQ")]
        sched = await js.stream_info("T1_SCHED")
        assert sched.config.allow_msg_schedules is True
        assert not sched.config.max_age  # an age limit would silently cancel schedules
    finally:
        for name in ("T1_SCHED", "T1_EVENTS", "T1_AUDIT", "T1_DLQ"):
            await js.delete_stream(name)
        await nc.close()


async def test_jetstream_publish_and_durable_pull(nats_server: EmbeddedNats) -> None:
    nc = await connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(name="T2", subjects=["t2.>"])
    try:
        for i in range(5):
            ack = await js.publish(
                f"t2.{i}", json.dumps({"i": i}).encode(), headers={"Nats-Msg-Id": f"m{i}"}
            )
            assert ack.seq == i + 1
        duplicate = await js.publish("t2.0", b"again", headers={"Nats-Msg-Id": "m0"})
        assert duplicate.duplicate is True

        sub = await js.pull_subscribe(
            "t2.>", durable="reader", config=ConsumerConfig(max_deliver=3)
        )
        msgs = await sub.fetch(5, timeout=5)
        assert sorted(json.loads(m.data)["i"] for m in msgs) == [0, 1, 2, 3, 4]
        for m in msgs:
            await m.ack()
        info = await js.consumer_info("T2", "reader")
        assert info.num_pending == 0
    finally:
        await js.delete_stream("T2")
        await nc.close()


async def test_message_schedule_fires_on_its_target(nats_server: EmbeddedNats) -> None:
    nc = await connect(nats_server.url)
    js = nc.jetstream()
    names = Streams(schedule="T3_SCHED", events="T3_EVENTS", audit="T3_AUDIT", dlq="T3_DLQ")
    await ensure_streams(js, stream_configs(names)[:1])
    try:
        uid = "0b7c3a8e-9a56-4b8f-a2b7-1c1f0e3a5d11"
        target = due_subject(Target.KUBERNETES, uid)
        sub = await js.pull_subscribe(target, durable="due-reader", stream="T3_SCHED")
        deadline = datetime.now(UTC) + timedelta(seconds=2)
        await js.publish(
            schedule_subject(Target.KUBERNETES, uid),
            b'{"hello": "due"}',
            headers={
                "Nats-Schedule": "@at " + deadline.isoformat().replace("+00:00", "Z"),
                "Nats-Schedule-Target": target,
                "X-Custom": "kept",
            },
        )
        msgs = await sub.fetch(1, timeout=15)
        arrived = datetime.now(UTC)
        lateness = (arrived - deadline).total_seconds()
        print(f"\nmessage schedule lateness: {lateness * 1000:.0f} ms")
        assert msgs[0].subject == target
        assert msgs[0].data == b'{"hello": "due"}'
        assert msgs[0].headers is not None
        assert msgs[0].headers.get("X-Custom") == "kept"
        assert msgs[0].headers.get("Nats-Scheduler") == schedule_subject(Target.KUBERNETES, uid)
        assert lateness >= 0, "a schedule must never fire before its time"
        assert lateness < 5, "generous bound: the server fires schedules within ~0.3 s"
        await msgs[0].ack()
        # Fired once only.
        try:
            again = await sub.fetch(1, timeout=1)
        except TimeoutError:
            again = []
        assert again == []
    finally:
        await js.delete_stream("T3_SCHED")
        await nc.close()
