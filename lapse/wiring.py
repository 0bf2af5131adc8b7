"""Which handler each function name runs, and how it is built from the resources.

The single registry both runtimes use: `lapse serve NAME` / a Knative function folder, and
the local dispatcher of `lapse up`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from functions.ports import Handler
from functions.ttl_planner import Planner
from lapse.resources import Resources

Factory = Callable[[Resources], Awaitable[Handler]]


async def _ttl_planner(resources: Resources) -> Handler:
    return Planner(
        schedules=await resources.schedules(),
        emitter=await resources.emitter(),
        policies=tuple(resources.config.policies),
    )


FUNCTIONS: dict[str, Factory] = {
    "ttl-planner": _ttl_planner,
}


async def build_handler(name: str, resources: Resources) -> Handler:
    try:
        factory = FUNCTIONS[name]
    except KeyError:
        known = ", ".join(sorted(FUNCTIONS))
        raise ValueError(f"unknown function {name!r} (known: {known})") from None
    return await factory(resources)
