"""Where the safety net lists: the namespaces `safety.namespaces` admits, each on its own.

On the Knative shape lapse may read runs only in the namespaces it cleans (a Role per
namespace, infra/access/knative), so a pass lists each of them with a namespaced request
rather than the whole kind: `include` names them (a glob is matched against the
Namespace list, which the policy watcher may read), and `exclude` takes some out. Only an
`include` of `*` is listed cluster-wide, filtered here: the one list a cluster-wide grant
answers, and one request a page instead of one per namespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Final

from lapse.edges.kubernetes.namespaces import is_glob
from lapse.functions.safety import NamespaceFilter, out_of_scope

EVERY: Final = "*"


def needs_namespace_list(within: NamespaceFilter) -> bool:
    """Whether `cleaned_namespaces` needs the cluster's Namespace names."""
    return EVERY not in within.include and any(is_glob(p) for p in within.include)


def cleaned_namespaces(
    within: NamespaceFilter, names: Sequence[str] | None = None
) -> tuple[str | None, ...]:
    """The scopes one pass lists, in order: `(None,)` for every namespace at once (an
    include of `*`; the caller still filters each run through `within`), otherwise each
    admitted namespace by name. `names` are the cluster's namespaces, needed only when an
    include is a glob (`needs_namespace_list`)."""
    if EVERY in within.include:
        return (None,)
    found: set[str] = set()
    for pattern in within.include:
        if is_glob(pattern):
            found.update(n for n in names or () if fnmatchcase(n, pattern))
        else:
            found.add(pattern)
    return tuple(sorted(n for n in found if out_of_scope(n, within) is None))
