"""Random and mutated events through the HTTP ingress and straight onto lapse's NATS
subjects: the ingress answers every push 2xx or 4xx (never 5xx: a sender's fault is not
lapse's trouble), and the dispatcher and the real handlers (ttl-planner, object-reaper,
against the real kube-apiserver) never crash, never delete anything, and answer every
message (handled, or recorded in the dead letters).

Bounded for `make test`: LAPSE_FUZZ_EXAMPLES (default 300) pushes and as many messages;
hypothesis generates them, derandomized so a failure reproduces. The full size is
`LAPSE_FUZZ_EXAMPLES=50000` (100,000 events in all). The mutations start from valid
`run.finished`, `cleanup.due` and Knative ApiServerSource events and break them the ways
peers do: wrong types, missing or extra keys, huge or negative numbers, odd Unicode, uids
that cannot be subject tokens, garbage bodies, headers without a body, wrong content types.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.js import JetStreamContext

from lapse.config import LapseConfig, Streams
from lapse.embedded.nats import EmbeddedNats
from lapse.events.builder import build_event
from lapse.events.models import CleanupDue, RunFinished
from lapse.events.nats_binding import to_nats
from lapse.events.run import Engine, RunRef, Target
from lapse.events.types import EventType
from lapse.runtime.dispatcher import Dispatcher, Subscription
from lapse.runtime.ingress import nats_ingress
from lapse.runtime.outages import Backoff
from lapse.runtime.registry import build_handler
from lapse.runtime.resources import Resources
from lapse.runtime.routing import load_routes
from tests.conftest import KubeStack
from tests.stack import wait_for
from tests.unit.test_object_reaper_verdict import argo_workflow

pytestmark = [pytest.mark.kube, pytest.mark.nats]

STREAMS = Streams()
MESSAGES = int(os.environ.get("LAPSE_FUZZ_EXAMPLES", "300"))
NAMESPACE = "fuzz"

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)


def mutate(value: Any, draw: st.DrawFn, depth: int = 0) -> Any:
    """`value` with one part replaced, removed or added, chosen by hypothesis."""
    if isinstance(value, dict) and value and depth < 4:
        key = draw(st.sampled_from(sorted(value)))
        action = draw(st.sampled_from(["replace", "remove", "add", "descend"]))
        changed = dict(value)
        if action == "replace":
            changed[key] = draw(JSON)
        elif action == "remove":
            del changed[key]
        elif action == "add":
            changed[draw(st.text(max_size=12))] = draw(JSON)
        else:
            changed[key] = mutate(value[key], draw, depth + 1)
        return changed
    return draw(JSON)


def sentinel_ref(uid: str, name: str) -> RunRef:
    return RunRef(
        engine=Engine.ARGO,
        api_version="argoproj.io/v1alpha1",
        kind="Workflow",
        namespace=NAMESPACE,
        name=name,
        uid=uid,
        phase="Succeeded",
        finished_at=datetime.now(UTC) - timedelta(days=2),
    )


@st.composite
def messages(
    draw: st.DrawFn, sentinels: list[tuple[str, str]]
) -> tuple[str, dict[str, str], bytes]:
    uid, name = draw(st.sampled_from(sentinels))
    run = sentinel_ref(uid, name)
    if draw(st.booleans()):
        event = build_event(EventType.RUN_FINISHED, source="/fuzz", data=RunFinished(run=run))
        subject = f"lapse.events.{EventType.RUN_FINISHED.value}"
    else:
        due = CleanupDue(
            run=run,
            target=Target.KUBERNETES,
            deadline=datetime.now(UTC) - timedelta(days=1),
            policy="fuzz",
            scheduled_at=datetime.now(UTC) - timedelta(days=1),
        )
        event = build_event(EventType.CLEANUP_DUE, source="/fuzz", data=due)
        token = draw(st.sampled_from([uid, "x", uid.replace("-", "")]))
        subject = f"lapse.due.kubernetes.{token}"
    message = to_nats(event)
    headers = dict(message.headers)
    body: bytes = message.body
    part = draw(st.sampled_from(["data", "header", "body", "drop-header", "valid"]))
    if part == "data":
        body = json.dumps(mutate(json.loads(body), draw), default=str).encode()
    elif part == "header":
        name = draw(st.sampled_from(sorted(headers)))
        headers[name] = draw(st.text(max_size=60).filter(lambda s: "\r" not in s and "\n" not in s))
    elif part == "body":
        body = draw(st.binary(max_size=200))
    elif part == "drop-header":
        del headers[draw(st.sampled_from(sorted(headers)))]
    headers["Nats-Msg-Id"] = f"fuzz-{draw(st.uuids())}"
    return subject, headers, body


# What an HTTP header can carry on the wire: latin-1 text without line breaks.
HEADER_TEXT = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=60,
)


@st.composite
def pushes(draw: st.DrawFn, sentinels: list[dict[str, Any]]) -> tuple[dict[str, str], bytes]:
    """One HTTP push to the ingress: a sentinel Workflow as Knative's ApiServerSource sends
    it (binary or structured mode), mutated, or random bytes."""
    workflow = draw(st.sampled_from(sentinels))
    kind = draw(st.sampled_from(["add", "update", "delete"]))
    attributes = {
        "specversion": "1.0",
        "id": f"push-{draw(st.uuids())}",
        "source": "https://10.96.0.1:443",
        "type": f"dev.knative.apiserver.resource.{kind}",
        "subject": f"/apis/argoproj.io/v1alpha1/namespaces/{NAMESPACE}/workflows/x",
    }
    data: Any = workflow
    part = draw(st.sampled_from(["data", "attribute", "drop", "body", "content-type", "valid"]))
    if part == "data":
        data = mutate(workflow, draw)
    elif part == "attribute":
        attributes[draw(st.sampled_from(sorted(attributes)))] = draw(HEADER_TEXT)
    elif part == "drop":
        del attributes[draw(st.sampled_from(sorted(attributes)))]
    if draw(st.booleans()):  # binary content mode
        headers = {f"ce-{k}": v for k, v in attributes.items()}
        headers["content-type"] = "application/json"
        body = json.dumps(data, default=str).encode()
    else:
        headers = {"content-type": "application/cloudevents+json"}
        body = json.dumps({**attributes, "data": data}, default=str).encode()
    if part == "body":
        body = draw(st.binary(max_size=300))
    elif part == "content-type":
        headers["content-type"] = draw(HEADER_TEXT)
    return headers, body


def generate(strategy: st.SearchStrategy[Any]) -> list[Any]:
    found: list[Any] = []

    @settings(
        max_examples=MESSAGES,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(strategy)
    def collect(example: Any) -> None:
        found.append(example)

    collect()
    return found


async def test_mutated_events_on_the_subjects_crash_nothing_and_delete_nothing(
    kube: KubeStack, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    ns = kube.namespace(NAMESPACE)
    created = []
    for i in range(3):
        # Finished two days ago, but kept for a week by their own annotation: no event,
        # however mangled, may get them deleted.
        body = argo_workflow(
            f"sentinel-{i}",
            namespace=ns,
            finished_at=datetime.now(UTC) - timedelta(days=2),
            annotations={"lapse.dev/ttl": "7d"},
        )
        created.append(await kube.workflows.create(ns, body))
    sentinels = [(w["metadata"]["uid"], w["metadata"]["name"]) for w in created]
    batch = generate(messages(sentinels))
    pushed = generate(pushes(created))
    assert len(batch) == len(pushed) == MESSAGES

    config = LapseConfig.model_validate({"kubernetes": {"kubeconfig": str(kube.kubeconfig)}})
    async with Resources(config, nats_url=nats_server.url) as resources:
        routes = [r for r in load_routes() if r.function in ("ttl-planner", "object-reaper")]
        handlers = {
            name: await build_handler(name, resources) for name in {r.function for r in routes}
        }
        subscriptions = [Subscription(r, h) for r in routes if (h := handlers[r.function])]
        dispatcher = Dispatcher(
            lapse_streams,
            await resources.emitter(),
            config.nats.model_copy(update={"max_deliver": 2}),
            subscriptions,
            backoff=Backoff(first=0.05, cap=0.2),
        )
        running = asyncio.create_task(dispatcher.run())
        answers: Counter[int] = Counter()
        try:
            for subject, headers, body in batch:
                await lapse_streams.publish(subject, body, headers=headers)
            # Through the ingress `lapse up` serves (what it stores reaches the handlers too).
            ingress = await nats_ingress(lapse_streams, config)
            transport = httpx.ASGITransport(app=ingress)
            async with httpx.AsyncClient(transport=transport, base_url="http://lapse") as http:
                for headers, body in pushed:
                    raw = {k: v.encode("latin-1") for k, v in headers.items()}
                    response = await http.post("/", headers=raw, content=body)
                    answers[response.status_code] += 1
            await ingress.flush()

            async def all_answered() -> bool:
                for route in routes:
                    info = await lapse_streams.consumer_info(
                        route.stream(STREAMS), f"lapse-{route.name}"
                    )
                    if info.num_pending or info.num_ack_pending:
                        return False
                return True

            await wait_for(all_answered, timeout=180, interval=0.5)
        finally:
            dispatcher.stop()
            await asyncio.wait_for(running, 30)  # raises if a consumer loop crashed

    for uid, name in sentinels:
        still = await kube.workflows.get(ns, name)
        assert still is not None and still["metadata"]["uid"] == uid, f"{name} was deleted"
    dead = (await lapse_streams.stream_info(STREAMS.dlq)).state.messages
    audit = (await lapse_streams.stream_info(STREAMS.audit)).state.messages
    # Every message left a trace: a dead letter, or an audit record of what was decided
    # (schedules, reschedules, refusals); none vanished unanswered (checked above).
    assert dead > 0 and audit > 0
    # Every push was answered, and never with a 5xx: 202 stored or ignored, 4xx refused
    # (counted, and recorded up to ingress.max_records_per_minute).
    assert sum(answers.values()) == MESSAGES
    assert {code // 100 for code in answers} <= {2, 4}, answers
    assert answers[202] > 0 and answers[400] > 0, answers
    print(
        f"\nfuzz: {MESSAGES} messages on the subjects and {MESSAGES} pushes to the ingress "
        f"(answers {dict(sorted(answers.items()))}); {dead} dead-lettered, {audit} audit "
        "records, 0 crashes, 0 deleted"
    )
