"""`lapse up`'s own NATS admits only lapse's identities (issue 23), and no command prints a
secret, on real servers: the embedded nats-server, a kube-apiserver, the CLI as users run it.

The attack this closes: a `cleanup.due` published straight to NATS, carrying the
`Lapse-Observed` header and a forged finished state, deleted a Running Workflow.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from lapse.config import NatsConfig
from lapse.edges.nats import NatsRefused, connect, security_options
from lapse.edges.schedules import schedule_headers
from lapse.edges.watch_positions import WatchPositions
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.nats_identities import ADMIN, PROCESS, READER, Identity, password_file
from lapse.events.builder import build_event
from lapse.events.models import CleanupDue
from lapse.events.nats_binding import to_nats
from lapse.events.observed import OBSERVED_HEADER
from lapse.events.run import Engine, RunRef, Target
from lapse.events.subjects import due_subject, schedule_subject
from lapse.events.types import EventType
from tests.conftest import KubeStack, kube_stack
from tests.stack import wait_for

pytestmark = [pytest.mark.kube, pytest.mark.nats]

LAPSE = [sys.executable, "-m", "lapse.cli"]


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    # Its own API server: `lapse up` watches every namespace.
    with kube_stack(tmp_path_factory.mktemp("kube-auth")) as stack:
        yield stack


def workflow(name: str, phase: str, **annotations: str) -> dict[str, Any]:
    now = datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    status: dict[str, Any] = {"phase": phase, "startedAt": now}
    labels = {}
    if phase != "Running":
        status["finishedAt"] = now
        labels["workflows.argoproj.io/completed"] = "true"
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {"entrypoint": "main"},
        "status": status,
    }


def forged_due(obj: dict[str, Any]) -> tuple[str, dict[str, str], bytes]:
    """A due event for `obj` claiming it Succeeded, with lapse's trust mark."""
    meta = obj["metadata"]
    past = datetime.now(UTC) - timedelta(hours=1)
    run = RunRef(
        engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
        namespace=meta["namespace"], name=meta["name"], uid=meta["uid"], phase="Succeeded",
        finished_at=past, resource_version=meta["resourceVersion"],
    )  # fmt: skip
    due = CleanupDue(
        run=run, target=Target.KUBERNETES, deadline=past, policy="annotation",
        scheduled_at=past,
    )  # fmt: skip
    message = to_nats(build_event(EventType.CLEANUP_DUE, source="/forged", data=due))
    headers = {**message.headers, OBSERVED_HEADER: "apiserver"}
    return due_subject(Target.KUBERNETES, meta["uid"]), headers, message.body


class LapseUp:
    def __init__(self, tmp: Path, env: dict[str, str], *args: str) -> None:
        self.log = tmp / "up.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [*LAPSE, *args, "up", "--listen", ""],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip

    async def running(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"lapse up exited:\n{self.log.read_text()[-3000:]}")
        return "lapse is running" in self.log.read_text()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        return self.process.wait(timeout=60)


def clean_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LAPSE_", "OTEL_"))}
    env.pop("KUBECONFIG", None)
    return {**env, "HOME": str(tmp), "XDG_STATE_HOME": str(tmp / "state")}


async def open_as(url: str, state_dir: Path, identity: Identity) -> tuple[NATS, list[str]]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    config = NatsConfig(
        url=url, user=identity.user, password_file=password_file(state_dir, identity)
    )
    nc = NATS()
    await nc.connect(url, error_cb=on_error, max_reconnect_attempts=0, **security_options(config))
    return nc, errors


async def refused_publish(nc: NATS, errors: list[str], subject: str, **kw: Any) -> None:
    await nc.publish(subject, **kw)
    said = f'violation for publish to "{subject.lower()}"'

    async def told() -> bool:
        return any(said in e for e in errors)

    await wait_for(told, timeout=5)


async def test_a_forged_due_event_is_refused_and_the_running_workflow_survives(
    tmp_path: Path, kube: KubeStack
) -> None:
    env = {
        **clean_env(tmp_path),
        "LAPSE_KUBERNETES__KUBECONFIG": str(kube.kubeconfig),
        "LAPSE_SAFETY__NAMESPACES__INCLUDE": "",
    }
    ns = kube.namespace(f"auth-{uuid.uuid4().hex[:6]}")
    env["LAPSE_SAFETY__NAMESPACES__INCLUDE"] = ns
    state_dir = tmp_path / "state" / "lapse"
    up = LapseUp(tmp_path, env)
    try:
        await wait_for(up.running, timeout=90, interval=0.3)
        url = (state_dir / "nats.url").read_text().strip()
        running = await kube.workflows.create(ns, workflow("running", "Running"))
        subject, headers, body = forged_due(running)
        sched = schedule_subject(Target.KUBERNETES, running["metadata"]["uid"])

        # Without credentials: not even connected.
        with pytest.raises(NatsRefused, match="requires authentication"):
            await connect(url, config=NatsConfig(url=url))
        # The read-only identity (its password is on disk for `lapse status`) and the
        # process identity itself: neither may put a due event, nor a schedule that fires
        # one at once.
        for identity in (READER, PROCESS):
            nc, errors = await open_as(url, state_dir, identity)
            try:
                await refused_publish(nc, errors, subject, payload=body, headers=headers)
                if identity is READER:
                    at_once = {**headers, **schedule_headers(datetime.now(UTC), subject)}
                    await refused_publish(nc, errors, sched, payload=body, headers=at_once)
            finally:
                await nc.close()

        # The proof the pipeline is live and deleting meanwhile: a finished Workflow due in
        # a second goes. Only then is the Running one checked.
        await kube.workflows.create(ns, workflow("done", "Succeeded", **{"lapse.dev/ttl": "1s"}))

        async def done_gone() -> bool:
            names = {w["metadata"]["name"] for w in (await kube.workflows.list(ns))["items"]}
            return "done" not in names

        await wait_for(done_gone, timeout=60, interval=0.3)
        nc, errors = await open_as(url, state_dir, ADMIN)
        try:
            js = nc.jetstream()
            with pytest.raises(NotFoundError):
                await js.get_last_msg(
                    "LAPSE_SCHED", f"lapse.*.kubernetes.{running['metadata']['uid']}"
                )
            # The watcher (as the process identity) stored where its watch resumes.
            assert await WatchPositions(js).get("argo-workflow", kube.workflows.objects.cluster)
        finally:
            await nc.close()
        still = await kube.workflows.get(ns, "running")
        assert still is not None and still["metadata"]["uid"] == running["metadata"]["uid"]

        # Every command finds its identity in the state directory and is allowed what it
        # does: the read-only ones read, the repairs repair.
        kubeconfig = ["--kubeconfig", str(kube.kubeconfig)]
        for args in (
            ["status", "-o", "json"],
            ["history", "-o", "json"],
            ["plan", *kubeconfig, "-o", "json"],
            ["dlq", "list", "-o", "json"],
            ["brake", "status"],
            ["brake", "release"],
            ["dlq", "replay", "--all"],
            ["reconcile", *kubeconfig, "--dry-run"],
            ["infra", "apply"],
        ):
            result = await asyncio.to_thread(
                subprocess.run,
                [*LAPSE, *args], capture_output=True, text=True, env=env, timeout=120,
            )  # fmt: skip
            assert result.returncode == 0, (args, result.stderr)
        # The server refused nothing else than the forgeries above.
        log = (state_dir / "nats" / "nats-server.log").read_text()
        violations = re.findall(r'"\$G/user:([\w-]+)" - (\w+) Violation - Subject "([^"]+)"', log)
        assert sorted(violations) == sorted(
            [
                (READER.user, "Publish", subject),
                (READER.user, "Publish", sched),
                (PROCESS.user, "Publish", subject),
            ]
        ), violations
    finally:
        assert up.stop() == 0, up.log.read_text()[-3000:]
    assert "NATS without authentication" not in up.log.read_text()


SECRETS = ("url-s3cret-4f1a", "file-s3cret-9c2e", "env-s3cret-7b3d", "db-s3cret-2e8f")


@pytest.fixture
def protected_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    # One user with every right; its password is planted three ways below.
    users = [{"user": "lapse", "password": s} for s in SECRETS[:1]]
    users += [{"user": "lapse-file", "password": SECRETS[1]}]
    users += [{"user": "lapse-env", "password": SECRETS[2]}]
    server = EmbeddedNats(tmp_path / "nats", settings={"authorization": {"users": users}})
    server.start()
    yield server
    server.stop()


def test_no_command_prints_a_secret(
    tmp_path: Path, kube: KubeStack, protected_nats: EmbeddedNats
) -> None:
    port = protected_nats.port
    secret_file = tmp_path / "nats.password"
    secret_file.write_text(SECRETS[1] + "\n")
    db = f"postgresql://kfp:{SECRETS[3]}@127.0.0.1:5432/mlpipeline"
    ways = {
        "url": {"url": f"nats://lapse:{SECRETS[0]}@127.0.0.1:{port}"},
        "file": {
            "url": protected_nats.url,
            "user": "lapse-file",
            "password_file": str(secret_file),
        },
        "env": {"url": protected_nats.url, "user": "lapse-env"},
    }
    outputs: list[str] = []
    for way, nats in ways.items():
        config = tmp_path / f"{way}.yaml"
        config.write_text(
            json.dumps(
                {
                    "nats": nats,
                    "database": {"url": db},
                    "kubernetes": {"kubeconfig": str(kube.kubeconfig)},
                    "safety": {"dry_run": True, "namespaces": {"include": ["no-such-ns"]}},
                }
            )
        )
        env = {**clean_env(tmp_path / way), "LAPSE_CONFIG": str(config)}
        if way == "env":
            env["LAPSE_NATS__PASSWORD"] = SECRETS[2]
        (tmp_path / way).mkdir()
        for args in (
            ["infra", "apply"],
            ["status"],
            ["status", "-o", "json"],
            ["--debug", "status", "-o", "yaml"],
            ["history"],
            ["plan"],
            ["dlq", "list"],
            ["brake", "status"],
            # An error naming the server: no answer on a closed port, with a traceback.
            ["--debug", "status", "--nats-url", f"nats://lapse:{SECRETS[0]}@127.0.0.1:1"],
        ):
            result = subprocess.run(
                [*LAPSE, *args], capture_output=True, text=True, env=env, timeout=120
            )
            # (The command line itself is not kept: it names the planted secret.)
            outputs += [result.stdout, result.stderr]
            if "127.0.0.1:1" not in args[-1]:
                assert result.returncode == 0, (way, args, result.stderr)
        up = LapseUp(tmp_path / way, env, "--debug")
        try:
            asyncio.run(wait_for(up.running, timeout=90, interval=0.3))
        finally:
            assert up.stop() == 0, up.log.read_text()[-3000:]
        outputs.append(up.log.read_text())
    text = "\n".join(outputs)
    assert "nats://lapse:***@127.0.0.1" in text  # the URL is shown, masked
    assert "postgresql://kfp:***@127.0.0.1:5432/mlpipeline" in text
    for secret in SECRETS:
        assert secret not in text, f"{secret} printed:\n{text[text.find(secret) - 500 :][:1000]}"
