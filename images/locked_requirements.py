"""The lines of requirements.lock an image installs: a project's dependencies, with hashes.

The image builds install with `pip install --require-hashes --no-deps -r <these lines>`:
every file pip downloads is checked against the lock's sha256, and nothing outside the lock
is ever resolved. (pip may not take the lock as a constraints file: the base's pip,
Debian bookworm's 23.0, turns hash-checking on for hashes in a constraints file and then
refuses every requirement not pinned with `==`.) `scripts/release.py` lists the same lines
for the release's SBOMs, so an SBOM names exactly what the image installed.

Which packages: the closure of the roots (a pyproject.toml's `dependencies`, an extra, or
one function's share of lapse's dependencies, `[tool.lapse.function-dependencies]`) over
the lock's `# via` annotations, which `uv pip compile` writes for every package; lines
whose environment marker does not hold here (Windows, PyPy) are left out. Standard library
only, plus the `packaging` that pip vendors: it runs in the Containerfile's build stages.

    python images/locked_requirements.py requirements.lock pyproject.toml [--extra NAME]
        [--without-dependencies] [--function NAME]
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

try:
    from packaging.markers import Marker
except ImportError:  # the build stages have pip's copy only
    from pip._vendor.packaging.markers import Marker  # type: ignore[assignment]

_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")
_VIA_ROOT = " (pyproject.toml)"


def normalize(name: str) -> str:
    """PEP 503's form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Locked:
    """One package of the lock: its requirement (with hashes) and who requires it."""

    name: str
    requirement: str
    via: frozenset[str]

    def applies(self) -> bool:
        """Whether its environment marker (if any) holds for this interpreter."""
        head = self.requirement.split("\\", 1)[0].strip()
        if ";" not in head:
            return True
        return Marker(head.split(";", 1)[1].strip()).evaluate()


def parse_lock(text: str) -> dict[str, Locked]:
    """requirements.lock as uv writes it: a requirement, its hash lines, its `# via` lines."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if _NAME.match(line):
            blocks.append([line])
        elif blocks and line.startswith(" "):
            blocks[-1].append(line)
    locked: dict[str, Locked] = {}
    for block in blocks:
        match = _NAME.match(block[0])
        assert match is not None
        requirement = [line for line in block if not line.strip().startswith("#")]
        via: set[str] = set()
        for line in block:
            comment = line.strip().removeprefix("#").strip()
            if not line.strip().startswith("#") or not comment:
                continue
            comment = comment.removeprefix("via").strip()
            if comment:
                via.add(normalize(comment.removesuffix(_VIA_ROOT).split()[0]))
        name = normalize(match.group(1))
        if not any("--hash=" in line for line in requirement):
            raise SystemExit(f"requirements.lock: {name} has no hash (`make lock` writes them)")
        locked[name] = Locked(name, "\n".join(requirement).rstrip(" \\"), frozenset(via))
    return locked


def roots(pyproject: Path, extras: tuple[str, ...], dependencies: bool) -> set[str]:
    """The names a project asks for: its dependencies and/or the named extras."""
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted: list[str] = list(project.get("dependencies", [])) if dependencies else []
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    return names_of(wanted)


EVERY_FUNCTION = "every-function"


def function_dependencies(pyproject: Path, function: str) -> list[str]:
    """The requirements (as `dependencies` writes them, ranges and extras kept) of one of
    lapse's functions: `every-function`'s names and its own, in
    `[tool.lapse.function-dependencies]`."""
    document = tomllib.loads(pyproject.read_text())
    table = document["tool"]["lapse"]["function-dependencies"]
    if function == EVERY_FUNCTION or function not in table:
        known = ", ".join(sorted(set(table) - {EVERY_FUNCTION}))
        raise SystemExit(f"[tool.lapse.function-dependencies] has no {function!r} ({known})")
    names = {normalize(name) for name in [*table[EVERY_FUNCTION], *table[function]]}
    chosen = []
    for requirement in document["project"]["dependencies"]:
        match = _NAME.match(requirement.strip())
        assert match is not None, requirement
        if normalize(match.group(1)) in names:
            chosen.append(requirement)
            names.discard(normalize(match.group(1)))
    if names:
        raise SystemExit(f"{function}: not in [project] dependencies: {', '.join(sorted(names))}")
    return chosen


def names_of(requirements: list[str]) -> set[str]:
    """The distribution names of requirement strings."""
    names = set()
    for requirement in requirements:
        match = _NAME.match(requirement.strip())
        assert match is not None, requirement
        names.add(normalize(match.group(1)))
    return names


def closure(locked: dict[str, Locked], names: set[str]) -> list[Locked]:
    """The packages `names` need, transitively, by the lock's `# via` annotations."""
    missing = sorted(names - locked.keys())
    if missing:
        raise SystemExit(f"not in requirements.lock: {', '.join(missing)} (`make lock`)")
    needed = set(names)
    grew = True
    while grew:
        grew = False
        for package in locked.values():
            if package.name not in needed and package.via & needed:
                needed.add(package.name)
                grew = True
    return [locked[name] for name in sorted(needed) if locked[name].applies()]


def requirements(
    lock: Path,
    pyproject: Path,
    extras: tuple[str, ...] = (),
    without_dependencies: bool = False,
    function: str | None = None,
) -> list[Locked]:
    """What an image installs for `pyproject`'s dependencies and `extras` (or, for one of
    lapse's functions, that function's dependencies), from `lock`."""
    locked = parse_lock(lock.read_text())
    if function is not None:
        return closure(locked, names_of(function_dependencies(pyproject, function)))
    chosen = closure(locked, roots(pyproject, (), dependencies=True))
    if extras:
        extra = closure(locked, roots(pyproject, extras, dependencies=False))
        if without_dependencies:
            base = {package.name for package in chosen}
            chosen = [package for package in extra if package.name not in base]
        else:
            chosen = sorted({*chosen, *extra}, key=lambda package: package.name)
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lock", type=Path)
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("--extra", action="append", default=[])
    parser.add_argument(
        "--without-dependencies",
        action="store_true",
        help="only what the extras add to the project's dependencies",
    )
    parser.add_argument(
        "--function", help="one of lapse's functions: only what it imports (ttl-planner, ...)"
    )
    args = parser.parse_args()
    chosen = requirements(
        args.lock, args.pyproject, tuple(args.extra), args.without_dependencies, args.function
    )
    print("\n".join(package.requirement for package in chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
