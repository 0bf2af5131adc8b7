"""The re-list lane's routes and the watcher's "not newer than the stored position"."""

from __future__ import annotations

from lapse.events.types import EventType
from lapse.runtime.routing import load_routes, pushed_types, relist_lane
from lapse.runtime.watcher import _not_newer


def test_only_the_run_finished_route_gets_a_relist_lane_of_its_own() -> None:
    routes = load_routes()
    lanes = [lane for route in routes if (lane := relist_lane(route)) is not None]
    assert [(lane.name, lane.subject) for lane in lanes] == [
        ("ttl-planner-run-finished-relist", f"lapse.events.relist.{EventType.RUN_FINISHED}")
    ]
    (lane,) = lanes
    assert lane.function == "ttl-planner" and lane.formerly is None
    assert relist_lane(lane) is None  # no lane of a lane
    # The ingress never stores on the lane: only the watcher publishes there.
    assert pushed_types([*routes, lane]) == pushed_types(routes)


def test_not_newer_compares_versions_as_numbers_and_never_skips_what_it_cannot_compare() -> None:
    assert _not_newer("99", "100") and _not_newer("100", "100")
    assert not _not_newer("101", "100")
    assert not _not_newer("9", None)  # nothing stored: everything is published
    assert not _not_newer("abc", "100") and not _not_newer("100", "abc")
    assert not _not_newer(None, "100")
