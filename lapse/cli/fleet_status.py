"""`lapse status --fleet`: what the hub knows of each cluster (docs/fleet.md) — when it
last heard from the cluster's domain, how far behind its copy is, and how many of the
cluster's audit events it holds."""

from __future__ import annotations

from typing import IO, TYPE_CHECKING, Any

from lapse.cli.output import Column, document, table, templated

if TYPE_CHECKING:
    import argparse

    from lapse.runtime.resources import Resources

COLUMNS = [
    Column("CLUSTER", lambda r: r["cluster"]),
    Column("LAST HEARD (S)", lambda r: r["lastHeardSeconds"]),
    Column("LAG", lambda r: r["lag"]),
    Column("AUDIT EVENTS", lambda r: r["auditEvents"]),
    Column("ERROR", lambda r: r["error"]),
]


def _cluster(source: dict[str, Any]) -> str | None:
    api = str((source.get("external") or {}).get("api") or "")
    parts = api.split(".")  # $JS.<cluster>.API
    return parts[1] if len(parts) == 3 and parts[0] == "$JS" and parts[2] == "API" else None


async def fleet_report(resources: Resources) -> dict[str, Any]:
    """Each cluster the hub's audit stream sources: the hub's own account of the source
    (seconds since it last heard from the cluster, messages it is behind, its error)."""
    from lapse.edges.fleet_streams import FLEET_AUDIT, fleet_subject
    from lapse.edges.streams import count_messages, stream_info_document

    js = await resources.jetstream()
    info = await stream_info_document(js, FLEET_AUDIT)
    clusters = []
    for source in info.get("sources") or []:
        cluster = _cluster(source)
        if cluster is None:
            continue
        active = source.get("active")
        error = source.get("error") or {}
        clusters.append(
            {
                "cluster": cluster,
                # nanoseconds since the hub last heard from it; -1: never
                "lastHeardSeconds": round(active / 1e9, 1) if active and active > 0 else None,
                "lag": source.get("lag", 0),
                "auditEvents": await count_messages(
                    js, FLEET_AUDIT, f"{fleet_subject(cluster, 'audit')}.>"
                ),
                "error": error.get("description"),
            }
        )
    return {"clusters": sorted(clusters, key=lambda c: c["cluster"])}


def print_fleet_report(report: dict[str, Any], args: argparse.Namespace, out: IO[str]) -> None:
    if args.output in ("json", "yaml"):
        document(report, args, out)
        return
    if templated(args.output, report, args, out):
        return
    for line in table(
        report["clusters"], COLUMNS, wide=args.output == "wide", headers=not args.no_headers
    ):
        out.write(line + "\n")
