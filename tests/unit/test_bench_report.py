"""The pure pieces of the comparison benchmark: audit parsing, lateness, the janitor's rule,
the scale-out phase's CPU arithmetic and verdict.

Benchmarks are not tests: nothing here times anything.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.janitor import deadline, expired
from bench.report import (
    Request,
    count_requests,
    cpu_seconds,
    lateness,
    machine_busy,
    parse_audit_line,
    percentile,
    render_table,
    requests_per_deletion,
    saturated,
    scale_out_ratios,
)


def request(verb: str, name: str, done: float, *, user: str = "lapse", code: int = 200) -> Request:
    return Request(user, verb, "workflows", "ns", name, code, at=done - 0.01, done=done)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([float(i) for i in range(101)], 99) == 99.0


def test_lateness_counts_early_lost_and_duplicates_per_user() -> None:
    due = {("ns", "a"): 100.0, ("ns", "b"): 100.0, ("ns", "c"): 100.0, ("ns", "d"): 100.0}
    requests = [
        request("delete", "a", 100.5),
        request("delete", "a", 101.0, code=404),  # a second DELETE of the same object
        request("delete", "b", 99.0),  # before its deadline
        request("get", "c", 100.2),  # a GET deletes nothing
        request("delete", "c", 100.1, user="argo"),  # another tool's deletion
        request("delete", "d", 103.0, code=409),  # refused: not deleted
        request("delete", "d", 102.0),
    ]
    late = lateness(due, requests, "lapse")
    assert (late.count, late.deleted, late.early, late.lost) == (4, 3, 1, 1)
    assert late.duplicate_deletes == 2
    assert late.max_s == pytest.approx(2.0)
    assert late.p50_s == pytest.approx(0.5)


def test_a_delete_cut_short_by_a_kill_and_made_again_is_not_a_duplicate() -> None:
    due = {("ns", "a"): 100.0, ("ns", "b"): 100.0, ("ns", "c"): 100.0}
    requests = [
        request("delete", "a", 100.2, code=504),  # the client killed: not committed,
        request("delete", "a", 104.0),  # as the restarted process's 200 shows
        request("delete", "b", 100.2, code=504),  # committed after all:
        request("delete", "b", 104.0, code=404),  # the second one was a duplicate
        request("delete", "c", 100.2),
        request("delete", "c", 104.0, code=404),  # after a success: a duplicate
    ]
    late = lateness(due, requests, "lapse", present=set())
    assert late.duplicate_deletes == 2
    assert (late.deleted, late.lost) == (2, 0)


def test_lost_is_what_still_exists_when_that_is_known() -> None:
    # A DELETE cut short by a kill -9 is audited 504 although it may have committed: the
    # objects still there at the end decide what was lost.
    due = {("ns", "a"): 100.0, ("ns", "b"): 100.0}
    requests = [request("delete", "a", 100.5, code=504), request("delete", "b", 100.5, code=504)]
    assert lateness(due, requests, "lapse").lost == 2
    assert lateness(due, requests, "lapse", present={("ns", "b")}).lost == 1


def test_requests_per_deletion_counts_every_request_in_the_window() -> None:
    requests = [
        request("get", "a", 10.0),
        request("delete", "a", 10.1),
        request("list", "", 11.0),
        request("delete", "b", 50.0),  # outside the window
        request("get", "b", 10.5, user="janitor"),
    ]
    counts = count_requests(requests, "lapse", 0.0, 20.0)
    assert counts == {"get workflows": 1, "delete workflows": 1, "list workflows": 1}
    assert requests_per_deletion(counts, 1) == 3.0
    assert requests_per_deletion(counts, 0) is None


def test_parse_audit_line_reads_the_complete_stage_only() -> None:
    event: dict[str, Any] = {
        "stage": "ResponseComplete",
        "verb": "delete",
        "user": {"username": "argo"},
        "objectRef": {"resource": "workflows", "namespace": "bench", "name": "wf-1"},
        "responseStatus": {"code": 200},
        "requestReceivedTimestamp": "2026-01-01T00:00:00.250000Z",
        "stageTimestamp": "2026-01-01T00:00:00.750000Z",
    }
    parsed = parse_audit_line(json.dumps(event))
    assert parsed is not None
    assert (parsed.user, parsed.verb, parsed.name, parsed.code) == ("argo", "delete", "wf-1", 200)
    assert parsed.done - parsed.at == pytest.approx(0.5)
    assert parse_audit_line(json.dumps({**event, "stage": "ResponseStarted"})) is None
    assert parse_audit_line("not json") is None


def test_render_table_shows_missing_figures_as_dashes() -> None:
    table = render_table({"lapse": {"lateness_p50_s": 0.07, "early": 0}, "argo": {"early": 2}})
    lines = table.splitlines()
    assert lines[0].split() == ["lapse", "argo"]
    assert "0.070" in table and "-" in lines[2]
    assert not any(line.startswith("RSS") for line in lines)  # no tool has it: no row


def finished(phase: str, ttl: dict[str, int], **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"labels": {"workflows.argoproj.io/completed": "true"}, **meta},
        "spec": {"ttlStrategy": ttl},
        "status": {"phase": phase, "finishedAt": "2026-01-01T00:00:00Z"},
    }


def test_janitor_uses_argos_ttl_rule() -> None:
    start = 1767225600.0  # 2026-01-01T00:00:00Z
    both = {"secondsAfterCompletion": 100, "secondsAfterFailure": 10}
    assert deadline(finished("Failed", both)) == start + 10
    assert deadline(finished("Succeeded", both)) == start + 100
    assert deadline(finished("Succeeded", {})) is None
    running = finished("Succeeded", both)
    running["metadata"]["labels"] = {}
    assert deadline(running) is None


def test_janitor_deletes_only_past_the_deadline_and_not_twice() -> None:
    start = 1767225600.0
    wf = finished("Succeeded", {"secondsAfterCompletion": 60})
    assert not expired(wf, start + 59.9)
    assert expired(wf, start + 60)
    going = finished("Succeeded", {"secondsAfterCompletion": 60}, deletionTimestamp="x")
    assert not expired(going, start + 3600)


def test_cpu_seconds_reads_utime_and_stime_after_a_command_name_with_spaces() -> None:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime ...
    stat = "4242 (nats server) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 50 0 0 20 0 9"
    assert cpu_seconds(stat, 100) == 3.0


def test_machine_busy_counts_idle_and_iowait_as_not_busy() -> None:
    before = [100, 0, 100, 700, 100, 0, 0, 0]
    after = [200, 0, 200, 800, 200, 0, 0, 0]  # 200 busy, 200 idle/iowait
    assert machine_busy(before, after) == 0.5
    assert machine_busy(before, before) is None


def test_scale_out_ratios_are_each_rate_over_one_process() -> None:
    assert scale_out_ratios({4: 360.0, 1: 100.0, 2: 190.0}) == {1: 1.0, 2: 1.9, 4: 3.6}
    assert scale_out_ratios({1: None, 2: 190.0}) == {1: None, 2: None}
    assert scale_out_ratios({2: 190.0}) == {2: None}


def test_saturated_names_the_quota_then_a_busy_server_then_the_machine() -> None:
    servers = {"kube-apiserver": 0.5, "nats-server": 0.2}
    assert saturated([0.24, 0.23], 0.25, servers, 0.5) == "lapse (its CPU quota)"
    # one process below its quota: not the quota
    busy_api = {"kube-apiserver": 0.95, "nats-server": 0.2}
    assert saturated([0.24, 0.1], 0.25, busy_api, 0.5) == "kube-apiserver"
    assert saturated([0.1], 0.25, servers, 0.95) == "the machine (all cores busy)"
    assert saturated([0.1], 0.25, servers, 0.5) == "none by CPU (waiting on round trips)"
