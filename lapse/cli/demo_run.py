"""`lapse demo`'s work: the embedded servers, the sample runs, the live view and the
summary (lapse/cli/demo.py defines the flags)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

import yaml
from rich.console import Console

from lapse.cli.common import UsageError
from lapse.cli.up_run import start_embedded_kube
from lapse.config import load_config
from lapse.demo.artifacts import S3Access
from lapse.demo.progress import DemoSummary
from lapse.demo.scenario import ARTIFACT_BUCKET, footprint_sample, make_samples, write_config
from lapse.demo.tour import NO_S3_NOTE, tour
from lapse.demo.view import Output, print_summary
from lapse.embedded.nats import EmbeddedNats
from lapse.embedded.process import ServerStartError
from lapse.embedded.seaweedfs import REGION, EmbeddedSeaweedFS, weed_binary

log = logging.getLogger(__name__)

# --- the command ---------------------------------------------------------------------------


# The demo runs only on servers it starts: a flag pointing elsewhere would be ignored, and
# a user who passed --kubeconfig might believe the tour ran (and deleted) there.
FOREIGN_FLAGS: Final = (
    ("kubeconfig", "--kubeconfig"),
    ("context", "--context"),
    ("nats_url", "--nats-url"),
)


def run_demo(args: argparse.Namespace) -> int:
    given = [flag for dest, flag in FOREIGN_FLAGS if getattr(args, dest, None) is not None]
    if given:
        raise UsageError(
            f"lapse demo runs only on the embedded servers it starts; {', '.join(given)} "
            "would be ignored (use lapse up, or lapse plan, against your servers)"
        )
    quiet_logs(bool(getattr(args, "debug", False)))
    out = make_output(args)
    begun = time.monotonic()
    state_dir = Path(tempfile.mkdtemp(prefix="lapse-demo-"))
    verdict: list[DemoSummary] = []

    def report(summary: DemoSummary) -> None:
        verdict.append(summary)
        print_report(summary, args.output, out.console)
        out.note("stopping the pipeline and the servers ...")

    try:
        out.note(f"starting nats-server, kube-apiserver, SeaweedFS and SQLite in {state_dir} ...")
        with embedded_stack(state_dir) as (nats, config_path, s3):
            if s3 is None:
                out.note(f"kfp-footprint: {NO_S3_NOTE}")
            config = load_config(config_path, env={})  # the tour's own, whatever the shell says
            samples = [*make_samples(args.count), footprint_sample(with_artifacts=s3 is not None)]
            asyncio.run(tour(config, nats.url, samples, out, begun, report, s3))
    finally:
        if args.keep:
            out.note(f"kept {state_dir} (lapse.yaml, kfp.db, server logs)")
        else:
            shutil.rmtree(state_dir, ignore_errors=True)
    return 0 if verdict and verdict[0].ok else 1


def quiet_logs(debug: bool) -> None:
    # The pipeline logs its routine steps at INFO; in the tour the table tells that story.
    if not debug:
        logging.getLogger().setLevel(logging.WARNING)


def print_report(summary: DemoSummary, output: str, console: Console) -> None:
    if output == "table":
        print_summary(console, summary)
        return
    if output == "yaml":
        yaml.safe_dump(summary.as_json(), sys.stdout, sort_keys=False)
    else:
        json.dump(summary.as_json(), sys.stdout, indent=2)
        print(flush=True)
    for problem in summary.problems:
        # Named on stderr too, for scripts that show only stderr when a step fails.
        print(f"lapse demo: {problem}", file=sys.stderr)


@contextlib.contextmanager
def embedded_stack(
    state_dir: Path,
) -> Iterator[tuple[EmbeddedNats, Path, S3Access | None]]:
    """The servers the tour needs and lapse's config for them; the servers are stopped on
    the way out whatever happens. No S3 server when SeaweedFS is not built: the tour runs
    without the footprint run's artifacts and says so."""
    with contextlib.ExitStack() as servers:
        s3_server = _seaweedfs(state_dir)
        if s3_server is not None:
            servers.callback(s3_server.stop)
        # SeaweedFS comes up while the API server does (both take seconds). Entered after
        # its stop, so a start still under way is waited for before the stop (last in,
        # first out), and no server is left running.
        pool = servers.enter_context(ThreadPoolExecutor(max_workers=1))
        s3_started = pool.submit(s3_server.start) if s3_server is not None else None
        # Always a free port: a `lapse up` on the default port must not be disturbed.
        nats = EmbeddedNats(state_dir / "nats").start()
        servers.callback(nats.stop)
        kube = start_embedded_kube(state_dir)
        servers.callback(kube.stop)
        s3 = None
        if s3_server is not None and s3_started is not None:
            s3_started.result()
            s3 = S3Access(s3_server.endpoint, REGION, s3_server.access_key, s3_server.secret_key)
            # lapse's S3 client finds the keys where S3 users keep them, never in lapse.yaml.
            servers.enter_context(_environment(s3_server.env()))
        config_path = write_config(
            state_dir / "lapse.yaml",
            nats_url=nats.url,
            kubeconfig=kube.kubeconfig_path,
            database_url=f"sqlite:///{state_dir / 'kfp.db'}",
            s3_endpoint=s3.endpoint if s3 else None,
            s3_region=REGION,
        )
        yield nats, config_path, s3


def _seaweedfs(state_dir: Path) -> EmbeddedSeaweedFS | None:
    try:
        weed_binary()
    except ServerStartError:
        return None
    return EmbeddedSeaweedFS(state_dir / "seaweedfs", buckets=(ARTIFACT_BUCKET,))


# A session token or profile of another S3 account would be mixed into the demo's requests.
_FOREIGN_AWS: Final = ("AWS_SESSION_TOKEN", "AWS_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE")


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in this process's environment (and no other S3 account's) while the body
    runs; the shell's own afterwards."""
    names = (*values, *_FOREIGN_AWS)
    saved = {name: os.environ.get(name) for name in names}
    for name in _FOREIGN_AWS:
        os.environ.pop(name, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def make_output(args: argparse.Namespace) -> Output:
    as_json = args.output != "table"
    console = Console(stderr=as_json, highlight=False)
    if not console.is_terminal:
        # Logs and CI captures: keep each progress line whole.
        console = Console(stderr=as_json, highlight=False, width=160, soft_wrap=True)
    live = not (args.no_live or as_json) and console.is_terminal
    return Output(console, live)
