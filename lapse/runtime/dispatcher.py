"""The local stand-in for the Knative Broker: JetStream consumers feeding handlers.

One durable pull consumer per route (per Trigger), explicit acks:
- the handler returned: ack;
- `RetryLater` (a transient failure: the API server or database unreachable, 429, 5xx),
  or NATS itself unavailable (a server restarting, a stream leader being elected): NAK with
  a capped, jittered back-off, for as long as it takes - never dead-lettered for it; the
  wait is visible (lapse.runtime.outages);
- an unexpected exception (a bug): NAK with a delay, and after `nats.max_deliver` tries a
  `cleanup.failed` with the reason goes to the dead letters, then the message is acked;
- not a CloudEvent: dead-lettered at once.
Nothing is acked before the handler is done, so a crash means redelivery, not loss. While
a message is held (fetched, queued or being handled) it is marked in progress every third
of `nats.ack_wait`: a short ack wait then only decides how soon the work of a process that
died is delivered again, never cuts short work that is still going on.

Each delivery is a CONSUMER span (`process <subject>`) from the hop context in the
message's `traceparent` header; a due event, delivered hours or days after it was
scheduled, starts a new trace that links back instead (see `lapse.telemetry.spans`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass

from cloudevents.core.base import BaseCloudEvent
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from lapse.config import NatsConfig
from lapse.events.builder import build_event, parse_payload
from lapse.events.errors import InvalidEvent
from lapse.events.models import CleanupFailed
from lapse.events.nats_binding import from_nats, hop_trace_context
from lapse.events.original import capture_event, capture_message
from lapse.events.run import RunRef, Target
from lapse.events.types import EventType
from lapse.functions.ports import Emitter, Handler, RetryLater
from lapse.functions.tracing import creation_context
from lapse.runtime.outages import Backoff, Outages, nats_unavailable
from lapse.runtime.routing import Route
from lapse.runtime.trust import trust_of_message
from lapse.telemetry import process_span, record_dead_letter, record_retry
from lapse.telemetry.names import RETRY_DELAY, RETRY_REASON

log = logging.getLogger(__name__)

SOURCE = "/lapse/dispatcher"


@dataclass(frozen=True)
class Subscription:
    route: Route
    handler: Handler
    # A durable made for this route starts at the end of its stream rather than its
    # beginning: for a route added to a deployment whose stream already holds history
    # (the bridge's outcomes, on the audit stream), which it must not replay.
    from_now: bool = False


class Dispatcher:
    def __init__(
        self,
        js: JetStreamContext,
        emitter: Emitter,
        nats_config: NatsConfig,
        subscriptions: list[Subscription],
        *,
        concurrency: int = 64,
        batch: int = 64,
        backoff: Backoff = Backoff(),  # noqa: B008 - frozen, so one shared default is safe
    ) -> None:
        self._js = js
        self._emitter = emitter
        self._config = nats_config
        self._subscriptions = subscriptions
        self._slots = asyncio.Semaphore(concurrency)
        self._batch = batch
        self._backoff = backoff
        self._stopping = asyncio.Event()
        self._inflight: set[asyncio.Task[None]] = set()
        # Fetched and not yet acked or NAKed, by id (nats-py's Msg is not hashable).
        self._held: dict[int, Msg] = {}
        self.outages = Outages()

    async def run(self) -> None:
        """Consume until `stop()`; then let in-flight handlers finish. A consumer loop that
        fails ends the run with its exception (after the in-flight work), never silently."""
        loops = [asyncio.create_task(self._consume(s)) for s in self._subscriptions]
        heartbeat = asyncio.create_task(self._heartbeat(), name="heartbeat")
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            await asyncio.wait([stopping, *loops], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            for loop in loops:
                loop.cancel()
            results = await asyncio.gather(*loops, return_exceptions=True)
            if self._inflight:
                await asyncio.wait(self._inflight)
            heartbeat.cancel()
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            raise failed[0]

    def stop(self) -> None:
        self._stopping.set()

    async def _take_over(self, route: Route, stream: str, config: ConsumerConfig) -> ConsumerConfig:
        if route.formerly is None:
            return config
        old = _durable(dataclasses.replace(route, name=route.formerly))
        return await take_over_position(self._js, stream, _durable(route), old, config)

    async def _consume(self, subscription: Subscription) -> None:
        route = subscription.route
        stream = route.stream(self._config.streams)
        config = ConsumerConfig(
            durable_name=_durable(route),
            filter_subject=route.subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.NEW if subscription.from_now else DeliverPolicy.ALL,
            ack_wait=self._config.ack_wait.total_seconds(),
            # Unlimited: a transient failure is retried for as long as it lasts, and lapse
            # dead-letters everything else itself after nats.max_deliver tries.
            max_deliver=-1,
            max_ack_pending=10_000,
        )
        sub = await self._subscribe_until_ready(route, stream, config)
        if sub is None:
            return  # stopped while NATS was unavailable
        log.info("%s: consuming %s from %s", route.function, route.subject, stream)
        try:
            while not self._stopping.is_set():
                try:
                    msgs = await sub.fetch(self._batch, timeout=1.0)
                except TimeoutError:
                    continue
                except Exception as exc:  # NATS reconnecting: keep trying
                    log.warning("%s: fetch failed: %s", route.name, exc)
                    await asyncio.sleep(1.0)
                    continue
                self._held.update((id(msg), msg) for msg in msgs)
                for msg in msgs:
                    await self._slots.acquire()
                    task = asyncio.create_task(self._deliver(subscription, msg))
                    self._inflight.add(task)
                    task.add_done_callback(self._finished)
        finally:
            # The pull subscription holds the connection open: without this, draining it
            # at shutdown waits out the drain timeout.
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _subscribe_until_ready(
        self, route: Route, stream: str, config: ConsumerConfig
    ) -> JetStreamContext.PullSubscription | None:
        """The route's durable consumer, created or updated (ack wait, max deliver) and
        subscribed to. NATS unavailable (a stream leader being elected, a node restarting,
        a JetStream API answer later than its timeout on a loaded cluster) is waited out,
        as everywhere else: it once ended the whole dispatcher at start-up. None if
        stopped meanwhile."""
        attempt = 0
        while not self._stopping.is_set():
            try:
                ready = await self._take_over(route, stream, config)
                await self._js.add_consumer(stream, ready)
                return await self._js.pull_subscribe(
                    route.subject, durable=ready.durable_name, stream=stream, config=ready
                )
            except Exception as exc:
                reason = nats_unavailable(exc)
                if reason is None:
                    raise
                attempt += 1
                delay = self._backoff.delay(attempt)
                log.warning(
                    "%s: cannot subscribe to %s yet: %s; again in %.0fs",
                    route.function, route.subject, reason, delay,
                )  # fmt: skip
                await asyncio.sleep(delay)
        return None

    async def _heartbeat(self) -> None:
        """Mark every held message in progress, so the server redelivers none of them while
        this process lives, however long a handler waits (rate limit, slow API)."""
        interval = self._config.ack_wait.total_seconds() / 3
        while True:
            await asyncio.sleep(interval)
            for msg in list(self._held.values()):
                with contextlib.suppress(Exception):  # acked meanwhile, or reconnecting
                    await msg.in_progress()

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._slots.release()

    async def _deliver(self, subscription: Subscription, msg: Msg) -> None:
        try:
            await self._handle(subscription, msg)
        finally:
            self._held.pop(id(msg), None)

    async def _handle(self, subscription: Subscription, msg: Msg) -> None:
        route = subscription.route
        key = msg.metadata.sequence.stream if msg.metadata else 0
        attempt = msg.metadata.num_delivered if msg.metadata else 1
        trust = trust_of_message(msg.headers, attempt)
        try:
            event: BaseCloudEvent | None = from_nats(msg.headers, msg.data)
            problem = None
        except InvalidEvent as exc:
            event, problem = None, exc.reason
        with process_span(
            msg.subject,
            event,
            hop_trace_context(msg.headers),
            subscription=_durable(route),
            attempt=attempt,
        ) as span:
            if event is None:
                await self._dead_letter(
                    CleanupFailed(
                        reason=f"not a CloudEvent: {problem}",
                        stage=route.function,
                        attempts=attempt,
                        original=capture_message(msg.headers, msg.data),
                    )
                )
                await msg.ack()
                return
            if not route.matches(event.get_attributes()):
                await msg.ack()  # same subject, other target: not this route's event
                return
            try:
                await subscription.handler.handle(event, trust)
            except RetryLater as exc:
                await self._wait_out(msg, route, key, attempt, exc.reason, exc.delay, "RetryLater")
                return
            except Exception as exc:
                if (unavailable := nats_unavailable(exc)) is not None:
                    await self._wait_out(msg, route, key, attempt, unavailable, None, "NATS")
                    return
                log.exception("%s: handler failed on %s", route.function, event.get_id())
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
                delay = self._backoff.delay(attempt)
                reason = f"{type(exc).__name__}: {exc}"
                await self._retry(msg, route, attempt, reason, delay, event, type(exc).__name__)
                self.outages.done(route.function, key, asyncio.get_running_loop().time())
                return
            await msg.ack()
            self.outages.done(route.function, key, asyncio.get_running_loop().time())

    async def _wait_out(
        self,
        msg: Msg,
        route: Route,
        key: int,
        attempt: int,
        reason: str,
        hint: float | None,
        error_type: str,
    ) -> None:
        """Transient: delivered again after a back-off, for as long as it lasts."""
        loop = asyncio.get_running_loop()
        self.outages.waiting(route.function, key, reason, loop.time())
        delay = self._backoff.delay(attempt, hint)
        log.info("%s: try %d failed (%s); again in %.0fs", route.function, attempt, reason, delay)
        span = trace.get_current_span()
        span.add_event("nak", {RETRY_REASON: reason[:256], RETRY_DELAY: delay})
        record_retry(route.function, error_type)
        with contextlib.suppress(Exception):
            await msg.nak(delay=delay)

    async def _retry(
        self,
        msg: Msg,
        route: Route,
        attempt: int,
        reason: str,
        delay: float,
        event: BaseCloudEvent,
        error_type: str,
    ) -> None:
        span = trace.get_current_span()
        if attempt >= self._config.max_deliver:
            span.add_event("dead-lettered", {RETRY_REASON: reason[:256]})
            record_dead_letter(event)
            run, target = _run_and_target(event)
            await self._dead_letter(
                CleanupFailed(
                    run=run,
                    target=target,
                    reason=f"gave up after {attempt} tries: {reason}",
                    stage=route.function,
                    attempts=attempt,
                    original=capture_event(event),
                )
            )
            await msg.ack()
            return
        log.info("%s: try %d failed (%s); again in %.0fs", route.function, attempt, reason, delay)
        span.add_event("nak", {RETRY_REASON: reason[:256], RETRY_DELAY: delay})
        record_retry(route.function, error_type)
        with contextlib.suppress(Exception):
            await msg.nak(delay=delay)

    async def _dead_letter(self, failed: CleanupFailed) -> None:
        await self._emitter.emit(
            build_event(EventType.CLEANUP_FAILED, source=SOURCE, data=failed, **creation_context())
        )


def _durable(route: Route) -> str:
    return f"lapse-{route.name}"


async def take_over_position(
    js: JetStreamContext, stream: str, new: str, old: str, config: ConsumerConfig
) -> ConsumerConfig:
    """`config` for the durable `new`, starting where the durable `old` (a renamed route's)
    has acknowledged up to; `old` is deleted once `new` exists. Unchanged when `new`
    already exists or `old` does not. Messages `old` held unacknowledged are delivered
    again by `new`, as after any restart: handlers are idempotent."""
    try:
        await js.consumer_info(stream, new)
        return config
    except NotFoundError:
        pass
    try:
        info = await js.consumer_info(stream, old)
    except NotFoundError:
        return config
    floor = info.ack_floor.stream_seq if info.ack_floor and info.ack_floor.stream_seq else 0
    moved = dataclasses.replace(
        config, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=floor + 1
    )
    await js.add_consumer(stream, moved)
    await js.delete_consumer(stream, old)
    log.warning(
        "route renamed: durable consumer %s replaced by %s, from stream sequence %d",
        old,
        new,
        floor + 1,
    )
    return moved


def _run_and_target(event: BaseCloudEvent) -> tuple[RunRef | None, Target | None]:
    """What the dead letter can say about the run, if the payload names one."""
    try:
        payload = parse_payload(event)
    except InvalidEvent:
        return None, None
    run = getattr(payload, "run", None)
    target = getattr(payload, "target", None)
    return (
        run if isinstance(run, RunRef) else None,
        target if isinstance(target, Target) else None,
    )
