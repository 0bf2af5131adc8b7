"""`lapse plan`: a read-only preview of what lapse would delete, when, and by which rule.

The flags are here; the work, which needs the Kubernetes client, the planner and the
database edges, is in lapse.cli.plan_run.py, imported when the command runs."""

from __future__ import annotations

import argparse

from lapse.cli.common import add_kind, add_namespace, add_namespace_glob, add_selector
from lapse.cli.fleet_ask import add_cluster
from lapse.cli.names import TARGETS
from lapse.cli.output import add_output


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="preview deadlines of finished runs and orphaned rows (read-only)",
        description=(
            "List the finished runs in the cluster (every configured kind: Argo Workflows, "
            "Tekton PipelineRuns and TaskRuns, Jobs, TrainJobs) and, for each target (the "
            "Kubernetes object and the database rows), the deadline lapse would set and the "
            "rule that set it. With database.targets.kfp enabled, also the KFP run rows whose "
            "Workflow is gone and whose database deadline has passed (what `lapse reconcile` "
            "would schedule; not with -l, which only objects carry). With artifacts.stores "
            "configured, the artifacts target too: its deadline and what it will delete (the "
            "run's captured artifacts and prefixes; their objects and bytes with "
            "--list-artifacts). With database.url and database.targets configured, the rows "
            "each run's database target will delete, per table (ROWS), counted by the "
            "row-reaper's dry run: one transaction per page of runs, rolled back (--no-rows "
            "skips it). Reads only; changes nothing."
        ),
    )
    add_namespace(parser)
    add_namespace_glob(parser)
    add_selector(parser)
    add_kind(parser)
    parser.add_argument(
        "--target",
        choices=TARGETS,
        help="only this target's deadlines (default: every target)",
    )
    parser.add_argument(
        "-f",
        "--filename",
        metavar="FILE",
        help=(
            "plan as if the LapsePolicy / ClusterLapsePolicy objects in this YAML file were "
            "applied (added, or replacing the one of the same name): a preview before "
            "`kubectl apply`; their verdict (accepted, clamped, refused) is printed on stderr"
        ),
    )
    parser.add_argument(
        "--policy",
        nargs="?",
        const="",
        metavar="NAME",
        help=(
            "only the runs whose deadline a policy object sets: NAME is "
            "<namespace>/<name> (a LapsePolicy) or <name> (a ClusterLapsePolicy); "
            "without NAME, the ones in -f"
        ),
    )
    parser.add_argument(
        "--list-artifacts",
        action="store_true",
        help=(
            "count the objects and bytes of each run's artifacts: LISTs the object stores "
            "under every captured artifact (without it, the bytes are unknown: neither the "
            "run nor the capture records sizes)"
        ),
    )
    parser.add_argument(
        "--no-rows",
        action="store_true",
        help=(
            "do not count the rows each run's database target will delete (with database.url "
            "and database.targets configured, plan counts them with the row-reaper's dry run: "
            "one transaction per page of runs, rolled back, ML Metadata's rows locked "
            "meanwhile; skip it for huge previews)"
        ),
    )
    add_cluster(parser, fleet=True)
    add_output(parser)
    parser.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from lapse.cli.plan_run import run_plan as plan

    return plan(args)
