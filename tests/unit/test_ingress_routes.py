"""What the ingress stores, a route consumes; where it listens decides whether it needs a
token. No servers: the Trigger file, the adapters and the configuration only."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cloudevents.core.v1.event import CloudEvent

import lapse.events.adapters
from lapse.config import ConfigError
from lapse.config.schema import IngressConfig
from lapse.events.adapters import Ignored, adapt_cloudevent
from lapse.events.errors import InvalidEvent
from lapse.events.types import EventType
from lapse.runtime.ingress import is_loopback, listen_token
from lapse.runtime.routing import load_routes, pushed_types

UNSUPPORTED = "unsupported"


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key in value:
            yield from _strings(key)
    elif isinstance(value, frozenset | set | tuple | list):
        for item in value:
            yield from _strings(item)


def candidate_types() -> set[str]:
    """Every event type named anywhere in the adapters (module constants, the keys of
    their tables) and every type of lapse's own contract: a type an adapter learns later
    is found here without this test changing."""
    found: set[str] = {str(t) for t in EventType}
    for module_info in pkgutil.iter_modules(lapse.events.adapters.__path__):
        module = importlib.import_module(f"lapse.events.adapters.{module_info.name}")
        for value in vars(module).values():
            found.update(s for s in _strings(value) if s.startswith("dev.") and " " not in s)
    return found


def adapters_store(event_type: str) -> bool:
    """Whether the adapters would let an event of this type be stored: an unsupported type
    is refused whatever it carries, and a type ignored whatever it carries is never
    stored; any other answer depends on the data, so some event of the type is stored."""
    event = CloudEvent(
        attributes={"type": event_type, "source": "/test", "id": "1", "specversion": "1.0"},
        data={},
    )
    try:
        result = adapt_cloudevent(event)
    except InvalidEvent as exc:
        return UNSUPPORTED not in exc.reason
    return not isinstance(result, Ignored)


def test_every_type_the_adapters_accept_has_a_route() -> None:
    stored = {t for t in candidate_types() if adapters_store(t)}
    # The probe finds what it must: lapse's run events, both ApiServerSource modes, Tekton.
    assert {
        EventType.RUN_FINISHED,
        "dev.knative.apiserver.resource.update",
        "dev.knative.apiserver.ref.update",
        "dev.tekton.event.pipelinerun.successful.v1",
    } <= stored
    routed = pushed_types(load_routes())
    assert stored - routed == set(), "the ingress would store these and nothing consumes them"


def test_reference_mode_goes_to_the_planner() -> None:
    by_type = {r.filters["type"]: r.function for r in load_routes() if r.takes_pushed}
    for action in ("add", "update", "delete"):
        assert by_type[f"dev.knative.apiserver.ref.{action}"] == "ttl-planner"


def test_routes_that_do_not_read_lapse_events_are_not_pushed_types() -> None:
    routed = pushed_types(load_routes())
    assert EventType.CLEANUP_DUE not in routed  # read from lapse.due.*, never from the ingress


@pytest.mark.parametrize(
    ("listen", "loopback"),
    [
        ("127.0.0.1:8080", True),
        ("127.0.0.2:8080", True),
        ("localhost:8080", True),
        ("[::1]:8080", True),
        ("0.0.0.0:8080", False),
        ("[::]:8080", False),
        ("10.0.0.5:8080", False),
        ("lapse.example.com:8080", False),
        ("unix:/tmp/lapse.sock", False),
        ("8080", False),
    ],
)
def test_what_counts_as_loopback(listen: str, loopback: bool) -> None:
    assert is_loopback(listen) is loopback


def test_beyond_loopback_a_token_is_required(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^ingress\.token_file: required to listen on 0\.0"):
        listen_token("0.0.0.0:8080", IngressConfig())
    assert listen_token("127.0.0.1:8080", IngressConfig()) is None  # the local demo
    assert listen_token(None, IngressConfig()) is None  # no ingress at all

    token = tmp_path / "token"
    token.write_text("s3cret-token-value\n")  # as `kubectl create secret` and echo write it
    configured = IngressConfig(token_file=token)
    assert listen_token("0.0.0.0:8080", configured) == "s3cret-token-value"
    assert listen_token("127.0.0.1:8080", configured) == "s3cret-token-value"  # applies too


def test_a_bad_token_file_is_named_and_never_shown(tmp_path: Path) -> None:
    missing = IngressConfig(token_file=tmp_path / "absent")
    with pytest.raises(ConfigError, match=r"^ingress\.token_file: cannot read .*absent"):
        listen_token("0.0.0.0:8080", missing)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=r"^ingress\.token_file: .* is empty$"):
        listen_token("0.0.0.0:8080", IngressConfig(token_file=empty))
    two = tmp_path / "two"
    two.write_text("first-secret second-secret\n")
    with pytest.raises(ConfigError) as raised:
        listen_token("0.0.0.0:8080", IngressConfig(token_file=two))
    assert "secret" not in str(raised.value)
