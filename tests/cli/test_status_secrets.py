"""`lapse status` never prints a credential, in any output format, whatever characters the
password holds (people paste them unencoded: SQLAlchemy reads `kfp:pa/ss@db` as it is)."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from nats.js import JetStreamContext

from lapse.embedded.nats import EmbeddedNats
from tests.cli.conftest import Shell

pytestmark = [pytest.mark.nats]

# Each one SQLAlchemy accepts unencoded (its password runs to the first `@`).
PASSWORDS = ("pa/ss", "p:ss w/rd?x#y %zz ünï/cødé-пароль")


@pytest.mark.parametrize("password", PASSWORDS)
async def test_status_never_prints_the_database_password(
    shell: Shell, nats_server: EmbeddedNats, lapse_streams: JetStreamContext, password: str
) -> None:
    env = {"LAPSE_DATABASE__URL": f"postgresql://kfp:{password}@db.example:5432/mlpipeline"}
    table = shell("status", "--nats-url", nats_server.url, env=env)
    assert table.returncode == 0, table.stderr
    as_json = shell("status", "--nats-url", nats_server.url, "-o", "json", env=env)
    assert as_json.returncode == 0, as_json.stderr
    for out in (table.stdout + table.stderr, as_json.stdout + as_json.stderr):
        assert password not in out and quote(password, safe="") not in out
    shown = "postgresql://kfp:***@db.example:5432/mlpipeline"
    assert f"database:      {shown}   (from database.url)" in table.stdout
    assert json.loads(as_json.stdout)["database"]["url"] == shown


async def test_status_never_prints_a_nats_password_or_token(
    shell: Shell, nats_server: EmbeddedNats, lapse_streams: JetStreamContext
) -> None:
    # The session's server has no authorization, so it admits the client whatever
    # credential the URL carries: what is checked is what status prints.
    host = nats_server.url.removeprefix("nats://")
    for url, shown, secret in (
        (f"nats://lapse:{quote('s3c/r@t', safe='')}@{host}", f"nats://lapse:***@{host}", "s3c"),
        (f"nats://t0k3n-abc@{host}", f"nats://***@{host}", "t0k3n"),
    ):
        table = shell("status", "--nats-url", url)
        as_json = shell("status", "--nats-url", url, "-o", "json")
        assert table.returncode == 0 and as_json.returncode == 0, table.stderr + as_json.stderr
        assert secret not in table.stdout + table.stderr + as_json.stdout + as_json.stderr
        assert f"nats:          {shown}   (from --nats-url)" in table.stdout
        assert json.loads(as_json.stdout)["nats"]["url"] == shown


async def test_a_database_url_sqlalchemy_refuses_is_not_echoed(shell: Shell) -> None:
    # A raw `@` too: SQLAlchemy reads `ss:w` as the host and refuses the port.
    env = {"LAPSE_DATABASE__URL": "postgresql://kfp:p@ss:w/rd?x#y@db.example/mlpipeline"}
    result = shell("status", env=env)
    assert result.returncode == 2
    assert "LAPSE_DATABASE__URL" in result.stderr
    assert "ss:w/rd" not in result.stdout + result.stderr
