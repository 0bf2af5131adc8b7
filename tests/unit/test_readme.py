"""The README and the pages it points at stay true: its command table is the CLI's parser,
the make targets it names exist, and the files it names are in the repository."""

from __future__ import annotations

import re
from pathlib import Path

from lapse.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def _commands() -> dict[str, set[str]]:
    """Every command of the parser, with its actions (`dlq list`, …) when it has some."""
    parser = build_parser()
    top = next(a for a in parser._actions if a.dest == "command")
    found: dict[str, set[str]] = {}
    for name, sub in top.choices.items():  # type: ignore[union-attr]
        actions = [a for a in sub._actions if a.dest == "action"]
        found[name] = set(actions[0].choices) if actions else set()  # type: ignore[arg-type]
    return found


def test_the_command_table_is_the_parser() -> None:
    table = _section("Command line")
    rows = re.findall(r"^\| `lapse ([a-z]+)((?: [^`]*)?)` \|", table, flags=re.M)
    named = {name: rest.strip() for name, rest in rows}
    commands = _commands()
    assert set(named) == set(commands)
    for name, actions in commands.items():
        if actions:  # `lapse dlq list|show|replay|purge` names every action, and only those
            assert set(named[name].replace("\\|", "|").split("|")) == actions, name


def test_the_flags_the_readme_names_exist() -> None:
    parser = build_parser()
    top = next(a for a in parser._actions if a.dest == "command")
    options = {o for a in parser._actions for o in a.option_strings}
    for sub in top.choices.values():  # type: ignore[union-attr]
        options |= {o for a in sub._actions for o in a.option_strings}
        for action in sub._actions:
            if action.dest == "action":
                for leaf in action.choices.values():  # type: ignore[union-attr]
                    options |= {o for a in leaf._actions for o in a.option_strings}
    named = set(re.findall(r"`(?:lapse [^`]*?)?(--[a-z][a-z-]+)", README))
    assert named <= options, named - options


def test_the_make_targets_the_readme_names_exist() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, flags=re.M))
    named = set(re.findall(r"`make ([a-z][a-z-]*)", README))
    named |= set(re.findall(r"^make ([a-z][a-z-]*)", README, flags=re.M))
    assert named and named <= targets, named - targets


def test_the_files_the_docs_name_exist() -> None:
    pages = [README, *(p.read_text(encoding="utf-8") for p in (ROOT / "docs").glob("*.md"))]
    named = {
        path
        for text in pages
        for path in re.findall(
            r"(?<![\w./-])((?:docs|bench|infra|tests|scripts|lapse|examples)/[\w./-]*\.(?:md|py|sh|yaml|json))",
            text,
        )
    }
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == []


def test_the_readme_promises_no_package_index() -> None:
    # lapse is not published: install is from a clone or a wheel built from it.
    assert "pip install lapse" not in README
    assert "pip install 'lapse[" not in README
