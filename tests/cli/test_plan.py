"""`lapse plan` (and reconcile's namespace flags) against a real kube-apiserver and
PostgreSQL: formats, -n/-A/-l against what the API says, KFP rows whose Workflow is gone;
and, with a real S3 server (SeaweedFS), what each run's artifacts target will delete."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import obstore
import pytest
import yaml
from sqlalchemy import text
from sqlalchemy.engine import make_url

from lapse.edges.database import create_engine
from lapse.embedded.seaweedfs import REGION, EmbeddedSeaweedFS
from lapse.events.types import Outcome
from lapse.functions.row_reaper.mlmd import DELETE_ORDER
from lapse.functions.row_reaper.targets import kfp_target, mlmd_target
from tests.cli.conftest import Shell, items
from tests.conftest import ARTIFACT_BUCKET, KubeStack
from tests.integration.test_artifact_reaper import client, present
from tests.integration.test_cli_plan_infra import finished_workflow
from tests.integration.test_ml_metadata import (
    Mlmd,
    mlmd_python,  # noqa: F401 (a fixture)
    table_counts,
)
from tests.integration.test_ml_metadata import runs as mlmd_runs
from tests.integration.test_row_reaper import completed, due, reaper
from tests.kfp_schema import KFP_TABLES, create_kfp_tables, insert_kfp_runs, kfp_counts
from tests.stack import Database, scratch_database

pytestmark = [pytest.mark.kube]

FINISHED = "2026-11-20T10:00:00Z"


async def _two_namespaces(kube: KubeStack) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:6]
    a, b = kube.namespace(f"cli-a-{tag}"), kube.namespace(f"cli-b-{tag}")
    for ns in (a, b):
        for i, team in enumerate(("red", "blue")):
            labels = {"team": team}
            await kube.workflows.create(
                ns, finished_workflow(f"wf-{team}-{i}", "Succeeded", FINISHED, labels=labels)
            )
    return a, b


def _plan(shell: Shell, kube: KubeStack, *args: str) -> Any:
    result = shell("plan", "--kubeconfig", str(kube.kubeconfig), *args)
    assert result.returncode == 0, result.stderr
    return result


async def test_n_and_A_agree_with_the_api(shell: Shell, kube: KubeStack) -> None:
    a, _ = await _two_namespaces(kube)
    everything = items(_plan(shell, kube, "-A", "-o", "json"))
    listed = await kube.workflows.list(None, label_selector="workflows.argoproj.io/completed=true")
    api = {(w["metadata"]["namespace"], w["metadata"]["name"]) for w in listed["items"]}

    def workflows(rows: list[dict[str, str]]) -> set[tuple[str, str]]:
        # The session's API server also holds other tests' finished Jobs and TrainJobs.
        return {(r["namespace"], r["name"]) for r in rows if r["kind"] == "Workflow"}

    assert workflows(everything) == api
    # Without -n: every namespace, as before (-A only spells it out).
    default = items(_plan(shell, kube, "-o", "json"))
    assert workflows(default) == api

    only_a = items(_plan(shell, kube, "-n", a, "-o", "json"))
    in_a = (await kube.workflows.list(a))["items"]
    assert {r["name"] for r in only_a} == {w["metadata"]["name"] for w in in_a}
    assert {r["namespace"] for r in only_a} == {a}
    # -n is exact: a prefix of a namespace is not that namespace.
    assert items(_plan(shell, kube, "-n", a[:-1], "-o", "json")) == []


async def test_a_glob_in_n_still_works_with_a_deprecation_warning(
    shell: Shell, kube: KubeStack
) -> None:
    a, b = await _two_namespaces(kube)
    glob = a.replace("cli-a-", "cli-?-")  # matches a and b
    result = _plan(shell, kube, "-n", glob, "-o", "json")
    assert {r["namespace"] for r in items(result)} == {a, b}
    assert "deprecated" in result.stderr and "--namespace-glob" in result.stderr
    new = _plan(shell, kube, "--namespace-glob", glob, "-o", "json")
    assert new.stdout == result.stdout
    assert "deprecated" not in new.stderr


async def test_l_selects_on_the_api_server(shell: Shell, kube: KubeStack) -> None:
    a, _ = await _two_namespaces(kube)
    rows = items(_plan(shell, kube, "-n", a, "-l", "team=blue", "-o", "json"))
    assert [r["name"] for r in rows] == ["wf-blue-1"]
    rows = items(_plan(shell, kube, "-n", a, "-l", "team!=blue", "-o", "json"))
    assert [r["name"] for r in rows] == ["wf-red-0"]
    bad = shell("plan", "--kubeconfig", str(kube.kubeconfig), "-l", "team in (", "-o", "json")
    assert bad.returncode == 1  # the API server refuses the selector: a runtime failure
    assert bad.stderr.count("\n") == 1, bad.stderr


async def test_every_format(shell: Shell, kube: KubeStack) -> None:
    a, _ = await _two_namespaces(kube)
    as_json = items(_plan(shell, kube, "-n", a, "-o", "json"))
    as_yaml = yaml.safe_load(_plan(shell, kube, "-n", a, "-o", "yaml").stdout)
    assert as_yaml == {"apiVersion": "v1", "kind": "List", "items": as_json}
    assert len(as_json) == 2
    # kubectl's jsonpath (range/end, literals) and custom-columns, on the same List.
    template = '{range .items[*]}{.name}{"\\t"}{.targets.kubernetes.policy}{"\\n"}{end}'
    by_path = _plan(shell, kube, "-n", a, "-o", f"jsonpath={template}").stdout
    assert sorted(by_path.splitlines()) == sorted(
        f"{r['name']}\t{r['targets']['kubernetes']['policy']}" for r in as_json
    )
    names = _plan(shell, kube, "-n", a, "-o", "jsonpath={.items[*].name}").stdout
    assert sorted(names.split(" ")) == ["wf-blue-1", "wf-red-0"]
    columns = _plan(shell, kube, "-n", a, "-o", "custom-columns=NAME:.name,UID:.uid,X:.nope")
    assert [line.split() for line in columns.stdout.splitlines()] == [["NAME", "UID", "X"]] + [
        [r["name"], r["uid"], "<none>"] for r in as_json
    ]
    # The bare array of 0.1, until 0.3: asked for, and said to be deprecated.
    old = shell(
        "plan", "--kubeconfig", str(kube.kubeconfig), "-n", a, "-o", "json",
        env={"LAPSE_BARE_LISTS": "true"},
    )  # fmt: skip
    assert json.loads(old.stdout) == as_json and "deprecated" in old.stderr
    names = _plan(shell, kube, "-n", a, "-o", "name").stdout.split()
    assert sorted(names) == ["workflow.argoproj.io/wf-blue-1", "workflow.argoproj.io/wf-red-0"]

    table = _plan(shell, kube, "-n", a).stdout.splitlines()
    assert table[0].split()[:4] == ["NAMESPACE", "NAME", "KIND", "PHASE"]
    assert len(table) == 3 and all(line.startswith(a) for line in table[1:])
    bare = _plan(shell, kube, "-n", a, "--no-headers").stdout.splitlines()
    assert [line.split() for line in bare] == [line.split() for line in table[1:]]
    wide = _plan(shell, kube, "-n", a, "-o", "wide").stdout.splitlines()
    assert "UID" in wide[0].split() and "UID" not in table[0].split()
    uids = {r["uid"] for r in as_json}
    assert all(any(uid in line for uid in uids) for line in wide[1:])

    kube_only = items(_plan(shell, kube, "-n", a, "--target", "kubernetes", "-o", "json"))
    assert all(set(r["targets"]) == {"kubernetes"} for r in kube_only)


def test_nothing_found_says_so_on_stderr(shell: Shell, kube: KubeStack) -> None:
    ns = kube.namespace(f"cli-empty-{uuid.uuid4().hex[:6]}")
    result = _plan(shell, kube, "-n", ns)
    assert result.stdout == ""
    assert "No resources found" in result.stderr


@pytest.fixture(scope="module")
async def kfp_db() -> AsyncIterator[Database]:
    async with scratch_database("postgresql") as db:
        engine = create_engine(db.url)
        await create_kfp_tables(engine)
        await engine.dispose()
        yield db


@pytest.mark.db
async def test_plan_previews_rows_whose_workflow_is_gone(
    shell: Shell, kube: KubeStack, kfp_db: Database, tmp_path: Path
) -> None:
    gone, alive = str(uuid.uuid4()), str(uuid.uuid4())
    engine = create_engine(kfp_db.url)
    async with engine.begin() as conn:
        await insert_kfp_runs(conn, [gone, alive])  # namespace team-a, finished in 2023
    await engine.dispose()
    ns = kube.namespace("team-a")
    await kube.workflows.create(
        ns,
        finished_workflow(
            f"kfp-{alive[:8]}", "Succeeded", FINISHED, labels={"pipeline/runid": alive}
        ),
    )
    config = tmp_path / "lapse.yaml"
    config.write_text(
        f"database: {{url: '{kfp_db.url}', targets: {{kfp: {{enabled: true}}}}}}\n"
        "policies:\n"
        "  - name: kfp-rows\n"
        "    match: {has_labels: [pipeline/runid]}\n"
        "    database: {ttl: 30d}\n"
    )
    result = _plan(shell, kube, "--config", str(config), "-n", ns, "-o", "json")
    rows = items(result)
    orphans = [r for r in rows if r["objectGone"]]
    assert [r["uid"] for r in orphans] == [gone]
    assert orphans[0]["targets"] == {
        "database": {
            "action": "schedule",
            "deadline": "2023-12-14T22:23:20Z",  # FinishedAtInSec 1,700,000,600 + 30d
            "policy": "policy:kfp-rows",
            "reason": orphans[0]["targets"]["database"]["reason"],
            # Its rows, counted by the row-reaper's dry run (insert_kfp_runs' defaults).
            "rows": insert_defaults(),
        }
    }
    # The run whose Workflow exists is planned from its object, not as an orphan.
    assert any(r["kfpRunId"] == alive and not r["objectGone"] for r in rows)
    table = _plan(shell, kube, "--config", str(config), "-n", ns).stdout
    assert "(object gone)" in table
    # Rows carry no labels: with -l only objects are previewed.
    selected = items(
        _plan(shell, kube, "--config", str(config), "-n", ns, "-l", "team=x", "-o", "json")
    )
    assert not any(r["objectGone"] for r in selected)


def test_context_chooses_the_kubeconfig_context(
    shell: Shell, kube: KubeStack, tmp_path: Path
) -> None:
    config = yaml.safe_load(kube.kubeconfig.read_text())
    config["clusters"].append({"name": "nowhere", "cluster": {"server": "https://127.0.0.1:1"}})
    user = config["contexts"][0]["context"]["user"]
    config["contexts"].append(
        {"name": "elsewhere", "context": {"cluster": "nowhere", "user": user}}
    )
    config["current-context"] = "elsewhere"
    two = tmp_path / "two-contexts.yaml"
    two.write_text(yaml.safe_dump(config))

    chosen = shell("plan", "--kubeconfig", str(two), "--context", "lapse", "-o", "json")
    assert chosen.returncode == 0, chosen.stderr
    assert isinstance(items(chosen), list)
    current = shell("plan", "--kubeconfig", str(two), "-o", "json")  # elsewhere: nobody there
    assert current.returncode == 1
    assert current.stderr.count("\n") == 1, current.stderr
    unknown = shell("--context", "nope", "plan", "--kubeconfig", str(two))
    assert unknown.returncode == 2
    assert "nope" in unknown.stderr and "--context" in unknown.stderr


async def test_f_previews_a_policy_and_refuses_what_is_not_one(
    shell: Shell, kube: KubeStack, tmp_path: Path
) -> None:
    a, b = await _two_namespaces(kube)
    # No ClusterLapsePolicy allows it in this namespace: the preview says it would be
    # refused, and no run is planned by it.
    spec = {"match": {"labels": {"team": "red"}}, "kubernetes": {"ttl": "2h"}}
    policy = {"apiVersion": "lapse.dev/v1alpha1", "kind": "LapsePolicy",
              "metadata": {"name": "red"}, "spec": spec}  # fmt: skip
    file = tmp_path / "red.yaml"
    file.write_text(yaml.safe_dump(policy))
    refused = _plan(shell, kube, "-n", a, "-f", str(file), "--policy", "-o", "json")
    assert items(refused) == []
    assert f"lapsepolicy:{a}/red@1 (REFUSED): NotAllowed" in refused.stderr
    # With the bounds in the same file it would be in effect, for the red runs of `a` only.
    allow = {"match": {"namespaces": [a]}, "namespacedPolicies": {"allowed": True}}
    bounds = {"apiVersion": "lapse.dev/v1alpha1", "kind": "ClusterLapsePolicy",
              "metadata": {"name": "preview-bounds"}, "spec": allow}  # fmt: skip
    # With -A a LapsePolicy names its namespace (without -n there is none to take).
    policy["metadata"] = {"name": "red", "namespace": a}
    file.write_text(yaml.safe_dump_all([bounds, policy]))
    rows = items(_plan(shell, kube, "-A", "-f", str(file), "--policy", f"{a}/red",
                            "-o", "json"))  # fmt: skip
    assert {(r["namespace"], r["name"]) for r in rows} == {(a, "wf-red-0")}
    assert rows[0]["targets"]["kubernetes"]["policy"] == f"lapsepolicy:{a}/red@1"
    assert b not in {r["namespace"] for r in rows}
    # Anything else in the file is a usage error, not a guess.
    file.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap"}))
    wrong = shell("plan", "--kubeconfig", str(kube.kubeconfig), "-f", str(file))
    assert wrong.returncode == 2, wrong.stderr
    assert "only LapsePolicy and ClusterLapsePolicy objects" in wrong.stderr


async def test_plan_names_keep_last_when_the_count_sets_the_deadline(
    shell: Shell, kube: KubeStack, tmp_path: Path
) -> None:
    ns = kube.namespace(f"keep-last-{uuid.uuid4().hex[:6]}")
    cron = {"workflows.argoproj.io/cron-workflow": "nightly"}
    for i in range(3):  # wf-0 the oldest, wf-2 the newest
        finished = f"2026-11-20T10:0{i}:00Z"
        await kube.workflows.create(
            ns, finished_workflow(f"wf-{i}", "Succeeded", finished, labels=cron)
        )
    config = tmp_path / "lapse.yaml"
    config.write_text(
        "policies:\n"
        "  - name: nightly\n"
        "    kubernetes: {ttl: 3650d}\n"
        "    keep_last: {succeeded: 1}\n"  # group_by auto: the cron-workflow label
    )
    rows = items(_plan(shell, kube, "--config", str(config), "-n", ns, "-o", "json"))
    by_name = {r["name"]: r["targets"]["kubernetes"] for r in rows}
    assert by_name["wf-2"]["policy"] == "policy:nightly"  # the newest: its TTL
    for old in ("wf-0", "wf-1"):
        assert by_name[old]["policy"] == "keep_last:nightly"
        # Due when the run that pushed it out (wf-2, wf-1's; wf-1, wf-0's) finished.
        assert "keep_last.succeeded=1" in by_name[old]["reason"]
    assert by_name["wf-1"]["deadline"] == "2026-11-20T10:02:00Z"
    assert by_name["wf-0"]["deadline"] == "2026-11-20T10:01:00Z"
    table = _plan(shell, kube, "--config", str(config), "-n", ns).stdout
    assert "keep_last:nightly" in table
    # -l shows part of a group at most: no count is previewed from it, and it says so.
    selected = _plan(shell, kube, "--config", str(config), "-n", ns, "-l", "team!=x", "-o", "json")
    assert {r["targets"]["kubernetes"]["policy"] for r in items(selected)} == {"policy:nightly"}
    assert "keep_last is not previewed with -l" in selected.stderr


async def test_plan_previews_a_field_groups_surplus_namespace_by_namespace(
    shell: Shell, kube: KubeStack, tmp_path: Path
) -> None:
    # Grouped by the WorkflowTemplate in each Workflow's spec (no label says it): plan reads
    # the group from the objects it listed. Namespace b's run of the same template is the
    # newest of all, but a group never crosses a namespace: it pushes nothing out of a.
    tag = uuid.uuid4().hex[:6]
    a, b = kube.namespace(f"plan-fa-{tag}"), kube.namespace(f"plan-fb-{tag}")

    def submitted(name: str, template: str, finished: str) -> dict[str, Any]:
        workflow = finished_workflow(name, "Succeeded", finished)
        workflow["spec"]["workflowTemplateRef"] = {"name": template}
        return workflow

    for i in range(3):  # train-0 the oldest, train-2 the newest
        await kube.workflows.create(a, submitted(f"train-{i}", "train", f"2026-11-20T10:0{i}:00Z"))
    await kube.workflows.create(a, submitted("other", "other", "2026-11-20T09:00:00Z"))
    await kube.workflows.create(b, submitted("train-b", "train", "2026-11-20T11:00:00Z"))
    running = finished_workflow("train-running", "Running", "")
    del running["metadata"]["labels"]["workflows.argoproj.io/completed"]
    running["spec"]["workflowTemplateRef"] = {"name": "train"}
    del running["status"]["finishedAt"]
    await kube.workflows.create(a, running)  # not finished: never listed, never counted
    config = tmp_path / "lapse.yaml"
    config.write_text(
        "policies:\n"
        "  - name: templates\n"
        "    kubernetes: {ttl: 3650d}\n"
        "    keep_last: {group_by: 'field:spec.workflowTemplateRef.name', total: 1}\n"
    )
    glob = a.replace("plan-fa-", "plan-f?-")  # matches a and b, listed one at a time
    for scope in (["--namespace-glob", glob], ["-A"]):
        result = _plan(shell, kube, "--config", str(config), *scope, "-o", "json")
        rows = [r for r in items(result) if r["namespace"] in (a, b)]
        by_name = {(r["namespace"], r["name"]): r["targets"]["kubernetes"] for r in rows}
        assert set(by_name) == {(a, f"train-{i}") for i in range(3)} | {
            (a, "other"),
            (b, "train-b"),
        }
        for newest in ((a, "train-2"), (a, "other"), (b, "train-b")):
            assert by_name[newest]["policy"] == "policy:templates", (scope, newest)
        for old, pusher in (("train-0", "10:01"), ("train-1", "10:02")):
            assert by_name[(a, old)]["policy"] == "keep_last:templates", scope
            assert by_name[(a, old)]["deadline"] == f"2026-11-20T{pusher}:00Z"
            reason = by_name[(a, old)]["reason"]
            assert "keep_last.total=1" in reason and "spec.workflowTemplateRef.name" in reason


def _with_outputs(name: str, keys: list[str], **spec: Any) -> dict[str, Any]:
    """A finished Workflow whose outputs are where Argo records them (its status), in a
    repository named inline."""
    workflow = finished_workflow(name, "Succeeded", FINISHED, spec=spec)
    artifacts = [{"name": key.rsplit("/", 1)[-1], "s3": {"key": key}} for key in keys]
    workflow["status"]["artifactRepositoryRef"] = {
        "default": True,
        "artifactRepository": {"s3": {"bucket": ARTIFACT_BUCKET}},
    }
    workflow["status"]["nodes"] = {f"{name}-1": {"outputs": {"artifacts": artifacts}}}
    return workflow


async def test_plan_shows_what_the_artifacts_target_deletes_and_lists_sizes_only_when_asked(
    shell: Shell, kube: KubeStack, seaweedfs: EmbeddedSeaweedFS, tmp_path: Path
) -> None:
    ns = kube.namespace(f"plan-art-{uuid.uuid4().hex[:6]}")
    base = f"plan/{ns}"
    outputs = [f"{base}/wf/main.log", f"{base}/wf/model.tgz"]
    logs = f"plan/logs/{ns}/wf/"  # the declared prefix, rendered for this run
    sizes = {outputs[0]: 1000, outputs[1]: 2 * 1024 * 1024, f"{logs}a.txt": 24, f"{logs}b/c": 0}
    beside = [f"{base}/wf/main.log.1", f"{base}/wf2/main.log", f"plan/logs/{ns}/wf2/a.txt"]
    s3 = client(seaweedfs)
    for key, size in sizes.items():
        await obstore.put_async(s3, key, b"x" * size)
    for key in beside:
        await obstore.put_async(s3, key, b"not this run's")
    await kube.workflows.create(ns, _with_outputs("wf", [*outputs, "elsewhere/x.tgz"]))
    await kube.workflows.create(
        ns,
        _with_outputs("gc", [f"{base}/gc/out.tgz"], artifactGC={"strategy": "OnWorkflowDeletion"}),
    )
    config = tmp_path / "lapse.yaml"
    config.write_text(
        "policies:\n"
        "  - name: clocks\n"
        "    kubernetes: {ttl: 1h}\n"
        "    artifacts: {ttl: 30d}\n"
        "artifacts:\n"
        "  stores:\n"
        f"    - name: argo\n"
        f"      url: 's3://{ARTIFACT_BUCKET}/plan/'\n"
        f"      endpoint: '{seaweedfs.endpoint}'\n"
        f"      region: {REGION}\n"
        "      min_prefix_depth: 3\n"
        # The second template renders to 2 parts, fewer than min_prefix_depth: refused.
        "      capture: {argo-workflow: ['logs/{namespace}/{name}/', '{name}/']}\n"
    )

    def plan(*args: str) -> Any:
        result = shell(
            "plan", "--kubeconfig", str(kube.kubeconfig), "--config", str(config), "-n", ns,
            *args, env=seaweedfs.env(),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        return result

    rows = {r["name"]: r for r in items(plan("-o", "json"))}
    artifacts = rows["wf"]["targets"]["artifacts"]
    # The existing keys stay; the footprint is added beside them.
    assert set(artifacts) == {"action", "deadline", "policy", "reason", "footprint"}
    assert (artifacts["deadline"], artifacts["policy"]) == ("2026-12-20T10:00:00Z", "policy:clocks")
    assert artifacts["footprint"] == {
        "artifacts": 2,
        "prefixes": 2,
        "objects": None,  # no LIST without --list-artifacts: unknown, not 0
        "bytes": None,
        "listed": False,
        "refused": 1,
        "outside": 1,  # elsewhere/x.tgz: under no store's root
        "leftTo": None,
    }
    assert "artifactGC" in rows["gc"]["targets"]["artifacts"]["footprint"]["leftTo"]
    assert "footprint" not in rows["wf"]["targets"]["kubernetes"]
    table = plan().stdout.splitlines()
    header = table[0].split()
    assert "ARTIFACTS" in header and "WILL" in header
    by_name = {line.split()[1]: line for line in table[1:]}
    assert (
        "2 artifacts, 2 prefixes, bytes unknown; 1 refused; 1 outside the stores" in (by_name["wf"])
    )
    assert "left to the engine" in by_name["gc"]

    listed = {r["name"]: r for r in items(plan("--list-artifacts", "-o", "json"))}
    footprint = listed["wf"]["targets"]["artifacts"]["footprint"]
    # Exactly what the reaper would delete: the keys and what lies under the prefix,
    # none of the objects beside them.
    assert (footprint["objects"], footprint["bytes"]) == (4, sum(sizes.values()))
    assert footprint["listed"] is True
    assert listed["gc"]["targets"]["artifacts"]["footprint"]["objects"] is None
    table = plan("--list-artifacts").stdout
    assert "4 objects, 2.0 MiB" in table
    # Listing deleted nothing.
    assert {*sizes, *beside} <= await present(s3, "plan/")

    # A store that does not answer: the size is unknown, said on stderr, the plan still made.
    down = config.read_text().replace(seaweedfs.endpoint, "http://127.0.0.1:1")
    config.write_text(down)
    result = plan("--list-artifacts", "-o", "json")
    footprint = {r["name"]: r for r in items(result)}["wf"]["targets"]["artifacts"]
    assert footprint["footprint"]["bytes"] is None
    assert f"{ns}/wf: artifacts not listed" in result.stderr

    # Without object stores configured, the table is the one it always was.
    config.write_text("policies:\n  - name: clocks\n    kubernetes: {ttl: 1h}\n")
    plain = plan().stdout.splitlines()[0].split()
    assert "ARTIFACTS" not in plain and "WILL" not in plain


@pytest.fixture(params=["postgresql", "mysql"])
async def kfp_rows_db(request: pytest.FixtureRequest) -> AsyncIterator[Database]:
    async with scratch_database(request.param) as db:
        engine = create_engine(db.url)
        await create_kfp_tables(engine)
        await engine.dispose()
        yield db


@pytest.mark.db
async def test_plan_counts_the_rows_each_runs_database_target_will_delete(
    shell: Shell, kube: KubeStack, kfp_rows_db: Database, tmp_path: Path
) -> None:
    run_id = str(uuid.uuid4())
    ns = kube.namespace(f"plan-rows-{uuid.uuid4().hex[:6]}")
    engine = create_engine(kfp_rows_db.url)
    async with engine.begin() as conn:
        await insert_kfp_runs(conn, [run_id], metrics=3, tasks=4, namespace=ns)
    async with engine.connect() as conn:
        before = await kfp_counts(conn, run_id)
    await kube.workflows.create(
        ns, finished_workflow("kfp-run", "Succeeded", FINISHED, labels={"pipeline/runid": run_id})
    )
    config = tmp_path / "lapse.yaml"
    config.write_text(
        f"database: {{url: '{kfp_rows_db.url}', targets: {{kfp: {{enabled: true}}}}}}\n"
        "policies:\n"
        "  - name: kfp-rows\n"
        "    match: {has_labels: [pipeline/runid]}\n"
        "    database: {ttl: 30d}\n"
    )

    def plan(*args: str) -> Any:
        return shell("plan", "--kubeconfig", str(kube.kubeconfig), "--config", str(config),
                     "-n", ns, *args)  # fmt: skip

    result = plan("-o", "json")
    assert result.returncode == 0, result.stderr
    [row] = items(result)
    database = row["targets"]["database"]
    # Every key it had stays; the rows are added beside them, one count per table, the
    # same as counting the run's rows directly.
    assert set(database) == {"action", "deadline", "policy", "reason", "rows"}
    assert database["rows"] == before
    assert before == {"run_details": 1, "run_metrics": 3, "tasks": 4, "resource_references": 2}
    assert "rows" not in row["targets"]["kubernetes"]
    table = plan().stdout.splitlines()
    assert table[0].split()[-1] == "ROWS"
    # In the order the reaper deletes them, children first.
    assert table[1].endswith("run_metrics 3, tasks 4, resource_references 2, run_details 1")

    # --no-rows: not counted, not shown.
    skipped = plan("--no-rows", "-o", "json")
    assert "rows" not in items(skipped)[0]["targets"]["database"]
    assert "ROWS" not in plan("--no-rows").stdout.splitlines()[0].split()

    # Counting deleted nothing: the dry run's transaction was rolled back.
    async with engine.connect() as conn:
        assert await kfp_counts(conn, run_id) == before
    await engine.dispose()

    # A database nobody answers at: unknown, said once on stderr; the plan is still made.
    closed = config.read_text().replace(kfp_rows_db.url, _closed_port_url(kfp_rows_db.url))
    config.write_text(closed)
    down = plan("-o", "json")
    assert down.returncode == 0, down.stderr
    [row] = items(down)
    assert row["targets"]["database"]["rows"] is None
    assert row["targets"]["database"]["deadline"] == database["deadline"]
    assert down.stderr.count("database rows not counted") == 1, down.stderr
    table = plan().stdout.splitlines()
    assert table[1].endswith("unknown")


def _closed_port_url(url: str) -> str:
    """The same database URL at a port on this machine where nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # free once closed: nothing will answer there
    return make_url(url).set(host="127.0.0.1", port=port).render_as_string(False)


@pytest.mark.db
async def test_plan_counts_ml_metadata_rows_as_the_reaper_then_deletes_them(
    shell: Shell,
    kube: KubeStack,
    mysql: Database,
    mlmd_python: str,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    # MLMD's own library writes the run (MySQL: the writer's only backend), KFP's rows beside
    # it on the same server, as KFP keeps them (metadb next to mlpipeline).
    run_id = str(uuid.uuid4())
    ns = kube.namespace(f"plan-mlmd-{uuid.uuid4().hex[:6]}")
    async with scratch_database("mysql") as kfp_db:
        engine = create_engine(kfp_db.url)
        await create_kfp_tables(engine)
        async with engine.begin() as conn:
            await insert_kfp_runs(conn, [run_id], namespace=ns)
        metadb = f"metadb_{uuid.uuid4().hex[:8]}"
        async with engine.connect() as conn:
            await conn.execute(text(f"CREATE DATABASE {metadb}"))
        try:
            mlmd = Mlmd(mlmd_python, kfp_db.url, metadb)
            await mlmd.write(mlmd_runs(run_id, str(uuid.uuid4()))[0])
            labels = {"pipeline/runid": run_id}
            await kube.workflows.create(
                ns, finished_workflow("kfp-run", "Succeeded", FINISHED, labels=labels)
            )
            config = tmp_path / "lapse.yaml"
            config.write_text(
                f"database: {{url: '{kfp_db.url}', targets: {{kfp: {{enabled: true}}, "
                f"ml_metadata: {{enabled: true, database: {metadb}}}}}}}\n"
                "policies:\n"
                "  - name: kfp-rows\n"
                "    match: {has_labels: [pipeline/runid]}\n"
                "    database: {ttl: 30d}\n"
            )
            before = await table_counts(engine, metadb)
            args = ("plan", "--kubeconfig", str(kube.kubeconfig), "--config", str(config), "-n", ns)
            result = shell(*args, "-o", "json")
            assert result.returncode == 0, result.stderr
            [row] = items(result)
            planned = row["targets"]["database"]["rows"]
            table = shell(*args).stdout.splitlines()
            mlmd_rows = sum(planned[name] for name in DELETE_ORDER)
            assert mlmd_rows > 0
            assert table[1].endswith(f"run_details 1, mlmd {mlmd_rows}"), table[1]
            # The preview deleted nothing (MLMD's dry run is rolled back).
            assert await table_counts(engine, metadb) == before
            assert (await mlmd.read(run_id))["runs"][run_id] is not None
            async with engine.connect() as conn:
                assert (await kfp_counts(conn, run_id))["run_details"] == 1

            # What the row-reaper then deletes is what plan said, table by table.
            handler, _ = await reaper(engine, [kfp_target(), mlmd_target(metadb)])
            done = completed((await handler.handle(due(kfp_run_id=run_id, namespace=ns)))[0])
            assert done.outcome is Outcome.DELETED, done
            after = await table_counts(engine, metadb)
            assert {name: before[name] - after[name] for name in DELETE_ORDER} == {
                name: planned[name] for name in DELETE_ORDER
            }
            async with engine.connect() as conn:
                assert await kfp_counts(conn, run_id) == dict.fromkeys(KFP_TABLES, 0)
            assert {n: planned[n] for n in KFP_TABLES} == insert_defaults()
        finally:
            async with engine.connect() as conn:
                await conn.execute(text(f"DROP DATABASE IF EXISTS {metadb}"))
            await engine.dispose()


def insert_defaults() -> dict[str, int]:
    """A run's KFP rows as insert_kfp_runs writes them by default."""
    return {"run_details": 1, "run_metrics": 2, "tasks": 2, "resource_references": 2}
