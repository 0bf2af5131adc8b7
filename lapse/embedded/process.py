"""Small process helpers shared by the embedded servers."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lapse.errors import LapseError

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class ServerStartError(LapseError, RuntimeError):
    """An embedded server could not be started; the message says which and why."""


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    log = log_path.open("ab")
    # A new session keeps Ctrl-C in a terminal from reaching the server before lapse has
    # drained its work; lapse stops the servers itself, in order. If lapse itself dies
    # (kill -9), the kernel stops the server too, so none is left holding its data dir.
    return subprocess.Popen(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent,
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
