"""`lapse up` as users run it (a subprocess) against real NATS, kube-apiserver and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.report import parse_timestamp
from lapse.edges.database import create_engine
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port
from tests.conftest import KubeStack, kube_stack
from tests.e2e.apiserver_audit import audited_kube_stack, deletes, successful
from tests.kfp_schema import create_kfp_tables, insert_kfp_runs, kfp_counts
from tests.stack import Database, scratch_database, wait_for


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    # Its own API server: `lapse up` watches every namespace, and `lapse status` counts
    # every pending schedule, so other tests' workflows must not be in view.
    with kube_stack(tmp_path_factory.mktemp("kube-e2e")) as stack:
        yield stack


@pytest.fixture(scope="module")
async def kfp_database() -> AsyncIterator[Database]:
    async with scratch_database("postgresql") as db:
        engine = create_engine(db.url)
        await create_kfp_tables(engine)
        await engine.dispose()
        yield db


class LapseUp:
    """One `lapse up` process; its log is kept for the failure message."""

    def __init__(
        self, config: Path, state_dir: Path, log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.ingress_port = free_port()
        self.env = env  # None: this process's environment
        self.args = [sys.executable, "-m", "lapse.cli", "--config", str(config), "up",
                     "--state-dir", str(state_dir),
                     "--listen", f"127.0.0.1:{self.ingress_port}"]  # fmt: skip
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        with self.log.open("ab") as out:
            # Popen returns at once; the wait for readiness below is async.
            self.process = subprocess.Popen(  # noqa: ASYNC220
                self.args, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        await wait_for(self._running, timeout=60)

    async def _running(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"lapse up exited:\n{self.log.read_text()[-3000:]}")
        return "lapse is running" in self.log.read_text()

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self, sig: signal.Signals = signal.SIGINT, timeout: float = 60) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            return self.process.wait(timeout=timeout)
        return self.process.returncode


def lapse_json(*args: str, config: Path) -> Any:
    result = subprocess.run(
        [sys.executable, "-m", "lapse.cli", "--config", str(config), *args, "-o", "json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    # A listing is a kubectl List (docs/cli.md): its items; a report (status) as it is.
    if isinstance(found, dict) and found.get("kind") == "List":
        assert found["apiVersion"] == "v1", found
        return found["items"]
    return found


def finished_workflow(name: str, **meta: Any) -> dict[str, Any]:
    now = datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "labels": {"workflows.argoproj.io/completed": "true", **meta.get("labels", {})},
            "annotations": meta.get("annotations", {}),
        },
        "spec": {"entrypoint": "main"},
        "status": {"phase": "Succeeded", "startedAt": now, "finishedAt": now},
    }


def write_config(path: Path, nats_url: str, kube: KubeStack, db: Database) -> Path:
    path.write_text(
        f"nats: {{url: '{nats_url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n"
        f"database: {{url: '{db.url}', targets: {{kfp: {{enabled: true}}}}}}\n"
        "policies:\n"
        "  - name: kfp-runs\n"
        "    match: {has_labels: [pipeline/runid]}\n"
        "    kubernetes: {ttl: 3s}\n"
        "    database: {ttl: 6s}\n"
        "safety: {max_deletions_per_second: 200, namespaces: {include: ['*']}}\n"
    )
    return path


async def test_up_deletes_objects_and_rows_on_their_own_clocks(
    tmp_path: Path, own_nats: EmbeddedNats, kube: KubeStack, kfp_database: Database
) -> None:
    config = write_config(tmp_path / "lapse.yaml", own_nats.url, kube, kfp_database)
    ns = kube.namespace(f"e2e-{uuid.uuid4().hex[:6]}")
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    try:
        run_ids = [str(uuid.uuid4()) for _ in range(2)]
        engine = create_engine(kfp_database.url)
        async with engine.begin() as conn:
            await insert_kfp_runs(conn, run_ids, namespace=ns)
        wfs = kube.workflows
        for i in range(3):
            await wfs.create(
                ns, finished_workflow(f"short-{i}", annotations={"lapse.dev/ttl": f"{2 + i}s"})
            )
        await wfs.create(
            ns,
            finished_workflow(
                "kept", annotations={"lapse.dev/ttl": "2s", "lapse.dev/keep": "true"}
            ),
        )
        for i, run_id in enumerate(run_ids):
            labels = {"pipeline/runid": run_id, "pipeline/persistedFinalState": "true"}
            await wfs.create(ns, finished_workflow(f"kfp-{i}", labels=labels))

        async def objects_gone() -> bool:
            names = {w["metadata"]["name"] for w in (await wfs.list(ns))["items"]}
            return names == {"kept"}

        async def rows_gone() -> bool:
            async with engine.connect() as conn:
                counts = [await kfp_counts(conn, r) for r in run_ids]
            return all(sum(c.values()) == 0 for c in counts)

        await wait_for(objects_gone, timeout=60, interval=0.5)
        await wait_for(rows_gone, timeout=60, interval=0.5)
        await engine.dispose()

        history = lapse_json("history", "-n", ns, config=config)
        outcomes = Counter((row["target"], row["outcome"]) for row in history)
        assert outcomes[("kubernetes", "deleted")] == 5
        assert outcomes[("database", "deleted")] == 2
        assert all(row["latencySeconds"] >= 0 for row in history if row["outcome"] == "deleted")
        # The database clock (6s) is its own: rows went after, not with, their objects.
        deleted_at = {
            (row["name"], row["target"]): row["deadline"]
            for row in history
            if row["outcome"] == "deleted"
        }
        assert deleted_at[("kfp-0", "database")] > deleted_at[("kfp-0", "kubernetes")]
        status = lapse_json("status", config=config)
        assert status["pending"]["kubernetes"]["count"] == 0
        assert status["deadLetters"] == 0
    finally:
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]


async def test_sigkill_mid_work_loses_nothing_and_deletes_nothing_twice(
    tmp_path: Path, own_nats: EmbeddedNats, kube: KubeStack, kfp_database: Database
) -> None:
    config = write_config(tmp_path / "lapse.yaml", own_nats.url, kube, kfp_database)
    ns = kube.namespace(f"kill-{uuid.uuid4().hex[:6]}")
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    await up.start()
    wfs = kube.workflows
    count = 40
    for i in range(count):
        ttl = 2 + (i % 8)  # deadlines spread over 2..9 s, so the kill lands mid-work
        await wfs.create(ns, finished_workflow(f"wf-{i}", annotations={"lapse.dev/ttl": f"{ttl}s"}))
    await asyncio.sleep(4)
    up.kill()
    survivors_at_kill = len((await wfs.list(ns))["items"])
    await asyncio.sleep(2)  # deadlines pass while lapse is down
    await up.start()
    try:

        async def all_gone() -> bool:
            return not (await wfs.list(ns))["items"]

        await wait_for(all_gone, timeout=90, interval=0.5)
        history = lapse_json("history", "-n", ns, "--target", "kubernetes", config=config)
        outcomes = Counter(row["name"] for row in history)
        deleted = Counter(row["name"] for row in history if row["outcome"] == "deleted")
        assert 0 < survivors_at_kill < count, "the kill must land in the middle of the work"
        assert set(outcomes) == {f"wf-{i}" for i in range(count)}
        assert set(outcomes.values()) == {1}, "one outcome per object: none deleted twice"
        assert all(row["latencySeconds"] >= 0 for row in history if row["outcome"] == "deleted")
        assert {row["outcome"] for row in history} <= {"deleted", "already_gone"}
        # `already_gone` only where the killed process's DELETE committed before it could
        # record it (the restarted process then finds the object gone): a few at most.
        assert count - len(deleted) <= count - survivors_at_kill
    finally:
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def audited_kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KubeStack, Path]]:
    """An API server of its own that logs every Workflow DELETE: when the deletion was made
    is counted where it happened, not taken from lapse's account of it."""
    with audited_kube_stack(tmp_path_factory.mktemp("kube-ingress")) as stack:
        yield stack


def reference_event(workflow: dict[str, Any], action: str = "update") -> tuple[dict[str, str], str]:
    """A Knative ApiServerSource event in Reference mode: an ObjectReference, no object."""
    meta = workflow["metadata"]
    ref = {
        "apiVersion": workflow["apiVersion"],
        "kind": workflow["kind"],
        "namespace": meta["namespace"],
        "name": meta["name"],
    }
    headers = {
        "ce-specversion": "1.0",
        "ce-id": str(uuid.uuid4()),
        "ce-source": "https://10.96.0.1:443",
        "ce-type": f"dev.knative.apiserver.ref.{action}",
        "ce-subject": f"/apis/argoproj.io/v1alpha1/namespaces/{meta['namespace']}/workflows/"
        + meta["name"],
        "content-type": "application/json",
    }
    return headers, json.dumps(ref)


def ingress_config(path: Path, nats_url: str, kube: KubeStack, token_file: Path | None) -> Path:
    token = f"ingress: {{token_file: '{token_file}'}}\n" if token_file else ""
    path.write_text(
        f"nats: {{url: '{nats_url}'}}\nkubernetes: {{kubeconfig: '{kube.kubeconfig}'}}\n{token}"
        # A real cluster deletes only in the namespaces it is given (else dry-run).
        "safety: {namespaces: {include: ['*']}}\n"
    )
    return path


async def test_a_reference_mode_event_on_the_ingress_deletes_the_run_at_its_deadline(
    tmp_path: Path, own_nats: EmbeddedNats, audited_kube: tuple[KubeStack, Path]
) -> None:
    """The ApiServerSource in Reference mode sends only where the object is. lapse up once
    answered 202 and never read it again; now the planner GETs the object and plans it."""
    kube, audit_log = audited_kube
    config = ingress_config(tmp_path / "lapse.yaml", own_nats.url, kube, None)
    ns = kube.namespace(f"ref-{uuid.uuid4().hex[:6]}")
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    up.args.append("--no-watch")  # the ingress is the only way lapse hears of the run
    await up.start()
    try:
        created = await kube.workflows.create(
            ns, finished_workflow("referenced", annotations={"lapse.dev/ttl": "5s"})
        )
        deadline = parse_timestamp(created["status"]["finishedAt"]) + 5
        headers, body = reference_event(created)
        async with httpx.AsyncClient(timeout=30) as http:
            answer = await http.post(
                f"http://127.0.0.1:{up.ingress_port}/", headers=headers, content=body
            )
        assert answer.status_code == 202, answer.text

        # Not before its deadline...
        while datetime.now(UTC).timestamp() < deadline - 0.5:
            assert await kube.workflows.get(ns, "referenced") is not None, "deleted early"
            await asyncio.sleep(0.2)

        async def gone() -> bool:
            return await kube.workflows.get(ns, "referenced") is None

        # ...and at it.
        await wait_for(gone, timeout=30, interval=0.2)
        [delete] = successful(deletes(audit_log, ns)["referenced"])
        assert delete.at >= deadline, f"DELETE {deadline - delete.at:.2f}s before the deadline"
        assert delete.at - deadline < 10, f"DELETE {delete.at - deadline:.1f}s late"
        history = lapse_json("history", "-n", ns, config=config)
        assert [(row["name"], row["outcome"]) for row in history] == [("referenced", "deleted")]
    finally:
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]


async def test_up_with_a_token_refuses_senders_without_it_and_never_shows_it(
    tmp_path: Path, own_nats: EmbeddedNats, audited_kube: tuple[KubeStack, Path]
) -> None:
    kube, _ = audited_kube
    token = f"t-{uuid.uuid4().hex}"
    token_file = tmp_path / "ingress-token"
    token_file.write_text(token + "\n")
    config = ingress_config(tmp_path / "lapse.yaml", own_nats.url, kube, token_file)
    ns = kube.namespace(f"tok-{uuid.uuid4().hex[:6]}")
    up = LapseUp(config, tmp_path / "state", tmp_path / "up.log")
    up.args.append("--no-watch")
    await up.start()
    try:
        created = await kube.workflows.create(
            ns, finished_workflow("guarded", annotations={"lapse.dev/ttl": "1h"})
        )
        headers, body = reference_event(created)
        url = f"http://127.0.0.1:{up.ingress_port}/"
        async with httpx.AsyncClient(timeout=30) as http:
            anonymous = await http.post(url, headers=headers, content=body)
            guessed = await http.post(
                url, headers={**headers, "authorization": "Bearer guess"}, content=body
            )
            allowed = await http.post(
                url, headers={**headers, "authorization": f"Bearer {token}"}, content=body
            )
        assert anonymous.status_code == guessed.status_code == 401
        assert anonymous.headers["www-authenticate"].startswith("Bearer")
        assert allowed.status_code == 202, allowed.text

        async def planned() -> bool:
            status = lapse_json("status", config=config)
            return bool(status["pending"]["kubernetes"]["count"] == 1)

        await wait_for(planned, timeout=30, interval=0.5)  # the authenticated one only
        refusals = lapse_json("dlq", "list", "--stage", "ingress", config=config)
        assert sorted(row["reason"].split(" (")[0] for row in refusals) == [
            "401: no bearer token",
            "401: wrong bearer token",
        ]
    finally:
        assert up.stop() == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert token not in (tmp_path / "up.log").read_text()
    assert token not in json.dumps(refusals)


# --- two `lapse up` sharing one NATS (kubernetes.watch_lease) --------------------------------
# Each kind is watched by exactly one of them, runs are deleted once and on time, and when
# the holder of a kind is killed with -9 the other takes its watch over and loses nothing.
# DELETEs are counted by the API server's own audit log: two processes deleting the same
# run would show there even where lapse's audit stream drops the second outcome.

# Short, so the take-over after a kill -9 comes within seconds.
LEASE_TTL = 3
LEASED_KIND = "argo-workflow"


def lease_config(path: Path, nats_url: str, kube: KubeStack) -> Path:
    path.write_text(
        f"nats: {{url: '{nats_url}'}}\n"
        f"kubernetes: {{kubeconfig: '{kube.kubeconfig}', watch_lease: {{ttl: {LEASE_TTL}s}}}}\n"
        "safety: {max_deletions_per_second: 200, namespaces: {include: ['*']}}\n"
    )
    return path


def lease_holders(config: Path) -> dict[str, str]:
    """kind -> the process watching it, as `lapse status` shows."""
    watches = lapse_json("status", "--recent", "0", config=config)["watches"]
    found: dict[str, str] = {}
    for watch in watches:
        assert watch["kind"] not in found, f"{watch['kind']} is held twice: {watches}"
        found[watch["kind"]] = watch["process"]
    return found


def pid_of(process: str) -> int:
    return int(process.rpartition("-")[2])


async def create_due_runs(kube: KubeStack, ns: str, prefix: str, count: int) -> dict[str, float]:
    """`count` finished Workflows due 2..6 s from now: name -> deadline (epoch seconds)."""
    due = {}
    for i in range(count):
        ttl = 2 + i % 5
        created: dict[str, Any] = await kube.workflows.create(
            ns, finished_workflow(f"{prefix}-{i}", annotations={"lapse.dev/ttl": f"{ttl}s"})
        )
        due[created["metadata"]["name"]] = parse_timestamp(created["status"]["finishedAt"]) + ttl
    return due


async def test_two_processes_split_the_kinds_and_take_over_from_a_killed_one(
    tmp_path: Path, own_nats: EmbeddedNats, audited_kube: tuple[KubeStack, Path]
) -> None:
    """The audited API server is shared with the ingress tests: only this namespace's
    DELETEs are counted, and the leases live in this test's own NATS."""
    kube, audit_log = audited_kube
    config = lease_config(tmp_path / "lapse.yaml", own_nats.url, kube)
    ns = kube.namespace(f"lease-{uuid.uuid4().hex[:6]}")
    ups = [LapseUp(config, tmp_path / f"state-{i}", tmp_path / f"up-{i}.log") for i in (0, 1)]
    await asyncio.gather(*(up.start() for up in ups))
    try:
        kinds: set[str] = set()

        async def every_kind_held_by_one() -> bool:
            nonlocal kinds
            held = lease_holders(config)
            kinds = set(held)
            # Both processes hold kinds: they spread them, the first did not take all.
            return len(held) == 5 and {pid_of(p) for p in held.values()} == {
                up.process.pid for up in ups if up.process is not None
            }

        await wait_for(every_kind_held_by_one, timeout=30, interval=0.5)
        assert LEASED_KIND in kinds

        # Phase 1: both running. Each run deleted once, at or after its deadline.
        due = await create_due_runs(kube, ns, "steady", 20)

        async def all_gone() -> bool:
            return not (await kube.workflows.list(ns))["items"]

        await wait_for(all_gone, timeout=60, interval=0.5)

        # Phase 2: the holder of the Workflows' watch killed with -9; runs finish during
        # the take-over and after it.
        holder = next(
            up
            for up in ups
            if up.process and up.process.pid == pid_of(lease_holders(config)[LEASED_KIND])
        )
        survivor = next(up for up in ups if up is not holder)
        holder.kill()
        due |= await create_due_runs(kube, ns, "during", 10)

        async def taken_over() -> bool:
            held = lease_holders(config)
            assert survivor.process is not None
            return len(held) == 5 and all(pid_of(p) == survivor.process.pid for p in held.values())

        # The lease expires LEASE_TTL after the last renewal; taken within a round after.
        await wait_for(taken_over, timeout=3 * LEASE_TTL, interval=0.25)
        due |= await create_due_runs(kube, ns, "after", 10)
        await wait_for(all_gone, timeout=60, interval=0.5)

        made = deletes(audit_log, ns)
        done = {name: successful(requests) for name, requests in made.items()}
        assert set(done) == set(due), f"lost: {sorted(set(due) - set(done))}"
        twice = {name: len(requests) for name, requests in made.items() if len(requests) > 1}
        assert not twice, f"DELETEs made more than once: {twice}"
        early = {name: due[name] - d[0].at for name, d in done.items() if d[0].at < due[name]}
        assert not early, f"deleted before the deadline (s): {early}"
        late = {name: d[0].at - due[name] for name, d in done.items()}
        steady = max(late[name] for name in late if name.startswith(("steady", "after")))
        assert steady < 3.0, late
        # Runs due while nobody watched them wait at most for the take-over.
        assert max(late.values()) < 3 * LEASE_TTL, late
    finally:
        for up in ups:
            if up.process is not None and up.process.poll() is None:
                assert up.stop() == 0, up.log.read_text()[-3000:]
