"""The policy watcher: list + watch `LapsePolicy` and `ClusterLapsePolicy` objects, keep the
process's policy book (functions/policy_objects.py) current, write each object's status,
and re-plan the runs a change may move (docs/policies.md).

- **Current.** Both kinds are listed once and then watched; every change that moves a
  generation (or deletes an object) recomputes the policy list from the objects held here
  (a handful: policies, not runs) and replaces the book whole. The planner and the reaper
  of `lapse up` read the same book, so a deadline set now is the one the reaper finds at
  the deadline.
- **Status.** Each object's `Accepted` condition (accepted, clamped, refused, and why) is
  written to its status subresource when it says something new; a status-only update
  (lapse's own write) is not a change.
- **Re-planned, not re-listed.** A changed policy's runs are listed again only where the
  old or new policy can reach: a LapsePolicy's own namespace; a ClusterLapsePolicy's
  namespaces (its globs against the Namespace list; every namespace when it has none);
  narrowed to the kinds of its engines and, server-side, to its labels when old and new
  agree on them. Each finished run found is published on the re-list lane with an id of
  the policy version (`<uid>.<resourceVersion>.<type>.policy.<policy uid>.<policy rv>`:
  two replicas re-planning the same change publish it once), and the planner moves its
  deadline either way; a deadline already past fires at once. A run whose deadline did not
  move costs a lookup.
- **Restarts.** An object whose generation lapse has not stated in its status (changed
  while no lapse ran) is re-planned when the list is read. A policy deleted while no
  lapse ran is not seen: `lapse reconcile` re-derives those deadlines (and the reaper
  re-decides each at its deadline from the policies in effect then, so it never deletes
  on a policy that no longer exists).
- A CRD not installed (404) or not readable (403) leaves lapse.yaml's policies alone in
  effect, said in the log, and is looked for again every minute.

On the Knative path (docs/architecture.md, "Policy objects on Knative") the same class runs
twice over: once as the Deployment `lapse-policy-watcher` (`python -m
lapse.runtime.policy_watcher`, `serve` below), which writes the statuses and re-plans
through a ttl-planner of its own; and as a read-only follower (`follow`, `writes=False`) in
each function that decides with the policies (ttl-planner, object-reaper), which keeps that
function's book current from its own watch and writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from cloudevents.core.base import BaseCloudEvent
from kubernetes.client.exceptions import ApiException

from lapse import telemetry
from lapse.config import LapseConfig, load_config
from lapse.config.redact import RedactingFilter
from lapse.edges.kubernetes import KubeObjects, finished_pages
from lapse.edges.kubernetes.client import describe_api_error
from lapse.edges.kubernetes.policies import (
    CLUSTER_LAPSE_POLICIES,
    LAPSE_POLICIES,
    namespace_names,
    says,
    status_of,
)
from lapse.events.adapters.objects import adapt
from lapse.events.builder import build_event
from lapse.events.errors import InvalidEvent
from lapse.events.kinds import KindSet, KindSpec
from lapse.events.models import RunFinished
from lapse.events.types import EventType
from lapse.functions.policy import Policy
from lapse.functions.policy_objects import LAPSE_POLICY, PolicyBook, Verdict, effective
from lapse.functions.ports import Handler
from lapse.runtime import shutdown
from lapse.runtime.outages import Backoff
from lapse.runtime.registry import build_handler
from lapse.runtime.resources import Resources
from lapse.runtime.supervisor import Retrying
from lapse.runtime.trust import trust_of_own_read

log = logging.getLogger(__name__)

SOURCE = "/lapse/policy-watcher"
PAGE_SIZE = 500
NOT_SERVED_RETRY = 60.0
REPLAN_TRIES = 8

Publish = Callable[[BaseCloudEvent], Awaitable[None]]
Namespaces = Callable[[], Awaitable[list[str]]]
Key = tuple[str, str | None, str]


@dataclass(frozen=True)
class Scope:
    """Where a policy change can move deadlines."""

    namespaces: tuple[str, ...] | None  # exact names; None: every namespace
    engines: frozenset[str] | None  # None: every kind
    selector: str | None  # a label selector both versions require, server-side


def _key(obj: dict[str, Any]) -> Key:
    metadata = obj.get("metadata") or {}
    return str(obj.get("kind", "")), metadata.get("namespace") or None, str(metadata["name"])


def _generation(obj: dict[str, Any] | None) -> Any:
    return None if obj is None else (obj.get("metadata") or {}).get("generation")


def _selector(matches: list[dict[str, Any]]) -> str | None:
    """The label selector every version's match requires, when they all agree."""
    shapes = {
        (tuple(sorted((m.get("labels") or {}).items())), tuple(sorted(m.get("hasLabels") or ())))
        for m in matches
    }
    if len(shapes) != 1:
        return None
    equal, present = shapes.pop()
    parts = [f"{k}={v}" for k, v in equal] + list(present)
    return ",".join(parts) or None


def _engines(matches: list[dict[str, Any]]) -> frozenset[str] | None:
    if any(not m.get("engines") for m in matches):
        return None
    return frozenset(e for m in matches for e in m["engines"])


async def scope_of(
    old: dict[str, Any] | None, new: dict[str, Any] | None, namespaces: Namespaces
) -> Scope:
    """Every run the old or the new version of one policy object can reach."""
    versions = [o for o in (old, new) if o is not None]
    matches = [dict((o.get("spec") or {}).get("match") or {}) for o in versions]
    kind, namespace, _ = _key(versions[0])
    if kind == LAPSE_POLICY:
        assert namespace is not None
        return Scope((namespace,), _engines(matches), _selector(matches))
    # A ClusterLapsePolicy's bounds reach every LapsePolicy of its namespaces, whatever
    # their match: narrowed by its own match only when neither version sets bounds.
    bounds = any((o.get("spec") or {}).get("namespacedPolicies") for o in versions)
    engines = None if bounds else _engines(matches)
    selector = None if bounds else _selector(matches)
    globs = [tuple(m.get("namespaces") or ()) for m in matches]
    if any(not g for g in globs):
        return Scope(None, engines, selector)
    names = [n for n in await namespaces() if any(fnmatchcase(n, p) for g in globs for p in g)]
    return Scope(tuple(names), engines, selector)


class PolicyWatcher:
    def __init__(
        self,
        objects: KubeObjects,
        book: PolicyBook,
        kinds: KindSet,
        publish: Publish,
        namespaces: Namespaces,
        *,
        configured: Iterable[Policy] = (),
        watch_timeout: int = 300,
        not_served_retry: float = NOT_SERVED_RETRY,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        writes: bool = True,
    ) -> None:
        self._objects = objects
        self._book = book
        self._kinds = kinds
        self._publish = publish
        self._namespaces = namespaces
        self._configured = tuple(configured)
        self._watch_timeout = watch_timeout
        self._not_served_retry = not_served_retry
        self._clock = clock
        # False: a follower (a Knative function's copy of the book): it reads and decides
        # the same, and leaves the statuses and the re-plans to the one watcher that writes.
        self._writes = writes
        self._held: dict[Key, dict[str, Any]] = {}
        self._listed: set[str] = set()
        self._lock = asyncio.Lock()
        self.synced = asyncio.Event()  # both kinds listed (or found not served)
        self.replanned = 0  # runs published again because a policy changed

    async def run(self, stop: asyncio.Event) -> None:
        tasks = [
            asyncio.create_task(self._watch(spec), name=f"policy watch {spec.name}")
            for spec in (CLUSTER_LAPSE_POLICIES, LAPSE_POLICIES)
        ]
        stopped = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopped}:
                task.result()  # a fatal failure ends the watcher (its supervisor says so)
        finally:
            for task in [*tasks, stopped]:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _watch(self, spec: KindSpec) -> None:
        # Every failure but a fatal one (401/403 on the watch, a bad kubeconfig) is waited
        # out here, shown in `lapse status` while it lasts (lapse.runtime.supervisor).
        api = Retrying(f"watching {spec.describe()}")
        resource_version = await self._list(spec, api)
        while True:
            try:
                async for change in self._objects.watch(
                    spec, resource_version=resource_version, timeout_seconds=self._watch_timeout
                ):
                    api.succeeded()
                    resource_version = change.object["metadata"]["resourceVersion"]
                    if change.type == "BOOKMARK":
                        continue
                    deleted = change.type == "DELETED"
                    await self._changed([(change.object, deleted)])
                api.succeeded()
            except ApiException as exc:
                if exc.status == 410:
                    resource_version = await self._list(spec, api)
                    continue
                await api.wait_out(exc)
            except Exception as exc:
                await api.wait_out(exc)

    async def _list(self, spec: KindSpec, api: Retrying) -> str:
        """Read every object of `spec` (at the start and after 410 Gone); what differs from
        what is held, or was never stated in its status, is a change. The API server away
        (refused, reset, timed out, 5xx, 429) is waited out, never the end of the watcher."""
        while True:
            try:
                items: list[dict[str, Any]] = []
                version = ""
                async for page in finished_pages(self._objects, spec, page_size=PAGE_SIZE):
                    items += page.items
                    version = page.resource_version
                api.succeeded()
                break
            except ApiException as exc:
                if exc.status not in (403, 404):
                    await api.wait_out(exc)
                    continue
                api.succeeded()  # answered: not served, or not ours to read
                why = "not installed" if exc.status == 404 else "not readable (RBAC)"
                log.warning(
                    "%s is %s: only lapse.yaml's policies apply; looking again every %.0fs",
                    spec.describe(), why, self._not_served_retry,
                )  # fmt: skip
                self._mark_listed(spec)
                await self._changed([])  # nothing of it: the other kind may decide alone
                await asyncio.sleep(self._not_served_retry)
            except Exception as exc:
                await api.wait_out(exc)
        kind = spec.kind
        for obj in items:
            obj.setdefault("kind", kind)
        changes: list[tuple[dict[str, Any], bool]] = []
        seen = {_key(obj) for obj in items}
        for key, gone in list(self._held.items()):
            if key[0] == kind and key not in seen:
                changes.append((gone, True))
        for obj in items:
            held = self._held.get(_key(obj))
            stated = (obj.get("status") or {}).get("observedGeneration")
            if _generation(held) != _generation(obj) or stated != _generation(obj):
                changes.append((obj, False))
            else:
                self._held[_key(obj)] = obj
        self._mark_listed(spec)
        await self._changed(changes)
        return version

    def _mark_listed(self, spec: KindSpec) -> None:
        self._listed.add(spec.name)

    async def _changed(self, changes: list[tuple[dict[str, Any], bool]]) -> None:
        async with self._lock:
            moved: list[tuple[dict[str, Any] | None, dict[str, Any] | None]] = []
            for obj, deleted in changes:
                key = _key(obj)
                old = self._held.get(key)
                if deleted:
                    self._held.pop(key, None)
                    moved.append((old, None))
                    continue
                self._held[key] = obj
                stated = (obj.get("status") or {}).get("observedGeneration")
                if _generation(old) == _generation(obj) and stated == _generation(obj):
                    continue  # a status-only update: lapse's own write
                moved.append((old, obj))
            if len(self._listed) < 2:
                return  # the other kind is not read yet: the first full view decides
            first = not self.synced.is_set()
            if first:
                # At the start only what no lapse has stated yet moved (changed while none
                # ran): decided before this round writes its statuses.
                moved = [(None, o) for o in self._held.values() if _unstated(o)]
            verdicts = self._recompute()
            if self._writes:
                await self._write_statuses(verdicts)
            if first:
                self.synced.set()
                in_effect = sum(1 for v in verdicts if v.policy is not None)
                log.info("policy objects read: %d of %d in effect", in_effect, len(verdicts))
            if not self._writes:
                return
            for old, new in moved:
                await self._replan_retrying(old, new)

    def _recompute(self) -> list[Verdict]:
        namespaced = [o for k, o in self._held.items() if k[0] == LAPSE_POLICY]
        clusters = [o for k, o in self._held.items() if k[0] != LAPSE_POLICY]
        found = effective(namespaced, clusters, self._configured)
        self._book.replace(found.policies)
        return list(found.verdicts)

    async def _write_statuses(self, verdicts: list[Verdict]) -> None:
        for verdict in verdicts:
            ref = verdict.ref
            held = self._held.get(ref.key)
            current = (held or {}).get("status")
            wanted = status_of(verdict, current, self._clock())
            if says(current, wanted):
                continue
            spec = LAPSE_POLICIES if ref.kind == LAPSE_POLICY else CLUSTER_LAPSE_POLICIES
            try:
                await self._objects.patch_status(spec, ref.namespace, ref.name, wanted)
            except Exception as exc:  # gone meanwhile, or no right to write: the log says
                log.warning("%s: writing its status failed (%s)", ref.label,
                            describe_api_error(exc))  # fmt: skip
                continue
            if held is not None:
                held["status"] = wanted
            if verdict.reason != "Accepted":
                log.warning("%s: %s: %s", ref.label, verdict.reason, verdict.message)

    async def _replan_retrying(
        self, old: dict[str, Any] | None, new: dict[str, Any] | None
    ) -> None:
        """A re-plan that fails (NATS or the API server away) is tried again: what it
        published already is dropped by id. Given up on after REPLAN_TRIES, said loudly:
        the book is current, and `lapse reconcile` re-derives what was not re-planned."""
        backoff = Backoff(first=1.0, cap=30.0)
        for attempt in range(1, REPLAN_TRIES + 1):
            try:
                await self._replan(old, new)
                return
            except Exception as exc:
                if attempt == REPLAN_TRIES:
                    log.error("%s: re-planning its runs failed %d times (%s): run lapse "
                              "reconcile", _label(new or old or {}), attempt,
                              describe_api_error(exc))  # fmt: skip
                    return
                delay = backoff.delay(attempt)
                log.warning("%s: re-planning its runs failed (%s): again in %.0fs",
                            _label(new or old or {}), describe_api_error(exc), delay)  # fmt: skip
                await asyncio.sleep(delay)

    async def _replan(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        version = new or old
        assert version is not None
        metadata = version.get("metadata") or {}
        tag = f"policy.{metadata.get('uid', '')}.{metadata.get('resourceVersion', '')}"
        if new is None:
            tag += ".deleted"
        scope = await scope_of(old, new, self._namespaces)
        kinds = [k for k in self._kinds if scope.engines is None or k.engine.value in scope.engines]
        count = 0
        for kind in kinds:
            for namespace in scope.namespaces if scope.namespaces is not None else (None,):
                count += await self._publish_runs(kind, namespace, scope.selector, tag)
        self.replanned += count
        where = ", ".join(scope.namespaces) if scope.namespaces is not None else "every namespace"
        log.info("%s changed: %d finished runs re-planned (%s)",
                 _label(version), count, where)  # fmt: skip

    async def _publish_runs(
        self, kind: KindSpec, namespace: str | None, selector: str | None, tag: str
    ) -> int:
        count = 0
        try:
            pages = finished_pages(
                self._objects, kind, namespace, page_size=PAGE_SIZE, label_selector=selector
            )
            async for page in pages:
                for obj in page.items:
                    try:
                        result = adapt(obj, kind)
                    except InvalidEvent:
                        continue  # the watcher reports it; nothing to re-plan
                    if not isinstance(result, RunFinished):
                        continue
                    metadata = obj["metadata"]
                    event_id = (
                        f"{metadata['uid']}.{metadata.get('resourceVersion', '')}."
                        f"{EventType.RUN_FINISHED.value}.{tag}"
                    )
                    event = build_event(
                        EventType.RUN_FINISHED, source=SOURCE, data=result, id=event_id
                    )
                    await self._publish(event)
                    count += 1
        except ApiException as exc:
            if exc.status != 404:
                raise
        return count


def _unstated(obj: dict[str, Any]) -> bool:
    return bool((obj.get("status") or {}).get("observedGeneration") != _generation(obj))


def _label(obj: dict[str, Any]) -> str:
    if not obj:
        return "a policy object"
    kind, namespace, name = _key(obj)
    return f"{kind.lower()}:{namespace + '/' if namespace else ''}{name}"


async def _nothing_published(event: BaseCloudEvent) -> None:  # pragma: no cover - never called
    raise AssertionError("a policy follower publishes nothing")


async def _no_namespaces() -> list[str]:  # pragma: no cover - never called
    raise AssertionError("a policy follower re-plans nothing")


async def _until_synced(watcher: PolicyWatcher, task: asyncio.Task[None]) -> None:
    """Wait until `watcher` has read both kinds (or found them not served); a watcher that
    crashed before says why."""
    synced = asyncio.create_task(watcher.synced.wait())
    try:
        await asyncio.wait([task, synced], return_when=asyncio.FIRST_COMPLETED)
    finally:
        synced.cancel()
    if task.done():
        task.result()


async def follow(resources: Resources, stop: asyncio.Event) -> asyncio.Task[None] | None:
    """Keep `resources.policies()` current from the policy objects, read-only, and return
    once they are read: a Knative function decides its first event with them already.
    Needs get/list/watch on both kinds (the ClusterRole `lapse-policy-follower`); without
    it (or without the CRDs) lapse.yaml's policies apply, said in the log. A function
    given no Kubernetes access at all (a planner fed only by `lapse up`'s own events)
    follows nothing, said once: None."""
    try:
        objects = resources.objects()
    except Exception as exc:  # no kubeconfig, not in a pod: the planner's choice to make
        log.warning("no Kubernetes access (%s): only lapse.yaml's policies apply", exc)
        return None
    watcher = PolicyWatcher(
        objects,
        resources.policies(),
        resources.config.kinds,
        _nothing_published,
        _no_namespaces,
        configured=resources.config.policies,
        watch_timeout=resources.config.kubernetes.watch_timeout,
        writes=False,
    )
    task = asyncio.create_task(watcher.run(stop), name="policy follower")
    await _until_synced(watcher, task)
    return task


# Work started beside the watcher once the policy objects are read, with this process's
# resources and ttl-planner (the safety net: lapse/operations/reconcile/periodic.py).
Beside = Callable[[Resources, Handler], Coroutine[Any, Any, None]]


async def serve(
    config: LapseConfig,
    stop: asyncio.Event,
    *,
    ready_file: Path | None = None,
    beside: Beside | None = None,
) -> PolicyWatcher:
    """The Knative path's policy watcher: statuses written, and each change's runs
    re-planned by a ttl-planner in this process, which reads this watcher's own book (so a
    re-plan never sees an older policy than the change it follows). Its NATS identity is
    the planner's (it does the planner's work, no more); runs until `stop`. `beside` runs
    with the same resources and planner from when the objects are read until `stop`."""
    async with Resources(config) as resources:
        planner = await build_handler("ttl-planner", resources)
        assert planner is not None  # the ttl-planner always has work

        async def replan(event: BaseCloudEvent) -> None:
            # Read from the API server by this process: observed, as `lapse up`'s re-plans.
            await planner.handle(event, trust_of_own_read())

        watcher = PolicyWatcher(
            resources.objects(),
            resources.policies(),
            config.kinds,
            replan,
            lambda: namespace_names(resources.kube_client(), resources.kube_executor()),
            configured=config.policies,
            watch_timeout=config.kubernetes.watch_timeout,
        )
        task = asyncio.create_task(watcher.run(stop), name="policy watcher")
        await _until_synced(watcher, task)
        if ready_file is not None:
            await asyncio.to_thread(ready_file.touch)  # the pod's readiness probe
        log.info("policy watcher running")
        if beside is None:
            await task
            return watcher
        work = asyncio.create_task(beside(resources, planner), name="beside the policy watcher")
        try:
            done, _ = await asyncio.wait([task, work], return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                finished.result()  # a fatal failure of either ends the process
            await task  # otherwise only `stop` ends them; what `beside` is doing is cancelled
        finally:
            for running in (task, work):
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running
        return watcher


Serve = Callable[..., Awaitable[object]]


def main(serving: Serve = serve) -> None:
    """`python -m lapse.runtime.policy_watcher`: the policy watcher alone. The Deployment
    lapse-policy-watcher runs it with the safety net beside it (`python -m
    lapse.operations.reconcile.periodic`, which calls this with its own `serving`)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())  # a URL in a log line, never its secret
    config = load_config(os.environ.get("LAPSE_CONFIG"))
    ready = os.environ.get("LAPSE_READY_FILE")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        exporting = telemetry.configure("lapse-policy-watcher")
        try:
            await serving(config, stop, ready_file=Path(ready) if ready else None)
        finally:
            exporting.shutdown()
            shutdown.guard(loop)  # asyncio.run then waits for what is left

    asyncio.run(run())


if __name__ == "__main__":
    main()
