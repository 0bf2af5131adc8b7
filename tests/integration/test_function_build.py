"""A function folder builds and serves the way `func`'s host builder does it.

The host builder runs `pip install .` of the function's folder into `lib/` (nothing from
outside the folder is visible) and starts a main that calls
`func_python.cloudevent.serve(new)`. This test does the same in a clean virtual
environment, then POSTs a CloudEvent and checks the reply.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import httpx
from cloudevents.core.bindings.http import to_binary_event
from nats.js import JetStreamContext

from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import free_port
from lapse.events.builder import build_event
from lapse.events.models import RunFinished
from lapse.events.run import Engine, RunRef
from lapse.events.types import EventType
from tests.conftest import KubeStack
from tests.stack import wait_for
from tests.unit.test_object_reaper_verdict import argo_workflow

ROOT = Path(__file__).resolve().parents[2]

# What func's host builder generates as service/main.py, in substance.
HOST_MAIN = """
import sys
sys.path.insert(0, "lib")
from func_python.cloudevent import serve
from function import new
serve(new)
"""


def build_like_func(tmp_path: Path) -> tuple[Path, Path]:
    """Package the ttl-planner folder and install it into lib/ from a clean venv."""
    folder = tmp_path / "ttl-planner"
    ignore = shutil.ignore_patterns("vendor", "lib", "pyproject.toml", "__pycache__")
    shutil.copytree(ROOT / "functions" / "ttl_planner", folder, ignore=ignore)
    package = [sys.executable, str(ROOT / "scripts" / "package-functions.py"), str(folder)]
    subprocess.run(package, check=True, capture_output=True, timeout=120)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--target", "lib", "."],
        cwd=folder, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    (folder / "service").mkdir()
    (folder / "service" / "main.py").write_text(HOST_MAIN)
    return folder, venv


async def test_ttl_planner_folder_builds_in_a_clean_environment_and_serves(
    tmp_path: Path, nats_server: EmbeddedNats, lapse_streams: JetStreamContext, kube: KubeStack
) -> None:
    folder, venv = await asyncio.to_thread(build_like_func, tmp_path)
    # An event over HTTP is a claim the planner checks against the API server.
    ns = kube.namespace("function-build")
    finished = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
    wf = await kube.workflows.create(ns, argo_workflow("built", namespace=ns, finished_at=finished))
    port = free_port()
    env = {
        "PATH": os.environ["PATH"],
        "LISTEN_ADDRESS": f"127.0.0.1:{port}",
        "LAPSE_NATS__URL": nats_server.url,
        "LAPSE_KUBERNETES__KUBECONFIG": str(kube.kubeconfig),
    }
    with (tmp_path / "function.log").open("wb") as log:
        # Popen returns at once; the waits below are bounded polls.
        server = subprocess.Popen(  # noqa: ASYNC220
            [str(venv / "bin" / "python"), "service/main.py"],
            cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:

            async def ready() -> bool:
                try:
                    return (await http.get("/health/readiness")).status_code == 200
                except httpx.TransportError:
                    return False

            await wait_for(ready, timeout=60, interval=0.3)
            run = RunRef(
                engine=Engine.ARGO, api_version="argoproj.io/v1alpha1", kind="Workflow",
                namespace=ns, name="built", uid=wf["metadata"]["uid"], phase="Succeeded",
                finished_at=finished,
            )  # fmt: skip
            message = to_binary_event(
                build_event(EventType.RUN_FINISHED, source="/test", data=RunFinished(run=run))
            )
            response = await http.post("/", headers=message.headers, content=message.body)
            assert response.status_code == 202, (tmp_path / "function.log").read_text()[-2000:]
            assert (await http.post("/", content=b"{}")).status_code == 400
    finally:
        server.terminate()
        server.wait(timeout=30)
    # The function ran from lib/, not from this checkout.
    assert (folder / "lib" / "lapse" / "runtime" / "knative.py").exists()
