"""Routes from Trigger manifests: one Trigger per function on the cluster (the Broker hands
every event to every Trigger's filter), one route and durable consumer per type for `lapse
up`, named as they were when each type had a Trigger of its own. No servers."""

from __future__ import annotations

from collections import Counter

import pytest
import yaml

from lapse import infra
from lapse.runtime.routing import load_routes, type_words

# The durable consumers `lapse up` creates are `lapse-<route name>`: their positions are
# where each route's work stands, so renaming one would repeat or skip events.
SHIPPED_ROUTES = [
    "ttl-planner-run-finished",
    "ttl-planner-run-deleted",
    "ttl-planner-tekton-pipelinerun-successful",
    "ttl-planner-tekton-pipelinerun-failed",
    "ttl-planner-tekton-taskrun-successful",
    "ttl-planner-tekton-taskrun-failed",
    "ttl-planner-apiserver-add",
    "ttl-planner-apiserver-update",
    "ttl-planner-apiserver-delete",
    "ttl-planner-apiserver-ref-add",
    "ttl-planner-apiserver-ref-update",
    "ttl-planner-apiserver-ref-delete",
    "object-reaper-due",
    "row-reaper-due",
    "artifact-reaper-due",
]


def test_the_shipped_routes_keep_the_names_of_their_durable_consumers() -> None:
    assert [route.name for route in load_routes()] == SHIPPED_ROUTES


def test_each_function_has_one_trigger_on_the_cluster() -> None:
    triggers = [d for d in yaml.safe_load_all(infra.read_text("knative/triggers.yaml")) if d]
    subscribers = Counter(t["spec"]["subscriber"]["ref"]["name"] for t in triggers)
    assert subscribers == {"lapse-ttl-planner": 1, "lapse-object-reaper": 1, "lapse-row-reaper": 1}


def _trigger(spec_filters: str, annotations: str = "{}") -> str:
    return f"""
apiVersion: eventing.knative.dev/v1
kind: Trigger
metadata: {{name: planner, annotations: {annotations}}}
spec:
  broker: lapse
  {spec_filters}
  subscriber: {{ref: {{kind: Service, name: lapse-ttl-planner}}}}
"""


def test_a_trigger_of_several_types_is_a_route_per_type() -> None:
    text = _trigger(
        "filters: [{any: [{exact: {type: dev.lapse.run.finished.v1}}, "
        "{exact: {type: dev.knative.apiserver.ref.add, source: s}}]}]",
        "{lapse.dev/formerly: old}",
    )
    routes = load_routes(text)
    assert [(r.name, r.function, r.filters, r.formerly) for r in routes] == [
        ("planner-run-finished", "ttl-planner", {"type": "dev.lapse.run.finished.v1"},
         "old-run-finished"),
        ("planner-apiserver-ref-add", "ttl-planner",
         {"type": "dev.knative.apiserver.ref.add", "source": "s"}, "old-apiserver-ref-add"),
    ]  # fmt: skip
    assert routes[1].matches({"type": "dev.knative.apiserver.ref.add", "source": "s"})
    assert not routes[1].matches({"type": "dev.knative.apiserver.ref.add", "source": "t"})


def test_one_exact_filter_is_a_route_named_after_its_trigger() -> None:
    (route,) = load_routes(_trigger("filters: [{exact: {type: dev.lapse.run.deleted.v1}}]"))
    assert route.name == "planner" and route.filters == {"type": "dev.lapse.run.deleted.v1"}


@pytest.mark.parametrize(
    "spec_filters",
    [
        # Knative would route these; NATS subjects cannot say them.
        "filters: [{prefix: {type: dev.lapse.}}]",
        "filters: [{any: [{exact: {type: a}}, {suffix: {type: .v1}}]}]",
        "filters: [{cesql: \"type = 'a'\"}]",
        "filters: [{all: [{exact: {type: a}}]}]",
        "filters: [{exact: {type: a}}, {exact: {type: b}}]",  # all of them, not any
        "filters: {exact: {type: a}}",
        "filters: [{any: []}]",
        "filter: {attributes: {type: a}}\n  filters: [{exact: {type: a}}]",
        "filters: [{exact: {source: s}}]",  # no type: no subject to route on
    ],
)
def test_a_filter_lapse_cannot_route_the_same_way_is_refused(spec_filters: str) -> None:
    with pytest.raises(ValueError, match="Trigger planner"):
        load_routes(_trigger(spec_filters))


def test_two_routes_never_share_a_durable_consumer() -> None:
    same_type = "filters: [{any: [{exact: {type: t.a, source: x}}, {exact: {type: t.a}}]}]"
    with pytest.raises(ValueError, match="share the durable consumer of planner-t-a"):
        load_routes(_trigger(same_type))


@pytest.mark.parametrize(
    ("event_type", "words"),
    [
        ("dev.lapse.run.finished.v1", "run-finished"),
        ("dev.tekton.event.pipelinerun.successful.v1", "tekton-pipelinerun-successful"),
        ("dev.knative.apiserver.resource.update", "apiserver-update"),
        ("dev.knative.apiserver.ref.delete", "apiserver-ref-delete"),
        ("com.example.build.v12", "com-example-build"),
    ],
)
def test_type_words_are_what_tells_a_type_apart(event_type: str, words: str) -> None:
    assert type_words(event_type) == words
