"""The closed sets the command line writes out (lapse/cli/names.py, so that --help imports
no models) are the sets they mirror; and reconcile's flag defaults are the operation's."""

from __future__ import annotations

from lapse.cli import names, reconcile
from lapse.edges.limits import SCOPES
from lapse.events.kinds import BUILTIN_KINDS
from lapse.events.run import Target
from lapse.events.types import Outcome
from lapse.operations import reconcile as operation
from lapse.runtime.registry import FUNCTIONS


def test_each_closed_set_is_the_one_it_mirrors() -> None:
    assert tuple(t.value for t in Target) == names.TARGETS
    assert (*(o.value for o in Outcome), "failed") == names.OUTCOMES
    assert tuple(sorted(FUNCTIONS)) == names.FUNCTIONS
    assert tuple(sorted(SCOPES)) == names.BRAKE_TARGETS
    specs = BUILTIN_KINDS.values()
    assert (
        *(spec.name for spec in specs),
        *dict.fromkeys(spec.kind for spec in specs),
    ) == names.KNOWN_KINDS


def test_reconcile_flags_default_to_the_operations_defaults() -> None:
    assert reconcile.DEFAULT_PAGE_SIZE == operation.DEFAULT_PAGE_SIZE
    assert reconcile.DEFAULT_ROW_PAGE_SIZE == operation.DEFAULT_ROW_PAGE_SIZE
    assert reconcile.DEFAULT_CONCURRENCY == operation.DEFAULT_CONCURRENCY
