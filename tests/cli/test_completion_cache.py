"""TAB completion inside a command answers from the cached shape of its parser, the same
candidates the command's own parser gives, without importing the command's module.

The shell's side is simulated the way argcomplete's shell code does it (the environment
variables it sets); the candidates are read from the file argcomplete writes them to.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lapse.cli.completion import _rebuild, _shape, _subparsers
from lapse.cli.main import COMMANDS, build_parser
from lapse.cli.names import OUTCOMES

# Lines a user completes, grouped by the command whose parser they need.
LINES = {
    "plan": ["lapse plan --", "lapse plan -o ", "lapse plan --namespace-glob x --"],
    "dlq": ["lapse dlq ", "lapse dlq replay --", "lapse dlq list -o "],
    "history": ["lapse history -o ", "lapse history --"],
    "serve": ["lapse serve "],
    "brake": ["lapse brake ", "lapse brake release --"],
}


# `lapse` as the shell runs it to complete, reporting which modules were loaded when
# argcomplete ended the process (it calls os._exit, bound when argcomplete is imported).
PROBE = """
import os, sys
_exit = os._exit
def report_and_exit(code):
    with open(sys.argv[1], "w") as report:
        report.write("\\n".join(sorted(sys.modules)))
    _exit(code)
os._exit = report_and_exit
from lapse.cli.main import main
main()
"""


def complete(line: str, cache: Path, tmp_path: Path) -> tuple[list[str], set[str]]:
    """The candidates for `line` (cursor at its end), and the modules it loaded."""
    out, loaded = tmp_path / "candidates", tmp_path / "modules"
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(cache),
        "_ARGCOMPLETE": "1",
        "_ARGCOMPLETE_SHELL": "bash",
        "COMP_LINE": line,
        "COMP_POINT": str(len(line)),
        "COMP_TYPE": "9",
        "_ARGCOMPLETE_IFS": "\v",
        "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
    }
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(loaded)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return sorted(out.read_text().split("\v")), set(loaded.read_text().split())


@pytest.mark.parametrize("command", sorted(LINES))
def test_a_cached_command_completes_alike_without_its_module(command: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    module = COMMANDS[command][0]
    for index, line in enumerate(LINES[command]):
        # Without a cache: the command's own parser (its module imported).
        real, loaded = complete(line, tmp_path / f"empty-{index}", tmp_path)
        assert module in loaded
        if index == 0:
            complete(line, cache, tmp_path)  # the first completion saves the shape
        cached, loaded = complete(line, cache, tmp_path)
        assert cached == real and len(real) > 1, line
        assert module not in loaded, f"{line}: imported {module}"
    [saved] = (cache / "lapse" / "completion").glob("*.json")
    assert list(json.loads(saved.read_text())) == [command]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_commands_shape_survives_the_cache(command: str) -> None:
    """Rebuilt from its shape, a command's parser has the same shape again (flags, values,
    choices, help, sub-commands, exclusive groups)."""
    real = _subparsers(build_parser(command, full=False)).choices[command]
    shape = _shape(real)
    assert shape is not None
    stored = json.loads(json.dumps(shape))
    assert _shape(_rebuild(stored, real.prog)) == stored


def test_closed_sets_complete_to_their_values_not_file_names(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    outcomes, _ = complete("lapse history --outcome ", cache, tmp_path)
    assert [o.strip() for o in outcomes] == sorted(OUTCOMES)
    kinds, _ = complete("lapse plan --kind ", cache, tmp_path)
    assert {"argo-workflow", "Workflow", "PipelineRun", "job"} <= {k.strip() for k in kinds}
    formats, _ = complete("lapse dlq list -o ", cache, tmp_path)
    assert {"json", "yaml", "jsonpath=", "custom-columns="} <= {f.strip() for f in formats}
    # Answered from the cache as well as from the parser.
    assert complete("lapse history --outcome ", cache, tmp_path)[0] == outcomes
