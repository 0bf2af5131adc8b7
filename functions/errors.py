"""The functions layer's exceptions share one base, `FunctionError`.

Each layer has its own base (`lapse.events.errors.ContractError`,
`lapse.functions.errors.FunctionError`, `lapse.errors.LapseError`), so a caller can tell a bad
input from a decision it could not make from a failure of the runtime around it.
"""

from __future__ import annotations


class FunctionError(Exception):
    """Raised by the handlers and their pure decision logic."""
