"""`-o table|wide|json|yaml|name` and `--no-headers`, the way kubectl prints objects.

Tables are plain aligned columns (no boxes, no truncation), so they can be piped into
`awk`, `grep` and `column`; json and yaml are the same list of objects, for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any, Final

import yaml

OBJECT_FORMATS: Final = ("table", "wide", "json", "yaml", "name")
REPORT_FORMATS: Final = ("table", "wide", "json", "yaml")

Row = dict[str, Any]


@dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[Row], object]
    wide_only: bool = False


def add_output(parser: argparse.ArgumentParser, formats: Sequence[str] = OBJECT_FORMATS) -> None:
    parser.add_argument(
        "-o",
        "--output",
        choices=formats,
        default="table",
        help="output format: "
        + ", ".join(formats)
        + (" (wide adds columns; name prints kind.group/name)" if "name" in formats else ""),
    )
    parser.add_argument(
        "--no-headers", action="store_true", help="tables without their header line"
    )


def text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def table(
    rows: Sequence[Row], columns: Sequence[Column], *, wide: bool, headers: bool
) -> list[str]:
    shown = [c for c in columns if wide or not c.wide_only]
    cells = [[text(c.cell(row)) for c in shown] for row in rows]
    if headers:
        cells.insert(0, [c.header for c in shown])
    if not cells:
        return []
    widths = [max(len(line[i]) for line in cells) for i in range(len(shown))]
    return [
        "   ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in cells
    ]


def human_bytes(size: int | None) -> str:
    """`1.5 MiB` (binary units); exact below 1 KiB;
    empty when not known."""
    if size is None:
        return ""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def resource_name(api_version: str | None, kind: str | None, name: str | None) -> str:
    """kubectl's `-o name`: `workflow.argoproj.io/train`, `job.batch/nightly`."""
    group = (api_version or "").rpartition("/")[0]
    resource = (kind or "object").lower()
    return f"{resource}.{group}/{name}" if group else f"{resource}/{name}"


def emit(
    rows: Sequence[Row],
    columns: Sequence[Column],
    args: argparse.Namespace,
    out: IO[str],
    *,
    name: Callable[[Row], str] | None = None,
) -> None:
    """Print `rows` in the format `args.output` names."""
    fmt = args.output
    if fmt == "json":
        # Under --watch each change is one line of json, so a stream reader can split it.
        json.dump(list(rows), out, indent=None if getattr(args, "watch", False) else 2)
        out.write("\n")
    elif fmt == "yaml":
        yaml.safe_dump(list(rows), out, sort_keys=False, default_flow_style=False)
    elif fmt == "name":
        assert name is not None, "-o name is offered only where objects have names"
        for row in rows:
            out.write(name(row) + "\n")
    elif not rows:
        # On stderr, as kubectl does: stdout stays empty for scripts.
        print("No resources found.", file=sys.stderr)
    else:
        for line in table(rows, columns, wide=fmt == "wide", headers=not args.no_headers):
            out.write(line + "\n")
