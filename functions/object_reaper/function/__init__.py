"""Knative entry point for object-reaper (func-python): `new()` returns the function."""

from lapse.runtime.knative import FunctionShell


def new() -> FunctionShell:
    return FunctionShell("object-reaper")
