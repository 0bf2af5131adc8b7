"""Routes read from the Knative Trigger manifests: infra/knative/triggers.yaml and the
opt-in Components' Triggers (TRIGGER_FILES), so `lapse up` routes what the cluster does."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import yaml

from lapse import infra
from lapse.config import Streams
from lapse.events.subjects import (
    AUDIT_PREFIX,
    DUE_PREFIX,
    event_subject,
    relist_subject,
    subject_filter,
)
from lapse.events.types import EventType

SERVICE_PREFIX = "lapse-"
FORMERLY_ANNOTATION = "lapse.dev/formerly"


@dataclass(frozen=True)
class Route:
    # The Trigger's name (and, for a Trigger of several types, the type's: load_routes);
    # also names the durable consumer.
    name: str
    function: str  # e.g. "ttl-planner" (Knative Service "lapse-ttl-planner")
    filters: dict[str, str]  # CloudEvent attribute -> exact value, as Knative filters
    # The Trigger's former name (annotation lapse.dev/formerly): its durable consumer's
    # position carries over to this route's, so a rename neither repeats nor skips work.
    formerly: str | None = None
    # The watcher's re-list lane of this route (`lapse.events.relist.<type>`): the same
    # function, its own durable consumer, so a re-list never delays live events.
    relist: bool = False

    @property
    def subject(self) -> str:
        if self.relist:
            return relist_subject(self.filters["type"])
        return subject_filter(self.filters["type"], self.filters.get("target"))

    def stream(self, streams: Streams) -> str:
        if self.subject.startswith(DUE_PREFIX):
            return streams.schedule
        if self.subject.startswith(f"{AUDIT_PREFIX}."):
            return streams.audit
        return streams.events

    def matches(self, attributes: Mapping[str, object]) -> bool:
        return all(str(attributes.get(k)) == v for k, v in self.filters.items())

    @property
    def takes_pushed(self) -> bool:
        """Whether this route consumes what the HTTP ingress stores: every event of its
        type on `lapse.events.<type>` (no other filter that could leave some unread)."""
        event_type = self.filters["type"]
        return self.subject == event_subject(event_type) and self.filters.keys() == {"type"}


def relist_lane(route: Route) -> Route | None:
    """The re-list lane of a route that takes the watcher's `run.finished` events (what a
    re-list publishes), or None."""
    if route.relist or not route.takes_pushed:
        return None
    if route.filters["type"] != EventType.RUN_FINISHED:
        return None
    # Not carried over on a rename: a new durable reads the lane from its start, which only
    # repeats runs the planner finds unchanged.
    return dataclasses.replace(route, name=f"{route.name}-relist", formerly=None, relist=True)


def pushed_types(routes: Iterable[Route]) -> frozenset[str]:
    """The event types the ingress may store: those a route consumes from
    `lapse.events.<type>`. Anything else stored there would be read by no one, so the
    ingress refuses it (docs/architecture.md, "The HTTP ingress")."""
    return frozenset(route.filters["type"] for route in routes if route.takes_pushed)


# Every Trigger lapse ships, each in one file: the Knative path's, and those of the opt-in
# Components (a Trigger there reaches a function a default deployment does not run; `lapse
# up` routes to it all the same and builds the handler only when configured).
TRIGGER_FILES = ("knative/triggers.yaml", "components/artifacts/trigger.yaml")


def load_routes(text: str | None = None) -> list[Route]:
    documents = yaml.safe_load_all(
        text
        if text is not None
        else "\n---\n".join(infra.read_text(path) for path in TRIGGER_FILES)
    )
    routes = []
    for doc in documents:
        if not doc or doc.get("kind") != "Trigger":
            continue
        name = doc["metadata"]["name"]
        spec = doc["spec"]
        service = spec["subscriber"]["ref"]["name"]
        annotations = doc["metadata"].get("annotations") or {}
        formerly = annotations.get(FORMERLY_ANNOTATION)
        matches = _exact_matches(name, spec)
        for filters in matches:
            if "type" not in filters:
                raise ValueError(f"Trigger {name} must filter on type")
            # One route per type a Trigger takes, each with a durable consumer of its own: a
            # single-type Trigger's route is named after it, the routes of one with
            # `filters: any` after it and their type (the names one-type Triggers have).
            suffix = "" if len(matches) == 1 else f"-{type_words(filters['type'])}"
            routes.append(
                Route(
                    name=name + suffix,
                    function=service.removeprefix(SERVICE_PREFIX),
                    filters=filters,
                    formerly=formerly + suffix if formerly else None,
                )
            )
    named = Counter(route.name for route in routes)
    if twice := sorted(n for n, count in named.items() if count > 1):
        raise ValueError(f"two routes would share the durable consumer of {', '.join(twice)}")
    return routes


def _exact_matches(name: str, spec: Mapping[str, object]) -> list[dict[str, str]]:
    """The attribute sets a Trigger passes, each matched exactly: its `filter.attributes`,
    or its `filters` as one `exact` or one `any` of `exact`s. NATS subjects can mirror
    those; a Trigger with any other filter would route differently here than on the
    cluster, so it is refused."""
    legacy, filters = spec.get("filter"), spec.get("filters")
    if legacy and filters:
        raise ValueError(f"Trigger {name}: use filter or filters, not both")
    if not filters:
        attributes = legacy.get("attributes", {}) if isinstance(legacy, Mapping) else {}
        return [{str(k): str(v) for k, v in attributes.items()}]
    if not isinstance(filters, list) or len(filters) != 1 or not isinstance(filters[0], Mapping):
        raise ValueError(f"Trigger {name}: filters must be one exact or one any of exacts")
    (dialect,) = filters
    exacts = dialect["any"] if dialect.keys() == {"any"} else [dialect]
    if not isinstance(exacts, list) or not exacts:
        raise ValueError(f"Trigger {name}: filters must be one exact or one any of exacts")
    matches = []
    for dialect in exacts:
        if not (isinstance(dialect, Mapping) and dialect.keys() == {"exact"}):
            raise ValueError(
                f"Trigger {name}: only exact filters can be routed on NATS, not {dialect}"
            )
        matches.append({str(k): str(v) for k, v in dialect["exact"].items()})
    return matches


# Words that tell none of lapse's event types from another: reverse-DNS prefixes, Tekton's
# `event`, ApiServerSource's `resource`, the version.
_COMMON_WORDS = frozenset({"dev", "lapse", "knative", "event", "resource"})


def type_words(event_type: str) -> str:
    """An event type in the words that tell it apart, for a route's name:
    `dev.lapse.run.finished.v1` -> `run-finished`, `dev.knative.apiserver.ref.add` ->
    `apiserver-ref-add`. These are the names the routes had when each type had a Trigger
    of its own, so their durable consumers (and positions) stay the same."""
    words = event_type.split(".")
    return "-".join(
        w for w in words if w not in _COMMON_WORDS and not (w[:1] == "v" and w[1:].isdigit())
    )
