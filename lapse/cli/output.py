"""`-o table|wide|json|yaml|name|jsonpath=...|custom-columns=...` and `--no-headers`, the
way kubectl prints objects.

Tables are plain aligned columns (no boxes, no colour, no truncation), so they can be piped
into `awk`, `grep` and `column`. json and yaml are a kubectl `List` (`{"apiVersion": "v1",
"kind": "List", "items": [...]}`); `jsonpath=` and `custom-columns=` read that List and its
items as kubectl does (lapse/cli/jsonpath.py). Until 0.3, LAPSE_BARE_LISTS=true prints the
items as the bare array they were before 0.2 (deprecated, said on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any, Final

from lapse.cli.parsing import did_you_mean, offer

OBJECT_FORMATS: Final = (
    "table", "wide", "json", "yaml", "name", "jsonpath=", "custom-columns=",
)  # fmt: skip
REPORT_FORMATS: Final = ("table", "wide", "json", "yaml", "jsonpath=", "custom-columns=")
# The formats that take a template after `=`.
TEMPLATED: Final = ("jsonpath=", "custom-columns=")
BARE_LISTS_ENV: Final = "LAPSE_BARE_LISTS"

Row = dict[str, Any]


@dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[Row], object]
    wide_only: bool = False


def add_output(parser: argparse.ArgumentParser, formats: Sequence[str] = OBJECT_FORMATS) -> None:
    action = parser.add_argument(
        "-o",
        "--output",
        type=output_format(formats),
        default="table",
        metavar="FORMAT",
        help="output format: "
        + ", ".join(f"{f}TEMPLATE" if f in TEMPLATED else f for f in formats)
        + (" (wide adds columns; name prints kind.group/name" if "name" in formats else " (")
        + "; json and yaml are a kubectl List; jsonpath and custom-columns as in kubectl)",
    )
    offer(action, formats)
    parser.add_argument(
        "--no-headers", action="store_true", help="tables without their header line"
    )


def output_format(formats: Sequence[str]) -> Callable[[str], str]:
    """An argparse `type` for `-o`: one of `formats`, or `jsonpath=`/`custom-columns=` with
    a template that parses (a bad one is a usage error, before anything is read)."""
    plain = [f for f in formats if f not in TEMPLATED]
    templated = [f for f in formats if f in TEMPLATED]

    def check(text: str) -> str:
        if text in plain:
            return text
        for prefix in templated:
            if text.startswith(prefix):
                template = text.removeprefix(prefix)
                if not template:
                    raise argparse.ArgumentTypeError(f"-o {prefix}: a template is missing")
                from lapse.cli.jsonpath import JsonPathError, parse

                try:
                    if prefix == "jsonpath=":
                        parse(template)
                    else:
                        custom_columns(template)
                except JsonPathError as exc:
                    raise argparse.ArgumentTypeError(f"-o {text}: {exc}") from None
                return text
        shown = ", ".join(f"{f}TEMPLATE" if f in TEMPLATED else f for f in formats)
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an output format (one of {shown}){did_you_mean(text, plain)}"
        )

    return check


def custom_columns(spec: str) -> list[tuple[str, str]]:
    """`NAME:.path,OTHER:.path` as (header, path) pairs."""
    from lapse.cli.jsonpath import JsonPathError, find

    columns = []
    for part in spec.split(","):
        header, sep, path = part.partition(":")
        if not sep or not header or not path:
            raise JsonPathError(f"{part!r} is not HEADER:.path")
        path = path.strip()
        if path.startswith("{") and path.endswith("}"):
            path = path[1:-1]
        find(path, {})  # parses
        columns.append((header, path))
    return columns


def as_list(items: Sequence[Any]) -> dict[str, Any]:
    """kubectl's List of `items`, what `-o json|yaml|jsonpath=` show."""
    return {"apiVersion": "v1", "kind": "List", "items": list(items)}


def bare_lists() -> bool:
    """Whether the deprecated bare array is asked for (LAPSE_BARE_LISTS), said when it is."""
    value = os.environ.get(BARE_LISTS_ENV, "").strip().lower()
    if value not in ("1", "true", "yes"):
        return False
    print(
        f"lapse: warning: {BARE_LISTS_ENV}={value}: a bare JSON/YAML array is deprecated and "
        "goes in 0.3; read .items of the List instead",
        file=sys.stderr,
    )
    return True


def templated(fmt: str, document: Any, args: argparse.Namespace, out: IO[str]) -> bool:
    """Print `document` for `-o jsonpath=` or `-o custom-columns=` (its `items` one row each
    when it is a List, else one row); False for any other format."""
    from lapse.cli.jsonpath import find, render

    if fmt.startswith("jsonpath="):
        out.write(render(fmt.removeprefix("jsonpath="), document))
        return True
    if not fmt.startswith("custom-columns="):
        return False
    spec = custom_columns(fmt.removeprefix("custom-columns="))
    is_list = isinstance(document, dict) and document.get("kind") == "List"
    objects = document["items"] if is_list else [document]
    cells = [[_cell(find(path, obj)) for _, path in spec] for obj in objects]
    if not getattr(args, "no_headers", False):
        cells.insert(0, [header for header, _ in spec])
    for line in aligned(cells):
        out.write(line + "\n")
    return True


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
    return aligned(cells)


def _cell(found: list[Any]) -> str:
    """A custom column's cell, as kubectl's: `<none>` for nothing, several values by commas."""
    if not found:
        return "<none>"
    return ",".join(json.dumps(v) if isinstance(v, dict | list) else text(v) for v in found)


def aligned(cells: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as lines of plain columns, three spaces apart."""
    if not cells:
        return []
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
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
    if fmt in ("json", "yaml"):
        document(list(rows) if bare_lists() else as_list(rows), args, out)
    elif templated(fmt, as_list(rows), args, out):
        pass
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


def document(value: Any, args: argparse.Namespace, out: IO[str]) -> None:
    """`value` as json (under --watch one line per change, so a stream reader can split it)
    or yaml."""
    if args.output == "json":
        json.dump(value, out, indent=None if getattr(args, "watch", False) else 2, default=str)
        out.write("\n")
        return
    import yaml

    yaml.safe_dump(value, out, sort_keys=False, default_flow_style=False)
