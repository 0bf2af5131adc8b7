"""Knative entry point for workflow-reaper (func-python): `new()` returns the function."""

from lapse.runtime.knative import FunctionShell


def new() -> FunctionShell:
    return FunctionShell("workflow-reaper")
