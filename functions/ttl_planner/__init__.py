"""ttl-planner: turns a finished run into one pending deadline per target."""

from lapse.functions.ttl_planner.handler import SOURCE, Planner

__all__ = ["SOURCE", "Planner"]
