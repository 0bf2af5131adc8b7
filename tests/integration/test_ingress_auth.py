"""Who may post to the ingress, what it stores, and what it believes: against the real NATS
server, over real HTTP (hypercorn, as `lapse up` serves it)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest
from nats.js import JetStreamContext

from lapse.config import ConfigError, LapseConfig, Streams
from lapse.edges.publishing import NatsEmitter, NatsPublisher
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port
from lapse.events.nats_binding import from_nats
from lapse.events.observed import OBSERVED_EXTENSION, OBSERVED_HEADER
from lapse.functions.trust import Provenance
from lapse.runtime.ingress import Ingress, nats_ingress
from tests.integration.test_ingress import WORKFLOW, apiserver_update
from tests.integration.test_ingress_refusals import _lapse, recorded, served, stored_events

pytestmark = [pytest.mark.nats]

STREAMS = Streams()
TOKEN = "tok-3f9a1c0e5b7d4e2a9c8b"
GUESS = "guess-0b1c2d3e4f5a6b7c"


def with_token(tmp_path: Path) -> LapseConfig:
    path = tmp_path / "ingress-token"
    path.write_text(TOKEN + "\n")
    return LapseConfig.model_validate({"ingress": {"token_file": str(path)}})


async def test_a_configured_token_is_required_and_never_echoed(
    lapse_streams: JetStreamContext, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    js = lapse_streams
    app = await nats_ingress(js, with_token(tmp_path), listen="0.0.0.0:8080")
    body = json.dumps(WORKFLOW)
    headers = apiserver_update(WORKFLOW)
    async with served(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        missing = await http.post("/", headers=headers, content=body)
        wrong = await http.post(
            "/", headers={**headers, "authorization": f"Bearer {GUESS}"}, content=body
        )
        basic = await http.post(
            "/", headers={**headers, "authorization": f"Basic {GUESS}"}, content=body
        )
        right = await http.post(
            "/", headers={**headers, "authorization": f"Bearer {TOKEN}"}, content=body
        )
        # Probes carry no token and need none.
        assert (await http.get("/readyz")).status_code == 200

    for refused in (missing, wrong, basic):
        assert refused.status_code == 401, refused.text
        assert refused.headers["www-authenticate"].startswith('Bearer realm="lapse"')
    assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
    assert right.status_code == 202, right.text
    assert await stored_events(js) == 1  # only the authenticated one

    letters = await recorded(js, 3)
    reasons = [x.failed.reason for x in letters if x.failed]
    assert reasons == [
        "401: no bearer token (from 127.0.0.1)",
        "401: wrong bearer token (from 127.0.0.1)",
        "401: Authorization is not a bearer token (from 127.0.0.1)",
    ]
    # Nothing of an unauthenticated request is kept, and no token in any answer or log.
    assert all(x.failed is not None and x.failed.original is None for x in letters)
    seen = [missing.text, wrong.text, basic.text, right.text, caplog.text, *reasons]
    seen += [json.dumps(dict(r.headers)) for r in (missing, wrong, basic, right)]
    assert not [text for text in seen if TOKEN in text or GUESS in text]


async def test_listening_beyond_loopback_without_a_token_does_not_start(
    lapse_streams: JetStreamContext, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=r"^ingress\.token_file: required to listen on"):
        await nats_ingress(lapse_streams, LapseConfig(), listen="0.0.0.0:8080")

    config = {
        "nats": {"url": nats_server.url},
        # Never read: the listen address is refused before lapse up touches a cluster.
        "kubernetes": {"kubeconfig": str(tmp_path / "absent.kubeconfig")},
    }
    port = free_port()
    state = tmp_path / "state"
    result = await asyncio.to_thread(
        _lapse, config, tmp_path, "up", "--state-dir", str(state), "--listen", f"0.0.0.0:{port}"
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lapse: ingress.token_file: "), result.stderr
    assert not (state / "nats").exists()  # refused before any server was started

    # A token file that cannot be read is named, its content never shown.
    unreadable = tmp_path / "token-dir"
    unreadable.mkdir()
    config["ingress"] = {"token_file": str(unreadable)}
    result = await asyncio.to_thread(
        _lapse, config, tmp_path, "up", "--state-dir", str(state), "--listen", f"0.0.0.0:{port}"
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("lapse: ingress.token_file: cannot read")


async def test_a_type_no_handler_takes_is_422_and_recorded(
    lapse_streams: JetStreamContext,
) -> None:
    """A `lapse up` whose planner is not running takes no ApiServerSource events: stored,
    they would wait for a consumer that does not exist."""
    js = lapse_streams
    app = Ingress(
        NatsPublisher(js, STREAMS, provenance=Provenance.CLAIMED).publish,
        record=NatsEmitter(js, STREAMS).emit,
        accepted=frozenset({"dev.lapse.run.finished.v1"}),
    )
    async with served(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        answer = await http.post(
            "/", headers=apiserver_update(WORKFLOW), content=json.dumps(WORKFLOW)
        )
        running = {**WORKFLOW, "status": {"phase": "Running"}}
        ignored = await http.post(
            "/", headers=apiserver_update(running), content=json.dumps(running)
        )
    assert answer.status_code == 422, answer.text
    assert "dev.knative.apiserver.resource.update" in answer.text
    # What needs no action stores nothing, so it needs no handler: still 202 ignored.
    assert ignored.status_code == 202 and ignored.text.startswith("ignored")
    assert await stored_events(js) == 0
    [letter] = await recorded(js, 1)
    assert letter.failed is not None and letter.failed.reason == f"422: {answer.text}"
    assert letter.failed.original is not None
    assert letter.failed.original.attributes["type"] == "dev.knative.apiserver.resource.update"


async def test_the_senders_observed_mark_is_not_passed_on(
    lapse_streams: JetStreamContext,
) -> None:
    """A sender claiming lapse read the object itself would spare the reaper its GET
    before the DELETE; the claim is dropped at the door, in both of its forms."""
    js = lapse_streams
    app = await nats_ingress(js, LapseConfig())
    headers = {
        **apiserver_update(WORKFLOW),
        f"ce-{OBSERVED_EXTENSION}": "apiserver",
        OBSERVED_HEADER: "apiserver",
    }
    async with served(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        answer = await http.post("/", headers=headers, content=json.dumps(WORKFLOW))
    assert answer.status_code == 202, answer.text
    stored = await js.get_last_msg(STREAMS.events, "lapse.events.>")
    names = {name.lower() for name in (stored.headers or {})}
    assert f"ce-{OBSERVED_EXTENSION}" not in names
    assert OBSERVED_HEADER.lower() not in names
    event = from_nats(stored.headers, stored.data or b"")
    assert OBSERVED_EXTENSION not in event.get_attributes()
    assert event.get_type() == "dev.knative.apiserver.resource.update"  # the rest is kept
