"""docs/architecture.md stays true: what the code defines, the document names, and the rooms
the document lists exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lapse.cli.main import build_parser
from lapse.config import LapseConfig, Streams
from lapse.events.subjects import (
    AUDIT_PREFIX,
    DLQ_PREFIX,
    DUE_PREFIX,
    EVENTS_PREFIX,
    SCHEDULE_PREFIX,
)
from lapse.events.types import EventType, Outcome
from lapse.functions.policy import EXPIRES_ANNOTATION, KEEP_ANNOTATION, TTL_ANNOTATION

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")


def test_every_event_type_and_outcome_is_documented() -> None:
    for event_type in EventType:
        assert f"`{event_type.value}`" in DOC, event_type
    for outcome in Outcome:
        assert f"`{outcome.value}`" in DOC, outcome


@pytest.mark.parametrize(
    "prefix", [SCHEDULE_PREFIX, DUE_PREFIX, EVENTS_PREFIX, AUDIT_PREFIX, DLQ_PREFIX]
)
def test_every_subject_is_documented(prefix: str) -> None:
    assert f"`{prefix}." in DOC


def test_every_stream_default_name_is_documented() -> None:
    for name in Streams().model_dump().values():
        assert f"`{name}`" in DOC, name


def test_every_annotation_is_documented() -> None:
    for annotation in (KEEP_ANNOTATION, EXPIRES_ANNOTATION, TTL_ANNOTATION):
        assert f"`{annotation}" in DOC, annotation


def test_every_configuration_section_is_documented() -> None:
    for section in LapseConfig.model_fields:
        assert f"`{section}`" in DOC, section


def test_every_command_is_documented() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for command in subparsers.choices:  # type: ignore[union-attr]
        assert f"`lapse {command}`" in DOC, command


def _packages(top: str) -> set[str]:
    """Every package (folder with __init__.py) under `top`, as a path with a slash."""
    base = ROOT / top
    found = {f"{top}/"}
    for init in base.rglob("__init__.py"):
        folder = init.parent.relative_to(ROOT)
        if "function" in folder.parts or "schemas" in folder.parts:
            continue  # Knative entry points and the schema files: described with their parent
        found.add(f"{folder.as_posix()}/")
    return found


def test_the_rooms_named_are_the_rooms_that_exist() -> None:
    table = DOC[DOC.index("### The rooms") : DOC.index("## The flow of one run")]
    named = set(re.findall(r"^\| `([a-z_/]+/)` \|", table, flags=re.M))
    lapse_rooms = {p for p in _packages("lapse") if p.count("/") == 2} | {"lapse/"}
    expected = (
        {"events/", "functions/", "infra/"}
        | {p for p in _packages("functions") if p.count("/") == 2}
        | lapse_rooms
    )
    expected.discard("lapse/")  # the package itself is described by its rooms
    assert named == expected


def test_code_cites_the_design_in_the_repository() -> None:
    stale = [
        str(path.relative_to(ROOT))
        for top in ("events", "functions", "lapse", "bench", "infra", "scripts")
        for path in (ROOT / top).rglob("*.py")
        if re.search(r"\bDESIGN\.md\b|\bREFERENCE\.md\b", path.read_text(encoding="utf-8"))
    ]
    assert stale == []
