"""Knative entry point for artifact-reaper (func-python): `new()` returns the function."""

from lapse.runtime.knative import FunctionShell


def new() -> FunctionShell:
    return FunctionShell("artifact-reaper")
