"""`lapse up`: run the whole pipeline, with embedded servers for whatever is not configured.

The flags are here; the servers and the pipeline are in lapse/cli/up_run.py, imported when
the command runs."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "up",
        help="run the whole pipeline (the main job)",
        description=(
            "Run the watcher, every function and the dispatcher against the configured NATS, "
            "database and cluster. What is not configured is started locally and kept in "
            "--state-dir: an embedded nats-server (no nats.url; it admits only lapse's own "
            "users, whose passwords are generated there, 0600), a SQLite file (no "
            "database.url), and a local kube-apiserver with the CRDs of the built-in kinds "
            "(no cluster chosen: --kubeconfig/--context, kubernetes.kubeconfig or "
            "in_cluster, or a pod's ServiceAccount; an ambient $KUBECONFIG or "
            "~/.kube/config is never used by lapse up), and beside that local cluster, when no "
            "artifacts.stores are configured, an S3 server (SeaweedFS, once `make seaweedfs` "
            "built it) whose bucket lapse-artifacts is the artifacts target's store (its "
            "keys generated there, 0600). Their addresses are written there "
            "too (nats.url, database.url, kubeconfig.path), and the other commands use them "
            "when nothing is configured. On a real cluster lapse deletes only in the "
            "namespaces safety.namespaces.include names (['*'] for all); with none named it "
            "runs in dry-run. The first line says which cluster, namespaces and kinds. "
            "Stop with Ctrl-C: in-flight work finishes first."
        ),
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:8080",
        metavar="HOST:PORT",
        help="where the HTTP ingress accepts pushed CloudEvents (default: %(default)s; "
        "'' turns it off); beyond loopback it needs ingress.token_file, a bearer token "
        "every request must carry",
    )
    parser.add_argument(
        "--no-watch",
        dest="watch",
        action="store_false",
        help="do not list and watch the cluster: run events come only through the ingress "
        "(Knative ApiServerSource, Tekton's CloudEvents, run.finished from your tools)",
    )
    parser.add_argument(
        "--metrics-host",
        metavar="HOST",
        help="where LAPSE_PROMETHEUS_PORT serves /metrics (default: $LAPSE_PROMETHEUS_HOST, "
        "else the host of --listen: no further than the HTTP endpoint; 127.0.0.1 with "
        "--listen '')",
    )
    parser.set_defaults(run=run_up)


def run_up(args: argparse.Namespace) -> int:
    from lapse.cli.up_run import run_up as up

    return up(args)
