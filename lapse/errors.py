"""The runtime layer's exceptions share one base, `LapseError`.

`lapse.events.errors.ContractError` (input that breaks the contract) and
`lapse.functions.errors.FunctionError` (a decision that cannot be made) are the other layers'
bases. The CLI maps `LapseError`s that are the user's to fix (configuration, usage, a
missing setting) to exit code 2; see lapse.cli.main.
"""

from __future__ import annotations


class LapseError(Exception):
    """Raised by lapse's runtime, edges, operations and command line."""
