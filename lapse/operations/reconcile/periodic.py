"""The safety net of the Knative shape: a periodic reconcile beside the policy watcher.

On Knative a finished run is planned when its event crosses the ApiServerSource, the
Broker and its channel; an event lost on that way (the in-memory channel's dispatcher
restarted while it held it) is never planned, and nothing there lists again. `lapse up`
has its re-list lane; this is the Knative shape's. The Deployment `lapse-policy-watcher`
(`python -m lapse.operations.reconcile.periodic`) runs the policy watcher and, once the
policy objects are read, a pass every `reconcile.period` plus up to `reconcile.jitter`:

- **What.** The runs pass of `lapse reconcile` (`Reconciler.reconcile_runs`) in each
  namespace `safety.namespaces` admits (`scope.py`): every finished run, listed in pages
  of `reconcile.page_size` (with the kind's server-side selector of finished objects where
  it has one), handed to the watcher's own ttl-planner, which decides with the same policy
  book as its re-plans. A run with no schedule is planned (its event was lost); a
  schedule whose deadline the policies now put elsewhere is moved or withdrawn (a policy
  in lapse.yaml changed, or one deleted while no watcher ran); one that stands is a
  lookup and no write.
- **Never earlier, never twice.** The planner makes the one decision it makes for the
  Broker's events, so no deadline is earlier than the planner's. It leaves a deadline
  that stands alone, a fired one whose due message is kept included (the store's default,
  as for `lapse up`'s re-lists: not `lapse reconcile`'s `rederive_handled`, which would
  issue a refused or kept deletion again on every pass). Two plannings of the same run at
  once (the Broker's event and a pass) put the same deadline on the same subject, which
  keeps the last.
- **Nothing deleted here.** A pass only schedules; the reapers delete at the deadline,
  each after its own checks. The KFP rows pass is not run: the watcher holds no database
  credential, and rows whose Workflow is gone are the operator's `lapse reconcile`.
- **Seen.** Each pass is a log line, the metrics `lapse.reconcile.runs`,
  `lapse.reconcile.duration` and `lapse.reconcile.last_success`, and `lapse status`'s
  `safety net:` line (the health bucket's `reconcile.<process>` key, written again every
  `HEARTBEAT` seconds so it outlives the bucket's one-minute memory while the process
  lives).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from nats.js.kv import KeyValue

from lapse import telemetry
from lapse.config import LapseConfig, ReconcileConfig
from lapse.edges import health
from lapse.edges.kubernetes.namespaces import namespace_names
from lapse.functions.durations import format_duration
from lapse.functions.ports import Handler
from lapse.functions.safety import NamespaceFilter
from lapse.functions.ttl_planner import Planner
from lapse.operations.reconcile.counts import Options, ReconcileError, RunCounts, one_line
from lapse.operations.reconcile.passes import Reconciler
from lapse.operations.reconcile.scope import cleaned_namespaces, needs_namespace_list
from lapse.runtime import policy_watcher
from lapse.runtime.resources import Resources
from lapse.telemetry import names
from lapse.telemetry.providers import instruments, metrics_enabled

log = logging.getLogger(__name__)

# Runs planned at once: a background pass, gentle on NATS beside the live planner.
CONCURRENCY: Final = 8
# How often the last pass is written again (the health bucket forgets a key after 60 s).
HEARTBEAT: Final = 20.0


@dataclass(frozen=True)
class PassReport:
    """What one pass found: each listed run in one bucket, and what went wrong."""

    started: float  # Unix time
    seconds: float
    namespaces: int  # scopes listed (a name each; 1 for every namespace at once)
    listed: int = 0
    planned: int = 0  # had no schedule (an event was lost): given its deadline
    repaired: int = 0  # a stale deadline moved, or withdrawn (keep, never)
    unchanged: int = 0
    failed: int = 0  # the planner refused the run (recorded, dead-lettered)
    ignored: int = 0  # not finished, or not readable as its kind
    errors: int = 0  # could not be planned (NATS trouble): the next pass tries again
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems and self.errors == 0

    def as_json(self) -> dict[str, Any]:
        return {
            "started": self.started,
            "seconds": round(self.seconds, 3),
            "namespaces": self.namespaces,
            "listed": self.listed,
            "planned": self.planned,
            "repaired": self.repaired,
            "unchanged": self.unchanged,
            "failed": self.failed,
            "ignored": self.ignored,
            "errors": self.errors,
            "problems": list(self.problems),
            "ok": self.ok,
        }


def pass_report(
    started: float, seconds: float, namespaces: int, counts: RunCounts, problems: list[str]
) -> PassReport:
    """A pass's report from the runs pass's counts: `scheduled` splits into planned (a
    deadline where none stood) and repaired (one that stood moved), and a withdrawn
    deadline is a repair too."""
    return PassReport(
        started=started,
        seconds=seconds,
        namespaces=namespaces,
        listed=counts.listed,
        planned=counts.scheduled - counts.replaced,
        repaired=counts.replaced + counts.cancelled,
        unchanged=counts.unchanged,
        failed=counts.failed,
        ignored=counts.ignored,
        errors=counts.errors,
        problems=tuple(problems),
    )


def next_wait(settings: ReconcileConfig, rng: random.Random, *, first: bool = False) -> float:
    """Seconds until the next pass: the period plus up to the jitter; the first pass after
    a start waits only the jitter (what was lost while no watcher ran is found soon)."""
    jitter = rng.uniform(0.0, settings.jitter.total_seconds())
    return jitter if first else settings.period.total_seconds() + jitter


def record(report: PassReport) -> None:
    """The pass in the metrics."""
    if report.ok:
        telemetry.observe_reconciled(report.started + report.seconds)
    if not metrics_enabled():
        return
    meter = instruments()
    for outcome, count in (
        ("listed", report.listed),
        ("planned", report.planned),
        ("repaired", report.repaired),
        ("failed", report.failed),
        ("error", report.errors),
    ):
        if count:
            meter.reconcile_runs.add(count, {names.RECONCILE_OUTCOME: outcome})
    result = "ok" if report.ok else "error"
    meter.reconcile_duration.record(report.seconds, {names.HANDLER_RESULT: result})


def describe(report: PassReport) -> str:
    found = (
        f"{report.listed} finished runs seen in {report.namespaces} scopes, "
        f"{report.planned} planned, {report.repaired} repaired, {report.failed} refused, "
        f"{report.errors} not planned, in {report.seconds:.1f}s"
    )
    return found + (f"; {'; '.join(report.problems)}" if report.problems else "")


@dataclass
class SafetyNet:
    """Passes every period until stopped; each one's report kept for `lapse status`."""

    resources: Resources
    planner: Planner
    settings: ReconcileConfig
    within: NamespaceFilter
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.time
    last: PassReport | None = None
    passes: int = 0
    _kv: KeyValue | None = None
    _report_refused: bool = False

    async def one_pass(self) -> PassReport:
        started, began = self.clock(), time.monotonic()
        counts = RunCounts()
        problems: list[str] = []
        scopes: tuple[str | None, ...] = ()
        try:
            listed = None
            if needs_namespace_list(self.within):
                listed = await namespace_names(
                    self.resources.kube_client(), self.resources.kube_executor()
                )
            scopes = cleaned_namespaces(self.within, listed)
        except Exception as exc:  # the API server away, or no right to list namespaces
            problems.append(f"listing the namespaces failed: {one_line(exc)}")
        for scope in scopes:
            options = Options(
                namespace=scope,
                runs=True,
                rows=False,
                page_size=self.settings.page_size,
                concurrency=CONCURRENCY,
                within=self.within,
            )
            reconciler = Reconciler(self.resources, self.planner, options)
            try:
                await reconciler.reconcile_runs(counts)
            except ReconcileError as exc:  # this namespace; the others still get their pass
                problems.append(str(exc))
            except Exception as exc:  # the API server away: the next pass tries again
                where = scope or "every namespace"
                problems.append(f"listing runs in {where} failed: {one_line(exc)}")
            problems += [p for p in reconciler.problems if p not in problems]
        report = pass_report(started, time.monotonic() - began, len(scopes), counts, problems)
        self.last = report
        self.passes += 1
        record(report)
        (log.info if report.ok else log.warning)("safety net pass: %s", describe(report))
        return report

    async def run(self, stop: asyncio.Event) -> None:
        """A pass after the first wait, then one every period, until `stop`; the last
        pass written to the health bucket meanwhile."""
        heartbeat = asyncio.create_task(self._heartbeat(stop), name="safety net report")
        try:
            wait = next_wait(self.settings, self.rng, first=True)
            while not await _stopped(stop, wait):
                await self.one_pass()
                await self._report()
                wait = next_wait(self.settings, self.rng)
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        while not await _stopped(stop, HEARTBEAT):
            await self._report()

    async def _report(self) -> None:
        if self.last is None:
            return
        try:
            if self._kv is None:
                js = await self.resources.jetstream()
                self._kv = await health.bucket(js, replicas=self.resources.config.nats.replicas)
            await health.report_reconcile(self._kv, health.process_key(), self.last.as_json())
            self._report_refused = False
        except Exception as exc:  # status only: the passes go on whatever happens here
            if not self._report_refused:
                log.warning("safety net: writing the last pass for lapse status failed (%s); "
                            "the NATS user needs publish on $KV.LAPSE_HEALTH.reconcile.>",
                            one_line(exc))  # fmt: skip
            self._report_refused = True


async def _stopped(stop: asyncio.Event, seconds: float) -> bool:
    """Wait `seconds` or until `stop`; whether it was stopped."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    return stop.is_set()


def planner_of(handler: Handler) -> Planner:
    """The ttl-planner inside the watcher's handler (its telemetry wrapper)."""
    inner = getattr(handler, "inner", handler)
    if not isinstance(inner, Planner):
        raise TypeError(f"not a ttl-planner: {type(inner).__name__}")
    return inner


async def serve(
    config: LapseConfig, stop: asyncio.Event, *, ready_file: Path | None = None
) -> SafetyNet | None:
    """The policy watcher (`policy_watcher.serve`) with the safety net beside it, started
    once the policy objects are read; without `reconcile.enabled`, the watcher alone."""
    found: list[SafetyNet] = []

    async def beside(resources: Resources, handler: Handler) -> None:
        net = SafetyNet(resources, planner_of(handler), config.reconcile, config.safety.namespaces)
        found.append(net)
        log.info("safety net: a pass every %s (+ up to %s)",
                 format_duration(config.reconcile.period),
                 format_duration(config.reconcile.jitter))  # fmt: skip
        await net.run(stop)

    enabled = config.reconcile.enabled
    await policy_watcher.serve(
        config, stop, ready_file=ready_file, beside=beside if enabled else None
    )
    return found[0] if found else None


def main() -> None:
    """`python -m lapse.operations.reconcile.periodic`: the Deployment lapse-policy-watcher."""
    policy_watcher.main(serve)


if __name__ == "__main__":
    main()
