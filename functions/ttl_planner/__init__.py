"""ttl-planner: turns a finished run into one pending deadline per target."""

from functions.ttl_planner.handler import SOURCE, Planner

__all__ = ["SOURCE", "Planner"]
