"""The pure half of the comparison benchmark: audit records in, figures and a table out.

Nothing here talks to a server. `bench/compare.py` feeds it the API server's own audit log
(one line per request, one user per tool) and the deadlines it gave the objects it made.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Request:
    """One API request as the API server's audit log records it (stage ResponseComplete)."""

    user: str
    verb: str  # the audit verb: get, list, watch, create, update, patch, delete, ...
    resource: str
    namespace: str
    name: str
    code: int
    at: float  # the server's requestReceivedTimestamp, seconds since the epoch
    done: float  # the server's stageTimestamp (the response was complete)


def parse_timestamp(text: str) -> float:
    """An RFC 3339 timestamp from the audit log ("...T12:00:00.123456Z") as epoch seconds."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def parse_audit_line(line: str) -> Request | None:
    """A `Request` from one JSON line of the audit log; None for other stages or junk."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if event.get("stage") != "ResponseComplete":
        return None
    ref = event.get("objectRef") or {}
    return Request(
        user=str(event.get("user", {}).get("username", "")),
        verb=str(event.get("verb", "")),
        resource=str(ref.get("resource", "")),
        namespace=str(ref.get("namespace", "")),
        name=str(ref.get("name", "")),
        code=int((event.get("responseStatus") or {}).get("code", 0)),
        at=parse_timestamp(event["requestReceivedTimestamp"]),
        done=parse_timestamp(event["stageTimestamp"]),
    )


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between closest ranks; None if
    there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def deletions(requests: Iterable[Request], user: str) -> dict[tuple[str, str], float]:
    """(namespace, name) -> when the first successful DELETE of that object by `user`
    completed, by the server's clock."""
    first: dict[tuple[str, str], float] = {}
    for r in requests:
        if r.user == user and r.verb == "delete" and r.name and 200 <= r.code < 300:
            key = (r.namespace, r.name)
            if key not in first or r.done < first[key]:
                first[key] = r.done
    return first


@dataclass(frozen=True)
class Lateness:
    """How a tool met the deadlines of one set of objects."""

    count: int  # objects that came due
    deleted: int
    early: int  # deleted before their deadline
    lost: int  # due but not deleted by the end of the observation
    p50_s: float | None
    p99_s: float | None
    max_s: float | None
    duplicate_deletes: int  # DELETE requests after the one that deleted (`_duplicates`)

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "count": self.count,
            "deleted": self.deleted,
            "early": self.early,
            "lost": self.lost,
            "lateness_p50_s": _round(self.p50_s),
            "lateness_p99_s": _round(self.p99_s),
            "lateness_max_s": _round(self.max_s),
            "duplicate_deletes": self.duplicate_deletes,
        }


def lateness(
    due: Mapping[tuple[str, str], float],
    requests: Sequence[Request],
    user: str,
    present: set[tuple[str, str]] | None = None,
) -> Lateness:
    """Lateness of each object's deletion (deleted - due) over the objects in `due`.

    `present`, when given, is what still exists at the end: lost is then exactly those.
    (A DELETE whose client was killed mid-request is audited with 504 although it may have
    committed; without `present` such an object counts as lost.)"""
    deleted = deletions(requests, user)
    late = [deleted[key] - at for key, at in due.items() if key in deleted]
    attempts: dict[tuple[str, str], list[Request]] = {}
    for r in requests:
        if r.user == user and r.verb == "delete" and (r.namespace, r.name) in due:
            attempts.setdefault((r.namespace, r.name), []).append(r)
    return Lateness(
        count=len(due),
        deleted=len(late),
        early=sum(1 for x in late if x < 0),
        lost=len(due) - len(late) if present is None else len(set(due) & present),
        p50_s=percentile(late, 50),
        p99_s=percentile(late, 99),
        max_s=max(late) if late else None,
        duplicate_deletes=sum(_duplicates(tries) for tries in attempts.values()),
    )


def _duplicates(tries: Sequence[Request]) -> int:
    """One object's DELETE requests beyond the one that deleted it: every request after
    the first that succeeded, or all but one when none did (a 504 then a 404: the first
    committed). A request before the one that succeeded deleted nothing (that one still
    found the object): a DELETE cut short by a kill -9 (audited 504) and made again after
    the restart is a retry, not a second deletion."""
    ordered = sorted(tries, key=lambda r: r.at)
    for index, r in enumerate(ordered):
        if 200 <= r.code < 300:
            return len(ordered) - index - 1
    return max(len(ordered) - 1, 0)


def count_requests(
    requests: Iterable[Request], user: str, start: float, end: float
) -> Counter[str]:
    """Requests by `user` received in [start, end), by "verb resource"."""
    return Counter(
        f"{r.verb} {r.resource}" for r in requests if r.user == user and start <= r.at < end
    )


def requests_per_deletion(counts: Counter[str], deleted: int) -> float | None:
    """Every request the tool made in a window, per object it deleted in that window."""
    if deleted == 0:
        return None
    return round(sum(counts.values()) / deleted, 3)


def per_minute(count: int, seconds: float) -> float:
    return round(count * 60 / seconds, 1) if seconds > 0 else 0.0


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


# --- the table ------------------------------------------------------------------------------

# (key in each tool's figures, row label, format)
ROWS: tuple[tuple[str, str, str], ...] = (
    ("lateness_p50_s", "lateness p50 (s)", "{:.3f}"),
    ("lateness_p99_s", "lateness p99 (s)", "{:.3f}"),
    ("early", "deleted early", "{:d}"),
    ("lost", "lost (due, not deleted)", "{:d}"),
    ("requests_per_deletion", "API requests per deletion", "{:.2f}"),
    ("idle_requests_per_min", "idle API requests per min", "{:.1f}"),
    ("drain_per_s", "backlog drain (deletions/s)", "{:.1f}"),
    ("drain_two_processes_per_s", "backlog drain, two processes (deletions/s)", "{:.1f}"),
    (
        "restart_inflight_done_after_restart_max_s",
        "after kill -9: in flight done after restart, max (s)",
        "{:.1f}",
    ),
    ("restart_lost", "after kill -9: lost", "{:d}"),
    ("scale_out_ratio_2", "scale-out, 2 CPU-capped processes / 1", "{:.2f}"),
    ("scale_out_ratio_4", "scale-out, 4 CPU-capped processes / 1", "{:.2f}"),
    ("restart_new_finish_p99_late_s", "restart: new finishes p99 late (s)", "{:.1f}"),
    (
        "restart_relist_new_finish_p99_late_s",
        "restart with re-list: new finishes p99 late (s)",
        "{:.1f}",
    ),
    ("restart_rss_peak_vs_steady", "restart: RSS peak / steady", "{:.2f}"),
    ("restart_relist_rss_peak_vs_steady", "restart with re-list: RSS peak / steady", "{:.2f}"),
    ("restart_inflight_max_late_s", "after kill -9: in-flight max late (s)", "{:.1f}"),
    ("restart_duplicate_deletes", "after kill -9: duplicate DELETEs", "{:d}"),
    ("rss_mib", "RSS (MiB)", "{:.0f}"),
    ("planner_events_per_s", "planner (events/s)", "{:.0f}"),
    ("nats_rss_mib", "nats-server RSS (MiB)", "{:.0f}"),
)


def render_table(
    tools: Mapping[str, Mapping[str, object]], rows: Sequence[tuple[str, str, str]] = ROWS
) -> str:
    """A plain-text table: one column per tool, one row per figure ("-" where not measured)."""
    names = list(tools)
    cells = [["", *names]]
    for key, label, fmt in rows:
        line = [label]
        for name in names:
            value = tools[name].get(key)
            line.append("-" if value is None else _format(fmt, value))
        if any(cell != "-" for cell in line[1:]):
            cells.append(line)
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    out = []
    for i, row in enumerate(cells):
        padded = [
            cell.ljust(width) if j == 0 else cell.rjust(width)
            for j, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        out.append("  ".join(padded))
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _format(fmt: str, value: object) -> str:
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


# --- scale-out (N CPU-capped processes against one) -----------------------------------------


def cpu_seconds(stat: str, ticks_per_s: int) -> float:
    """User + system CPU seconds of a process from its /proc/<pid>/stat line (the command
    name, in parentheses, may hold spaces: fields are counted after its closing one)."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / ticks_per_s  # utime, stime (14th, 15th)


def machine_busy(before: Sequence[int], after: Sequence[int]) -> float | None:
    """The fraction of all CPUs busy between two readings of /proc/stat's `cpu` line
    (user nice system idle iowait irq softirq steal ...): idle and iowait are not busy."""
    total = sum(after) - sum(before)
    idle = (after[3] + after[4]) - (before[3] + before[4])
    return round((total - idle) / total, 3) if total > 0 else None


def scale_out_ratios(rates: Mapping[int, float | None]) -> dict[int, float | None]:
    """Each N's drain rate over one process's (None where either is missing)."""
    one = rates.get(1)
    return {n: round(r / one, 2) if r and one else None for n, r in sorted(rates.items())}


# A capped process using this share of its quota is limited by it; an uncapped component
# using this share of one core is busy on its own (Python's GIL and nats-server's hot loop
# are single-threaded in effect); a machine this busy limits everyone.
SATURATED = 0.9


def saturated(
    lapse_cores: Sequence[float], quota_cores: float, servers: Mapping[str, float], busy: float
) -> str:
    """What limited a scale-out drain, from the CPU each part used over it (cores):
    the lapse processes' quota, else a server near a whole core, else the whole machine,
    else nothing that CPU shows (waits: round trips, locks)."""
    if lapse_cores and min(lapse_cores) >= SATURATED * quota_cores:
        return "lapse (its CPU quota)"
    name, cores = max(servers.items(), key=lambda item: item[1], default=("", 0.0))
    if cores >= SATURATED:
        return name
    if busy >= SATURATED:
        return "the machine (all cores busy)"
    return "none by CPU (waiting on round trips)"
