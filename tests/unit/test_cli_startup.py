"""Every command's `--help`, and the commands that need no server, start without the
libraries that made them take 1-2 s (docs/cli.md, "Start-up"): the Kubernetes client,
SQLAlchemy, NATS, pydantic (the configuration's schema, the event models), the
OpenTelemetry SDK, rich. Asserted by what is imported, not by a clock, so a loaded machine
cannot make it flaky; docs/cli.md has the times this buys."""

from __future__ import annotations

import json
import subprocess
import sys

from lapse.cli.main import COMMANDS, build_parser

# What decided the start-up time (python -X importtime): each 0.2-0.5 s on its own.
HEAVY = (
    "kubernetes", "sqlalchemy", "nats", "pydantic", "opentelemetry.sdk", "rich",
    "cloudevents", "yaml", "hypercorn", "obstore",
)  # fmt: skip

# One process runs them all, each as `lapse ...` would, and names the first that loaded any.
PROBE = """
import contextlib, io, json, sys
from lapse.cli.main import main
heavy = sys.argv[1].split(",")
for line in json.loads(sys.argv[2]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(line)
    loaded = [name for name in heavy if name in sys.modules]
    if loaded:
        print(json.dumps({" ".join(line): loaded}))
        break
else:
    print("{}")
"""


def _command_lines() -> list[list[str]]:
    parser = build_parser()
    top = next(a for a in parser._actions if a.dest == "command")
    lines: list[list[str]] = [["--help"]]
    for name, sub in top.choices.items():  # type: ignore[union-attr]
        lines.append([name, "--help"])
        for action in sub._actions:
            if action.dest == "action":
                lines += [[name, leaf, "--help"] for leaf in action.choices]  # type: ignore[union-attr]
    return lines


def test_help_and_simple_commands_import_nothing_heavy() -> None:
    lines = [*_command_lines(), ["version"], ["completion", "bash"]]
    assert {line[0] for line in lines} >= set(COMMANDS)
    result = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(HEAVY), json.dumps(lines)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {}
