"""Code imports the contract, the handlers and the manifests as `lapse.events`,
`lapse.functions` and `lapse.infra`, never under the folders' own names.

In a checkout the old names still resolve (the folders are at the top, and the tests run with
the checkout on the path), so a leftover would work here and fail once installed, where
`events` and `functions` are other projects on PyPI. `lint-imports` checks lapse/ itself;
this checks every Python file of the repository, tests, scripts and benchmarks included.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("events", "functions", "infra")


def python_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "*.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return [ROOT / name for name in listed if not (ROOT / name).is_symlink()]


def old_imports(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    return found


def test_no_file_imports_the_old_top_level_names() -> None:
    files = python_files()
    assert len(files) > 100  # the listing worked
    leftovers = {
        str(path.relative_to(ROOT)): found
        for path in files
        if (found := old_imports(path.read_text(encoding="utf-8")))
    }
    assert leftovers == {}


def test_the_check_sees_an_old_import() -> None:
    old = ".".join(("events", "models"))  # spelled apart, or the rename's codemod rewrites it
    source = f"import infra\nfrom {old} import RunFinished\nfrom lapse.events import run\n"
    assert old_imports(source) == ["line 1: infra", f"line 2: {old}"]
