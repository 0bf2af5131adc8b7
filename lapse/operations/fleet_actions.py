"""Actions from the fleet's hub (docs/fleet.md, "Actions from the hub"): the hub asks one
cluster, by a request on a subject only that cluster's leaf receives; the cluster's own
`lapse up` carries it out as its own `lapse brake|dlq` would (its bounds, its identity)
and answers on a subject only that cluster's leaf may publish.

NATS carries the request and its answer; nothing is stored on the hub, nothing is
replicated. A verb the cluster does not know, or a change asked on the read subject, is
answered `refused` with the reason, never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any, Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from lapse.config import LapseConfig
from lapse.edges.limits import SCOPES
from lapse.embedded.fleet_identities import (
    ACT,
    READ,
    action_subject,
    reply_prefix,
    responder_subscriptions,
)
from lapse.errors import LapseError
from lapse.operations.brake import move_brake
from lapse.operations.dlq import Filter, dead_letters, replay

log = logging.getLogger("lapse")

# verb -> whether it changes something (sent on `act`, lapse-hub-admin only).
VERBS: Final = {
    "brake-status": False,
    "brake-engage": True,
    "brake-release": True,
    "dlq-list": False,
    "dlq-replay": True,
    "plan": False,
}
# A verb carried out by a layer above this one (`plan`: lapse/cli/plan_run.py), handed to
# serve_actions by lapse up: the request's body -> the answer's document.
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
# How many dead letters one answer lists at most (a NATS message is bounded: 1 MiB).
MAX_ROWS: Final = 1000


class ActionFailed(LapseError):
    """The cluster refused the action, failed it, or did not answer."""


def filter_document(chosen: Filter) -> dict[str, Any]:
    return {
        "namespace": chosen.namespace,
        "name": chosen.name,
        "target": chosen.target,
        "stage": chosen.stage,
        "reason": chosen.reason,
        "since": chosen.since.isoformat() if chosen.since else None,
        "ids": sorted(chosen.ids),
    }


def filter_of(body: dict[str, Any]) -> Filter:
    since = body.get("since")
    return Filter(
        namespace=_text(body, "namespace"),
        name=_text(body, "name"),
        target=_text(body, "target"),
        stage=_text(body, "stage"),
        reason=_text(body, "reason"),
        since=datetime.fromisoformat(since) if isinstance(since, str) else None,
        ids=frozenset(int(i) for i in body.get("ids") or ()),
    )


def _text(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key}: not a string")
    return value


def refusal(kind: str, verb: str) -> str | None:
    """Why a request for `verb` on the `kind` subject is not carried out (None: it is)."""
    if verb not in VERBS:
        return f"unknown action {verb!r} (known: {', '.join(VERBS)})"
    if VERBS[verb] and kind != ACT:
        return f"{verb} changes the cluster: it is sent as an action (lapse-hub-admin)"
    return None


async def carry_out(
    js: JetStreamContext, config: LapseConfig, verb: str, body: dict[str, Any]
) -> dict[str, Any]:
    """Do `verb` in this cluster, as its own command would; the answer's document."""
    if verb == "plan":
        raise ValueError("plan: this lapse up does not preview (it has no cluster to list)")
    if verb.startswith("brake-"):
        target = _text(body, "target")
        if target is not None and target not in SCOPES:
            raise ValueError(f"target: one of {', '.join(SCOPES)}")
        seconds = body.get("seconds")
        said = await move_brake(
            js,
            config,
            "status" if verb == "brake-status" else verb.removeprefix("brake-"),  # type: ignore[arg-type]
            target,
            seconds=float(seconds) if seconds is not None else None,
        )
        return {"brake": said}
    chosen = filter_of(body.get("filter") or {})
    stream = config.nats.streams.dlq
    letters = [letter async for letter in dead_letters(js, stream, chosen)]
    if verb == "dlq-list":
        return {
            "items": [letter.row() for letter in letters[:MAX_ROWS]],
            "more": len(letters) > MAX_ROWS,
        }
    if not chosen.narrows and not body.get("all"):
        raise ValueError("dlq replay: say which entries: IDs, a filter or all")
    report = await replay(js, config.nats.streams, letters, dry_run=bool(body.get("dryRun")))
    return report.summary()


async def serve_actions(
    nc: NATS,
    config: LapseConfig,
    cluster: str,
    stop: asyncio.Event,
    handlers: Mapping[str, Handler] | None = None,
) -> None:
    """Answer the hub's requests to `cluster` until `stop` (lapse up, as the cluster's
    admin identity, the only one of its identities that receives them); `handlers` carry
    out the verbs a layer above does (plan)."""
    js = nc.jetstream()

    async def handle(msg: Msg) -> None:
        kind, verb = msg.subject.split(".")[-2:]
        if not msg.reply.startswith(f"{reply_prefix(cluster)}."):
            # Its outcome could reach no one: not carried out, and said here.
            log.warning("fleet: %s refused: no answer subject of this cluster's", verb)
            return
        answer: dict[str, Any]
        problem = refusal(kind, verb)
        if problem is not None:
            answer = {"outcome": "refused", "reason": problem}
        else:
            try:
                body = json.loads(msg.data or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("not a JSON object")
                handler = (handlers or {}).get(verb)
                done = await (handler(body) if handler else carry_out(js, config, verb, body))
                answer = {"outcome": "done", **done}
            except (ValueError, LapseError) as exc:
                answer = {"outcome": "refused", "reason": str(exc)}
            except Exception as exc:
                log.exception("fleet: %s from the hub failed", verb)
                answer = {"outcome": "failed", "reason": f"{type(exc).__name__}: {exc}"}
        log.info("fleet: %s from the hub: %s", verb, answer["outcome"])
        said = json.dumps({"cluster": cluster, **answer}, default=str)
        await nc.publish(msg.reply, said.encode())

    subscriptions = [await nc.subscribe(s, cb=handle) for s in responder_subscriptions(cluster)]
    await nc.flush()
    log.info("fleet: answering the hub's actions for cluster %r", cluster)
    try:
        await stop.wait()
    finally:
        for sub in subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def ask(
    nc: NATS,
    cluster: str,
    verb: str,
    body: dict[str, Any],
    *,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Send `verb` to `cluster` from the hub and return its answer (ActionFailed when the
    cluster refused it, failed it, or did not answer within `timeout`)."""
    kind = ACT if VERBS.get(verb) else READ
    inbox = f"{reply_prefix(cluster)}.{secrets.token_hex(16)}"
    answered: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

    async def on_answer(msg: Msg) -> None:
        if not answered.done():
            answered.set_result(msg)

    sub = await nc.subscribe(inbox, cb=on_answer, max_msgs=1)
    try:
        await nc.flush()
        await nc.publish(
            action_subject(cluster, kind, verb), json.dumps(body).encode(), reply=inbox
        )
        try:
            msg = await asyncio.wait_for(answered, timeout)
        except TimeoutError:
            raise ActionFailed(
                f"cluster {cluster!r} did not answer {verb} within {timeout:.0f}s (is its "
                "lapse up running and connected to the hub? lapse status --fleet)"
            ) from None
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    if (msg.headers or {}).get("Status") == "503":  # the server: nobody subscribed
        raise ActionFailed(
            f"no lapse up of cluster {cluster!r} is connected to the hub to carry out {verb} "
            "(lapse status --fleet)"
        )
    answer: dict[str, Any] = json.loads(msg.data)
    if answer.get("outcome") != "done":
        raise ActionFailed(
            f"cluster {cluster!r} {answer.get('outcome')} {verb}: {answer.get('reason')}"
        )
    return answer
