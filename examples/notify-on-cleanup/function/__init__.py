"""Knative entry point (func-python): `new()` returns the function."""

from .func import new

__all__ = ["new"]
