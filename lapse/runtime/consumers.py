"""Which identity owns which of lapse's durable consumers, and how a durable is named.

Only the owner may create, update, fetch from or delete a durable (its name is in its
NATS permissions: lapse/embedded/nats_identities.py), and only a message a route's own
durable delivered may be believed (lapse/runtime/trust.py): both come from here.
"""

from __future__ import annotations

from collections.abc import Iterable

from lapse.embedded.nats_identities import BRIDGE, PROCESS, Durables
from lapse.runtime.routing import Route, load_routes, relist_lane

DURABLE_PREFIX = "lapse-"


def durable_name(route: Route) -> str:
    """The durable consumer a route reads through."""
    return f"{DURABLE_PREFIX}{route.name}"


def _names(routes: Iterable[Route]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(durable_name(route) for route in routes))


def owned_durables(routes: list[Route] | None = None) -> Durables:
    """Each identity's durables: `lapse up` (PROCESS) every route's and re-list lane's, and
    the bridge's (`lapse bridge` runs as PROCESS too); on Kubernetes the bridge its own."""
    # Imported here: the bridge module imports the dispatcher, which imports this one.
    from lapse.runtime.bridge import OUTCOMES, ROUTE

    every = routes if routes is not None else load_routes()
    lanes = [lane for route in every if (lane := relist_lane(route))]
    bridge = _names([ROUTE, OUTCOMES])
    return {PROCESS.user: _names([*every, *lanes]) + bridge, BRIDGE.user: bridge}


def retired_durables(routes: list[Route] | None = None) -> Durables:
    """The durables of routes renamed since (a Trigger's `lapse.dev/formerly`): `lapse up`
    only deletes one, once its successor took over its position."""
    every = routes if routes is not None else load_routes()
    formerly = [f"{DURABLE_PREFIX}{r.formerly}" for r in every if r.formerly is not None]
    return {PROCESS.user: tuple(dict.fromkeys(formerly))}
