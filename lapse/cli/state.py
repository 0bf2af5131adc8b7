"""What `lapse up` leaves in its state directory for the other commands to find.

`lapse up` starts an embedded nats-server (and a SQLite file, and a local kube-apiserver)
for whatever is not configured and writes where they are here; every other command falls
back to these files when nothing is configured, so `lapse status` in a second terminal
works with no flags. The NATS and cluster files are removed when `lapse up` stops (the
servers stop with it); the SQLite file outlives it, and so does its URL.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Final

from lapse.embedded.nats_identities import CREDENTIALS_DIR
from lapse.embedded.process import (
    PRIVATE_DIR,
    PRIVATE_FILE,
    PRIVATE_UMASK,
    private_dir,
    tighten,
    write_private,
)

log = logging.getLogger(__name__)

NATS_URL: Final = "nats.url"
DATABASE_URL: Final = "database.url"
KUBECONFIG: Final = "kubeconfig.path"
# "<version> <pid>" of the `lapse up` running with this state directory (`lapse version`).
UP: Final = "up.version"


# Everything `lapse up` writes in its state directory (lapse/cli/up.py: the embedded
# servers' directories, the NATS passwords, the SQLite file, the files above).
WRITTEN_BY_UP: Final = (
    NATS_URL, DATABASE_URL, KUBECONFIG, UP, "lapse.db",
    "nats", CREDENTIALS_DIR, "kube", "seaweedfs",
)  # fmt: skip


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "lapse"


def make_private(state_dir: Path) -> None:
    """The state directory as `lapse up` keeps it: 0700, and whatever lapse and the servers
    it starts write there from now on private (the process's umask: files 0600, directories
    0700; the kube-apiserver's system:masters token, kubeconfig, NATS passwords, SeaweedFS
    keys, and the data). What an older lapse left open to other users (kube/tokens.csv was
    0644 in a 0755 directory) is tightened, and said in one log line."""
    os.umask(PRIVATE_UMASK)
    if not state_dir.exists():
        private_dir(state_dir)
        return
    tightened = ["./"] if tighten(state_dir, PRIVATE_DIR, say=False) else []
    # Only what lapse up writes: --state-dir may name a directory that holds more.
    for entry in WRITTEN_BY_UP:
        top = state_dir / entry
        if top.is_symlink() or not top.exists():
            continue
        if top.is_file():
            tightened += [entry] if tighten(top, PRIVATE_FILE, say=False) else []
            continue
        for where, _subdirectories, names in os.walk(top):
            directory = Path(where)
            if tighten(directory, PRIVATE_DIR, say=False):
                tightened.append(f"{directory.relative_to(state_dir)}/")
            tightened += [
                str((directory / name).relative_to(state_dir))
                for name in names
                if tighten(directory / name, PRIVATE_FILE, say=False)
            ]
    if tightened:
        shown = ", ".join(tightened[:8]) + (
            f" and {len(tightened) - 8} more" if len(tightened) > 8 else ""
        )
        log.warning(
            "%s was open to other users: now 0700 directories and 0600 files (%s)",
            state_dir, shown,
        )  # fmt: skip


def write(state_dir: Path, name: str, value: str) -> None:
    write_private(state_dir / name, value + "\n")


def read(state_dir: Path, name: str) -> tuple[str, Path] | None:
    """The value `lapse up` wrote, and the file it came from; None when there is none."""
    path = state_dir / name
    try:
        value = path.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return (value, path) if value else None


def running_up(state_dir: Path) -> tuple[str, int, Path] | None:
    """(version, pid, file) of the `lapse up` running with this state directory; None when
    none runs (a file left by a `lapse up` that was killed is not a server)."""
    found = read(state_dir, UP)
    if found is None:
        return None
    up_version, _, pid = found[0].partition(" ")
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return None
    except PermissionError:
        pass  # alive, another user's
    return up_version, int(pid), found[1]


def remove(state_dir: Path, *names: str) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (state_dir / name).unlink()
