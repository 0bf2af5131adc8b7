"""The ttl-planner reconcile hands runs to; with --dry-run it reads the real schedules and
writes nothing, so the counts say what a real run would change."""

from __future__ import annotations

from datetime import datetime

from cloudevents.core.base import BaseCloudEvent
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from lapse.config import Streams
from lapse.edges.kubernetes.policies import policies_in_effect
from lapse.edges.schedules import NatsScheduleStore
from lapse.events.run import Target
from lapse.functions.ports import PendingSchedule, ScheduleStore
from lapse.functions.trust import Provenance
from lapse.functions.ttl_planner import Planner
from lapse.operations.reconcile.counts import ReconcileError
from lapse.runtime.resources import Resources


class ReadOnlySchedules:
    """--dry-run: reads the real schedules, so the counts say what a real run would change,
    and writes nothing."""

    def __init__(self, store: ScheduleStore) -> None:
        self._store = store

    async def get(
        self, target: Target, uid: str, *, with_due: bool = False
    ) -> PendingSchedule | None:
        return await self._store.get(target, uid, with_due=with_due)

    async def put(
        self,
        target: Target,
        uid: str,
        deadline: datetime,
        due_event: BaseCloudEvent,
        *,
        provenance: Provenance,
    ) -> None:
        pass

    async def cancel(self, target: Target, uid: str) -> bool:
        return await self._store.get(target, uid) is not None


class DiscardingEmitter:
    async def emit(self, event: BaseCloudEvent) -> None:
        pass


async def check_streams(js: JetStreamContext, streams: Streams) -> None:
    for name in (streams.schedule, streams.audit, streams.dlq):
        try:
            await js.stream_info(name)
        except NotFoundError:
            raise ReconcileError(
                f"NATS stream {name} does not exist: run `lapse infra apply` "
                "(or start `lapse up`) first"
            ) from None


async def build_planner(resources: Resources, *, dry_run: bool) -> Planner:
    js = await resources.jetstream()
    streams = resources.config.nats.streams
    await check_streams(js, streams)
    # Reconcile re-derives every past deadline whose object still exists, whatever happened
    # to its due message: one that was handled (a 403 since fixed) is issued again, one still
    # in a reaper's hands is not (see NatsScheduleStore).
    store: ScheduleStore = NatsScheduleStore(js, streams, rederive_handled=True)
    if dry_run:
        store = ReadOnlySchedules(store)
    return Planner(
        schedules=store,
        emitter=DiscardingEmitter() if dry_run else await resources.emitter(),
        # The policy objects too: reconcile must decide what `lapse up` decides.
        policies=await policies_in_effect(resources.objects(), resources.config.policies),
        kinds=resources.config.kinds,
        lister=resources.objects(),
    )
