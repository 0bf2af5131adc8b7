"""Knative entry point for row-reaper (func-python): `new()` returns the function."""

from lapse.runtime.knative import FunctionShell


def new() -> FunctionShell:
    return FunctionShell("row-reaper")
