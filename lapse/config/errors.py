"""The configuration's error."""

from __future__ import annotations

from collections.abc import Sequence

from lapse.errors import LapseError


class ConfigError(LapseError):
    """A configuration that cannot be used. `str()` is one line; `problems` has them all."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        more = len(self.problems) - 1
        suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
        super().__init__(self.problems[0] + suffix)
