"""Knative entry point for ttl-planner (func-python): `new()` returns the function."""

from lapse.runtime.knative import FunctionShell


def new() -> FunctionShell:
    return FunctionShell("ttl-planner")
