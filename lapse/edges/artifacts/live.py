"""What the runs that exist now record (`lapse.functions.artifact_reaper.ports.LiveRuns`):
every Workflow of the configured Argo kinds, listed cluster-wide in pages just before the
artifact-reaper deletes, and every key each names (outputs and inputs, Running or not).

Why at the deadline, not captured while runs run: a Running run has no capture (the
planner sees finished runs only), and capturing every update of every Running Workflow
would cost a write per update of every run for the rare pass that needs it, and still
leave a run deleted while Running with a capture nobody forgets. A paged list when
something is about to be deleted reads what is true at that moment (a consistent read,
in pages of 500). Its cost is one list of the Workflows a pass that deletes something
(docs/architecture.md, "The artifact-reaper").

The API server not answering is `Unavailable` (waited out); refusing (403) is `Refused`
(functions/reaping/failures.py): nothing is deleted without this read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final

from lapse.edges.kubernetes.client import api_failure
from lapse.edges.kubernetes.objects import KubeObjects
from lapse.events.adapters.argo_artifacts import argo_references
from lapse.events.kinds import KindSpec
from lapse.events.run import Engine
from lapse.functions.artifact_reaper.ownership import LiveArtifact
from lapse.functions.reaping.failures import Refused, Unavailable

PAGE: Final = 500
RETRY_DELAY: Final = 1.0


def recording_kinds(kinds: Iterable[KindSpec]) -> tuple[KindSpec, ...]:
    """The kinds whose objects record artifact keys (Argo Workflows, KFP's among them)."""
    return tuple(kind for kind in kinds if kind.engine is Engine.ARGO)


class KubeLiveRuns:
    def __init__(self, objects: Callable[[], KubeObjects], kinds: Iterable[KindSpec]) -> None:
        self._objects = objects
        self._kinds = recording_kinds(kinds)

    async def recorded(self) -> list[LiveArtifact]:
        found: list[LiveArtifact] = []
        for kind in self._kinds:
            for obj in await self._list(kind):
                meta = obj.get("metadata") or {}
                run = f"{meta.get('namespace')}/{meta.get('name')}"
                uid = str(meta.get("uid") or "")
                found += [LiveArtifact(run, uid, a) for a in argo_references(obj)]
        return found

    async def _list(self, kind: KindSpec) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        token: str | None = None
        objects = self._objects()
        while True:
            try:
                page = await objects.list_page(kind, None, limit=PAGE, continue_token=token)
            except Exception as exc:
                failure = api_failure(exc)
                if failure is None:
                    raise
                if failure.status in (401, 403):
                    raise Refused(
                        f"cannot list {kind.kind} in all namespaces (HTTP {failure.status}) "
                        "to keep what live runs record: the artifact-reaper needs list on "
                        f"{kind.resource}.{kind.group}; nothing was deleted"
                    ) from exc
                raise Unavailable(
                    f"cannot list {kind.kind} to keep what live runs record: {failure.message}",
                    failure.retry_after or RETRY_DELAY,
                ) from exc
            items.extend(page.get("items", []))
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items
