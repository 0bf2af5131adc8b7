"""What `lapse up` leaves in its state directory for the other commands to find.

`lapse up` starts an embedded nats-server (and a SQLite file, and a local kube-apiserver)
for whatever is not configured and writes where they are here; every other command falls
back to these files when nothing is configured, so `lapse status` in a second terminal
works with no flags. The NATS and cluster files are removed when `lapse up` stops (the
servers stop with it); the SQLite file outlives it, and so does its URL.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Final

NATS_URL: Final = "nats.url"
DATABASE_URL: Final = "database.url"
KUBECONFIG: Final = "kubeconfig.path"
# "<version> <pid>" of the `lapse up` running with this state directory (`lapse version`).
UP: Final = "up.version"


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "lapse"


def write(state_dir: Path, name: str, value: str) -> None:
    (state_dir / name).write_text(value + "\n", encoding="utf-8")


def read(state_dir: Path, name: str) -> tuple[str, Path] | None:
    """The value `lapse up` wrote, and the file it came from; None when there is none."""
    path = state_dir / name
    try:
        value = path.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return (value, path) if value else None


def remove(state_dir: Path, *names: str) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (state_dir / name).unlink()
