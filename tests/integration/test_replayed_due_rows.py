"""Minimised from the forged-input suite (tests/e2e/test_forged_inputs.py): a due event
published again on its `lapse.due.<target>.<uid>` subject after its schedule moved later
must not stand for the deadline lapse stored.

The suite found it: `lapse dlq replay` (lapse's own identity, so NATS permissions do not
stop it) or anyone replaying a database due event on its due subject after the rows'
deadline moved an hour on made the replayed message the newest on the (target, uid), and
the schedule store answered it as the fired deadline. The row-reaper proves its deadline
from the store alone, so it took the replay as proof: with the run's finish time agreeing
it deletes at once; here the database said it finished later, so it put a schedule for
seconds away over the stored hour.

The server removes a schedule when it fires it: a due message newer than a schedule still
pending for a later deadline was not fired from it, and the pending deadline stands.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from nats.js import JetStreamContext

from lapse.config import Streams
from lapse.edges.schedules import NatsScheduleStore
from lapse.events.nats_binding import to_nats
from lapse.events.run import Target
from lapse.events.subjects import due_subject
from lapse.functions.trust import Provenance
from tests.integration.test_observed import due_event

STREAMS = Streams()


async def test_a_due_message_replayed_over_a_later_pending_schedule_is_not_the_deadline(
    lapse_streams: JetStreamContext,
) -> None:
    store = NatsScheduleStore(lapse_streams, STREAMS)
    for target in Target:
        uid = str(uuid.uuid4())
        later = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
        await store.put(target, uid, later, due_event(uid, later), provenance=Provenance.CLAIMED)
        # The due event of an earlier deadline of the same run, published again.
        earlier = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
        replayed = to_nats(due_event(uid, earlier))
        await lapse_streams.publish(
            due_subject(target, uid), replayed.body, headers=replayed.headers
        )

        stored = await store.get(target, uid)
        assert stored is not None
        assert (stored.deadline, stored.fired) == (later, False), target
