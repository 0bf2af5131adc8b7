"""Small process helpers shared by the embedded servers."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lapse.errors import LapseError

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# What lapse and the servers it starts create in a state directory is theirs alone: the
# kube-apiserver's tokens and keys, kubeconfigs, NATS passwords, SeaweedFS keys, and the
# data those servers keep (bucket contents, etcd). Directories 0700, files 0600.
PRIVATE_UMASK = 0o077
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600

log = logging.getLogger(__name__)


class ServerStartError(LapseError, RuntimeError):
    """An embedded server could not be started; the message says which and why."""


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def private_dir(path: Path) -> Path:
    """`path` as a directory only its owner can enter: created 0700 (so are its missing
    parents), or tightened, said in a log line, when an older one was wider open."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for directory in reversed(missing):  # mkdir(parents=True) ignores the mode for those
        directory.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    tighten(path, PRIVATE_DIR)
    return path


def tighten(path: Path, mode: int, *, say: bool = True) -> bool:
    """Take away what `mode` does not grant (group and other bits); True when it did. A
    symbolic link is left alone (chmod would change what it points to)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    current = info.st_mode & 0o777
    if stat.S_ISLNK(info.st_mode) or current & ~mode == 0:
        return False
    os.chmod(path, current & mode)
    if say:
        log.info("%s was %s, open to other users: now %s", path, oct(current), oct(current & mode))
    return True


def write_private(path: Path, text: str) -> None:
    """Write a credential: the file is 0600 from its creation, never readable by others
    even for a moment; an older file left wider open is tightened before it is written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, PRIVATE_FILE)
        out.write(text)


def spawn(
    args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start a server writing to `log_path`; `env` adds to lapse's environment (a secret
    passed there is readable only by its user, unlike a command-line argument)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE)
    with os.fdopen(fd, "ab") as log_file:
        # A new session keeps Ctrl-C in a terminal from reaching the server before lapse
        # has drained its work; lapse stops the servers itself, in order. If lapse itself
        # dies (kill -9), the kernel stops the server too, so none is left holding its data
        # dir. The umask: what the server writes (keys, certificates, data) is private.
        return subprocess.Popen(
            args,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            umask=PRIVATE_UMASK,
            env=None if env is None else {**os.environ, **env},
        )


def _die_with_parent() -> None:
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_until(
    ready: Callable[[], bool],
    *,
    process: subprocess.Popen[bytes],
    what: str,
    log_path: Path,
    timeout: float,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(
                f"{what} exited with code {process.returncode}; last log lines:\n" + tail(log_path)
            )
        if ready():
            return
        time.sleep(0.1)
    raise ServerStartError(
        f"{what} was not ready after {timeout:.0f}s; last log lines:\n" + tail(log_path)
    )


def stop(process: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def port_open(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0
