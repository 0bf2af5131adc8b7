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
A handler that takes batches (`BatchHandler`: the row-reaper) gets each fetch's events in
one call and answers per event; every message is then settled on its own answer as above.
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from cloudevents.core.base import BaseCloudEvent
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

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
from lapse.functions.trust import Trust
from lapse.runtime.consumers import durable_name
from lapse.runtime.outages import Backoff, Outages, nats_unavailable
from lapse.runtime.routing import Route
from lapse.runtime.trust import Delivery, Source, trust_of_message
from lapse.telemetry import process_span, record_dead_letter, record_retry
from lapse.telemetry.names import RETRY_DELAY, RETRY_REASON

log = logging.getLogger(__name__)

SOURCE = "/lapse/dispatcher"


@runtime_checkable
class BatchHandler(Handler, Protocol):
    """A handler that also takes a fetch's events together (the row-reaper's
    `handle_batch`): one result per event, in order - the events it emitted for it, else
    the exception `handle` would have raised for it."""

    async def handle_batch(
        self, events: Sequence[tuple[BaseCloudEvent, Trust]]
    ) -> list[list[BaseCloudEvent] | Exception]: ...


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
                if isinstance(subscription.handler, BatchHandler) and len(msgs) > 1:
                    await self._start_batches(subscription, msgs)
                    continue
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

    async def _start_batches(self, subscription: Subscription, msgs: list[Msg]) -> None:
        """The fetch as one handler call, taking one of the `concurrency` slots as one
        event would: a batch is one transaction at a time (a round per set of events that
        name no rows in common), so up to `concurrency` of them run side by side as single
        events' transactions do (the messages held stay bounded by the consumer's
        max_ack_pending)."""
        await self._slots.acquire()
        task = asyncio.create_task(self._deliver_batch(subscription, msgs))
        self._inflight.add(task)
        task.add_done_callback(self._finished)

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
        attempt = msg.metadata.num_delivered if msg.metadata else 1
        trust = self._trust(route, msg)
        event, problem = _decode(msg)
        with _delivery_span(msg, route, event, attempt) as span:
            # Not fit (not a CloudEvent, another target's): settled by `_fits` itself.
            if not await self._fits(msg, route, event, problem, attempt) or event is None:
                return
            result: Exception | None = None
            try:
                await subscription.handler.handle(event, trust)
            except Exception as exc:
                result = exc
            await self._settle(msg, route, event, result, span)

    async def _deliver_batch(self, subscription: Subscription, msgs: list[Msg]) -> None:
        try:
            await self._handle_batch(subscription, msgs)
        finally:
            for msg in msgs:
                self._held.pop(id(msg), None)

    async def _handle_batch(self, subscription: Subscription, msgs: list[Msg]) -> None:
        """A fetch's messages handed to a `BatchHandler` together (the row-reaper: one
        transaction for runs that share no rows); each message is still settled on its
        own - acked once its own outcome is emitted, NAKed or dead-lettered for its own
        failure."""
        route = subscription.route
        handler = subscription.handler
        assert isinstance(handler, BatchHandler)
        ready: list[tuple[Msg, BaseCloudEvent, Trust]] = []
        for msg in msgs:
            attempt = msg.metadata.num_delivered if msg.metadata else 1
            event, problem = _decode(msg)
            if event is None or not route.matches(event.get_attributes()):
                with _delivery_span(msg, route, event, attempt):
                    await self._fits(msg, route, event, problem, attempt)
                continue
            ready.append((msg, event, self._trust(route, msg)))
        if not ready:
            return
        answers: list[list[BaseCloudEvent] | Exception]
        try:
            answers = await handler.handle_batch([(event, trust) for _, event, trust in ready])
            if len(answers) != len(ready):
                raise RuntimeError(f"{len(answers)} results for {len(ready)} events")
        except Exception as exc:  # nothing is known done: every message goes again
            answers = [exc] * len(ready)
        for (msg, event, _), answer in zip(ready, answers, strict=True):
            result = answer if isinstance(answer, Exception) else None
            attempt = msg.metadata.num_delivered if msg.metadata else 1
            with _delivery_span(msg, route, event, attempt) as span:
                await self._settle(msg, route, event, result, span)

    def _trust(self, route: Route, msg: Msg) -> Trust:
        """What the handler may believe of `msg`: decided from where it came from (the
        consumer and stream its JetStream metadata names), in lapse/runtime/trust.py."""
        source = Source(route.stream(self._config.streams), _durable(route))
        return trust_of_message(msg.headers, _delivery(msg), source)

    async def _fits(
        self,
        msg: Msg,
        route: Route,
        event: BaseCloudEvent | None,
        problem: str | None,
        attempt: int,
    ) -> bool:
        """Whether the message goes to the handler; if not, it is settled here: not a
        CloudEvent, dead-lettered; another target's event on the same subject, acked."""
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
            return False
        if not route.matches(event.get_attributes()):
            await msg.ack()  # same subject, other target: not this route's event
            return False
        return True

    async def _settle(
        self,
        msg: Msg,
        route: Route,
        event: BaseCloudEvent,
        result: Exception | None,
        span: Span,
    ) -> None:
        """Ack once the handler is done with the message (`result` None); otherwise wait
        out a transient failure, or retry and in the end dead-letter a bug."""
        key = msg.metadata.sequence.stream if msg.metadata else 0
        attempt = msg.metadata.num_delivered if msg.metadata else 1
        loop = asyncio.get_running_loop()
        if isinstance(result, RetryLater):
            await self._wait_out(
                msg, route, key, attempt, result.reason, result.delay, "RetryLater"
            )
            return
        if result is not None:
            if (unavailable := nats_unavailable(result)) is not None:
                await self._wait_out(msg, route, key, attempt, unavailable, None, "NATS")
                return
            log.error("%s: handler failed on %s", route.function, event.get_id(), exc_info=result)
            span.set_status(Status(StatusCode.ERROR, f"{type(result).__name__}: {result}"))
            delay = self._backoff.delay(attempt)
            reason = f"{type(result).__name__}: {result}"
            await self._retry(msg, route, attempt, reason, delay, event, type(result).__name__)
            self.outages.done(route.function, key, loop.time())
            return
        await msg.ack()
        self.outages.done(route.function, key, loop.time())

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


def _decode(msg: Msg) -> tuple[BaseCloudEvent | None, str | None]:
    """The message's CloudEvent, or None and why it is not one."""
    try:
        return from_nats(msg.headers, msg.data), None
    except InvalidEvent as exc:
        return None, exc.reason


def _delivery_span(
    msg: Msg, route: Route, event: BaseCloudEvent | None, attempt: int
) -> contextlib.AbstractContextManager[Span]:
    """The `process` span of one delivery, single or in a batch alike."""
    return process_span(
        msg.subject,
        event,
        hop_trace_context(msg.headers),
        subscription=_durable(route),
        attempt=attempt,
    )


def _durable(route: Route) -> str:
    return durable_name(route)


def _delivery(msg: Msg) -> Delivery | None:
    """The message's JetStream metadata (from its `$JS.ACK...` reply subject), or None when
    it has none: then no JetStream consumer delivered it."""
    try:
        metadata = msg.metadata
    except Exception:  # nats-py raises on a reply subject that is not a JetStream ack's
        return None
    if metadata is None or metadata.num_delivered is None:
        return None
    return Delivery(
        stream=metadata.stream or "",
        consumer=metadata.consumer or "",
        delivered=metadata.num_delivered,
    )


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
