"""Which handler each function name runs, and how it is built from the resources.

The single registry both runtimes use: `lapse serve NAME` / a Knative function folder, and
the local dispatcher of `lapse up`. Each function's factory is a module of its own
(lapse/runtime/factories/), imported only when that function is built: a function's
process loads its own edges and no other's, so its image carries only what it imports
(pyproject.toml's `[tool.lapse.functions]`, tests/unit/test_function_imports.py). A
factory returns None when the configuration gives the function nothing to do (no database
target enabled for the row-reaper). Whatever it returns runs inside its function span,
with its metrics (`InstrumentedHandler`).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from lapse.functions.ports import Handler
from lapse.telemetry.handling import instrumented

if TYPE_CHECKING:
    from lapse.runtime.resources import Resources

Factory = Callable[["Resources"], Awaitable[Handler | None]]

log = logging.getLogger(__name__)


# Each function's factory module (its `build`), under lapse/runtime/factories/.
FUNCTIONS: dict[str, str] = {
    "ttl-planner": "lapse.runtime.factories.ttl_planner",
    "object-reaper": "lapse.runtime.factories.object_reaper",
    "row-reaper": "lapse.runtime.factories.row_reaper",
    "artifact-reaper": "lapse.runtime.factories.artifact_reaper",
}
# The functions that decide with the policies, and so follow the policy objects on Knative
# (lapse/runtime/policy_watcher.py).
FOLLOWERS = frozenset({"ttl-planner", "object-reaper"})
# Former names, still accepted (`lapse serve workflow-reaper`) with a deprecation warning.
RENAMED: dict[str, str] = {"workflow-reaper": "object-reaper"}


def current_name(name: str) -> str:
    """The function's name now; a former name is accepted with a deprecation warning."""
    if name in RENAMED:
        log.warning(
            "the function %r is now called %r (it deletes every configured kind); "
            "the old name will be removed in a future release",
            name,
            RENAMED[name],
        )
        return RENAMED[name]
    return name


def factory_of(name: str) -> Factory:
    """The `build` of a function's factory module, imported now (and only now)."""
    try:
        module = FUNCTIONS[name]
    except KeyError:
        known = ", ".join(sorted(FUNCTIONS))
        raise ValueError(f"unknown function {name!r} (known: {known})") from None
    build: Factory = importlib.import_module(module).build
    return build


async def build_handler(name: str, resources: Resources) -> Handler | None:
    name = current_name(name)
    factory = factory_of(name)
    handler = await factory(resources)
    # A handler that takes batches (the row-reaper) keeps taking them (the dispatcher's fetch).
    return instrumented(name, handler) if handler is not None else None
