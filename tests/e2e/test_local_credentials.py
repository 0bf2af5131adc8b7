"""What `lapse up` writes into its state directory is its user's alone: the embedded
cluster's system:masters token and kubeconfig, the NATS passwords and configuration, the
SeaweedFS keys, and every other file its servers keep there, 0600 (or tighter) in 0700
directories; a state directory an older lapse left open is tightened at start, in a log
line."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lapse.embedded.process import ServerStartError
from lapse.embedded.seaweedfs import weed_binary
from tests.e2e.test_lapse_up import LapseUp

pytestmark = [pytest.mark.kube, pytest.mark.nats]

CREDENTIALS = (
    "kube/tokens.csv",  # the admin token is system:masters
    "kube/kubeconfig",
    "kube/sa.key",
    "kube/certs/apiserver.key",
    "nats/nats-server.conf",
    "nats-credentials/lapse.password",
    "nats-credentials/lapse-admin.password",
)


def _weed_built() -> bool:
    try:
        weed_binary()
    except ServerStartError:
        return False
    return True


# SeaweedFS chmods its volumes' info files (`<id>.vif`: version, replication) to 0644
# itself, whatever the umask; they sit in 0700 directories, unreachable to other users.
CHMODED_BY_THE_SERVER = ".vif"


def open_to_others(state_dir: Path) -> list[str]:
    """Every directory not 0700 and every file with a group or other bit, in the tree."""
    found = []
    for where, _directories, files in os.walk(state_dir):
        mode = stat.S_IMODE(os.lstat(where).st_mode)
        if mode != 0o700:
            found.append(f"{where}/ {oct(mode)}")
        for name in files:
            info = os.lstat(os.path.join(where, name))
            if stat.S_ISLNK(info.st_mode) or name.endswith(CHMODED_BY_THE_SERVER):
                continue
            if stat.S_IMODE(info.st_mode) & 0o077:
                found.append(f"{where}/{name} {oct(stat.S_IMODE(info.st_mode))}")
    return found


async def test_every_file_lapse_up_writes_is_private(tmp_path: Path) -> None:
    config = tmp_path / "lapse.yaml"
    config.write_text("policies: [{name: all, kubernetes: {ttl: 1h}}]\n")
    state_dir, log = tmp_path / "state", tmp_path / "up.log"
    # What lapse before this fix left: the tokens 0644 in 0755 directories.
    (state_dir / "kube").mkdir(parents=True)
    state_dir.chmod(0o755)
    (state_dir / "kube").chmod(0o755)
    (state_dir / "kube" / "tokens.csv").write_text("old,admin,admin-uid\n")
    (state_dir / "kube" / "tokens.csv").chmod(0o644)
    up = LapseUp(config, state_dir, log)
    await up.start()
    try:
        s3 = ["seaweedfs/s3-identities.json", "seaweedfs/grpc.key"] if _weed_built() else []
        credentials = [*CREDENTIALS, *s3]
        missing = [name for name in credentials if not (state_dir / name).is_file()]
        assert not missing, f"not written where expected: {missing}"
        modes = {name: stat.S_IMODE((state_dir / name).stat().st_mode) for name in credentials}
        assert set(modes.values()) == {0o600}, modes
        assert open_to_others(state_dir) == [], log.read_text()[-2000:]
        text = log.read_text()
        said = next((line for line in text.splitlines() if "open to other users" in line), "")
        assert "./, kube/, kube/tokens.csv)" in said, text[-3000:]
    finally:
        assert up.stop() == 0, log.read_text()[-3000:]
    # What is left when it stopped (the SQLite file, the data) stays private too.
    assert open_to_others(state_dir) == []
