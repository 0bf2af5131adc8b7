"""`lapse up` makes its state directory private at start (lapse/cli/state.py): what an
older lapse left open is tightened and said; what it did not write is left alone."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from lapse.cli import state


@pytest.fixture
def restored_umask() -> Iterator[None]:
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_what_lapse_wrote_is_tightened_and_nothing_else(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, restored_umask: None
) -> None:
    state_dir = tmp_path / "state"
    (state_dir / "kube" / "certs").mkdir(parents=True)
    for directory in (state_dir, state_dir / "kube", state_dir / "kube" / "certs"):
        directory.chmod(0o755)
    tokens = state_dir / "kube" / "tokens.csv"
    tokens.write_text("t,admin,uid\n")
    tokens.chmod(0o644)
    mine = state_dir / "notes.txt"  # --state-dir may hold more than lapse's files
    mine.write_text("mine\n")
    mine.chmod(0o644)
    elsewhere = tmp_path / "shared.txt"
    elsewhere.write_text("x")
    elsewhere.chmod(0o644)
    (state_dir / "kube" / "link").symlink_to(elsewhere)

    with caplog.at_level(logging.WARNING, logger="lapse.cli.state"):
        state.make_private(state_dir)

    assert [mode(p) for p in (state_dir, state_dir / "kube", state_dir / "kube" / "certs")] == [
        0o700
    ] * 3
    assert mode(tokens) == 0o600
    assert mode(mine) == 0o644 and mode(elsewhere) == 0o644
    assert "kube/tokens.csv" in caplog.text and "notes.txt" not in caplog.text
    # From now on what the process creates is private.
    state.write(state_dir, state.NATS_URL, "nats://127.0.0.1:4222")
    (state_dir / "nats").mkdir()
    assert (mode(state_dir / state.NATS_URL), mode(state_dir / "nats")) == (0o600, 0o700)


def test_a_new_state_directory_is_made_private(tmp_path: Path, restored_umask: None) -> None:
    state_dir = tmp_path / "a" / "state"
    state.make_private(state_dir)
    assert (mode(tmp_path / "a"), mode(state_dir)) == (0o700, 0o700)
