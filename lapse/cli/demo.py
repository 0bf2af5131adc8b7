"""`lapse demo`: a self-contained tour of lapse on embedded servers.

It starts a nats-server, a local kube-apiserver with the Argo Workflow CRD, an S3 server
(SeaweedFS, when `make seaweedfs` built it) and a SQLite file with KFP's run tables and ML
Metadata's, all in a temporary directory; runs the whole pipeline in this process; creates
finished sample workflows (and KFP rows) with short, varied TTLs, and one KFP run with its
whole footprint (object, KFP rows, ML Metadata rows, artifacts in S3) on three clocks;
shows them being deleted as their deadlines come; and checks the end state against the API
server, the database and the S3 server. Exit code 0 when everything expected happened, 1
otherwise.
"""

from __future__ import annotations

import argparse
from typing import Final

DEFAULT_COUNT: Final = 30
# Beyond this, creating the runs takes longer than the shortest TTLs.
MAX_COUNT: Final = 200


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="a self-contained tour: watch lapse delete sample runs on time",
        description=(
            "Start an embedded nats-server, a local kube-apiserver with the Argo, Tekton and "
            "TrainJob CRDs, an S3 server (SeaweedFS, once `make seaweedfs` built it) and a "
            "SQLite file with KFP's run tables and ML Metadata's (in a temporary "
            "directory), run the whole pipeline, create finished sample runs with short and "
            "varied TTLs (lapse.dev/ttl, Argo ttlStrategy on Succeeded and Failed runs, "
            "lapse.dev/keep, KFP runs whose rows live on a separate, longer clock, a Tekton "
            "PipelineRun, a Job with ttlSecondsAfterFinished) and one more KFP run, "
            "kfp-footprint, whose object, KFP rows and ML Metadata rows, and artifacts in "
            "S3 go on three clocks, and show them being deleted. Ends with a summary; exits "
            "1, naming what went wrong, if anything expected did not happen. Ignores "
            "--config (the tour writes its own) and refuses --kubeconfig, "
            "--context and --nats-url: it runs only on the servers it starts."
        ),
    )
    parser.add_argument(
        "--count",
        type=_count,
        default=DEFAULT_COUNT,
        help=f"sample runs to create (default: %(default)s, at most {MAX_COUNT})",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the temporary directory (lapse.yaml, kfp.db, server logs) and print it",
    )
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="print one line per step instead of a live table (automatic without a terminal)",
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=("table", "json", "yaml"),
        default="table",
        help="summary format; with json or yaml, progress goes to stderr",
    )
    parser.set_defaults(run=run_demo)


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_COUNT}")
    return value


def run_demo(args: argparse.Namespace) -> int:
    # The servers, the pipeline and the view are imported only when the tour runs.
    from lapse.cli.demo_run import run_demo as tour

    return tour(args)
