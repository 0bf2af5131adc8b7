"""Reading a stream without a consumer (lapse/edges/streams.py): batched direct gets where
the stream allows them, one message get at a time where it does not (a stream made before
this release, until `lapse infra apply` or `lapse up` updates it), the same answers."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from lapse.edges import streams
from lapse.edges.nats import connect
from lapse.embedded.nats import EmbeddedNats

pytestmark = [pytest.mark.nats]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "message-gets"])
async def test_reads_and_counts_the_same_either_way(
    nats_server: EmbeddedNats, direct: bool
) -> None:
    nc = await connect(nats_server.url)
    js: JetStreamContext = nc.jetstream()
    name = f"READS_{uuid.uuid4().hex[:8]}"
    prefix = name.lower()
    await js.add_stream(
        StreamConfig(name=name, subjects=[f"{prefix}.>"], allow_direct=direct or None)
    )
    try:
        # More than one batch of the wanted subject, interleaved with others.
        # Core publishes (the stream stores them all the same), then one flush: fast.
        for i in range(1200):
            subject = f"{prefix}.want.{i}" if i % 2 == 0 else f"{prefix}.other.{i}"
            await nc.publish(subject, str(i).encode(), headers={"N": str(i)})
        await nc.flush()
        await js.publish(f"{prefix}.other.fence", b"-1")  # stored after all of the above
        middle = datetime.now(UTC)
        for i in range(1200, 1210):
            await js.publish(f"{prefix}.want.{i}", str(i).encode(), headers={"N": str(i)})
        read = [m async for m in streams.read_stream(js, name, f"{prefix}.want.>")]
        wanted = [i for i in range(1210) if i >= 1200 or i % 2 == 0]
        assert [int(body) for _, _, body in read] == wanted
        assert [headers for _, headers, _ in read] == [{"N": str(i)} for i in wanted]
        assert [seq for seq, _, _ in read] == [i + 1 if i < 1200 else i + 2 for i in wanted]
        # From a sequence, from a time, and a limit.
        later = [int(b) async for _, _, b in streams.read_stream(
            js, name, f"{prefix}.want.>", start_seq=1001
        )]  # fmt: skip
        assert later == [i for i in wanted if i >= 1000]
        since = [int(b) async for _, _, b in streams.read_stream(
            js, name, f"{prefix}.want.>", since=middle
        )]  # fmt: skip
        assert since == list(range(1200, 1210))
        limited = [s async for s, _, _ in streams.read_stream(js, name, f"{prefix}.>", limit=7)]
        assert limited == list(range(1, 8))
        assert await streams.count_messages(js, name, f"{prefix}.want.>") == len(wanted)
        assert await streams.count_messages(js, name, f"{prefix}.none.>") == 0
        assert [m async for m in streams.read_stream(js, name, f"{prefix}.none.>")] == []
    finally:
        await js.delete_stream(name)
        await nc.close()
