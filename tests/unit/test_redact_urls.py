"""No password, token or signature survives `redact_url` / `redact`, whatever characters
it holds and whichever URL form carries it; scheme, user, host, port and database stay
(lapse/config/redact.py)."""

from __future__ import annotations

import string
from urllib.parse import quote

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lapse.config.redact import MASK, RedactingFilter, redact, redact_url

# Every dialect `database.url` accepts (lapse/config/database_url.py), plain and with the
# driver named; sqlite carries no credentials.
DATABASE_SCHEMES = (
    "postgresql", "postgres", "postgresql+asyncpg", "postgresql+psycopg", "mysql",
    "mariadb", "mysql+aiomysql", "mysql+pymysql", "mariadb+aiomysql",
)  # fmt: skip
NATS_SCHEMES = ("nats", "tls", "ws", "wss")
ENDPOINT_SCHEMES = ("http", "https", "s3")
SECRET_PARAMETERS = (
    "password", "sslpassword", "X-Amz-Signature", "X-Amz-Security-Token",
    "X-Amz-Credential", "token", "sig", "access_token",
)  # fmt: skip

passwords = st.text(min_size=1, max_size=40)
users = st.text(string.ascii_letters + string.digits + "_.-", min_size=1, max_size=12)
hosts = st.sampled_from(("db", "127.0.0.1", "[::1]", "nats.lapse.svc", "s3.example.com"))
ports = st.sampled_from(("", ":5432", ":4222", ":9000"))
paths = st.sampled_from(("", "/mlpipeline", "/db?sslmode=require", "/bucket/key"))


def _raw_or_encoded(password: str, encoded: bool) -> str:
    return quote(password, safe="") if encoded else password


@settings(max_examples=200)
@given(
    scheme=st.sampled_from(DATABASE_SCHEMES + NATS_SCHEMES + ENDPOINT_SCHEMES),
    user=users, password=passwords, encoded=st.booleans(), host=hosts, port=ports,
    path=paths,
)  # fmt: skip
def test_a_password_in_the_userinfo_is_masked_and_the_rest_kept(
    scheme: str, user: str, password: str, encoded: bool, host: str, port: str, path: str
) -> None:
    url = f"{scheme}://{user}:{_raw_or_encoded(password, encoded)}@{host}{port}{path}"
    shown = redact_url(url)
    assert shown == f"{scheme}://{user}:{MASK}@{host}{port}{path}"


@settings(max_examples=200)
@given(
    scheme=st.sampled_from(NATS_SCHEMES + ENDPOINT_SCHEMES), token=passwords,
    encoded=st.booleans(), host=hosts, port=ports,
)  # fmt: skip
def test_a_token_alone_in_the_userinfo_is_masked(
    scheme: str, token: str, encoded: bool, host: str, port: str
) -> None:
    assume(encoded or ":" not in token)  # raw, `user:password`: the test above
    url = f"{scheme}://{_raw_or_encoded(token, encoded)}@{host}{port}"
    assert redact_url(url) == f"{scheme}://{MASK}@{host}{port}"


@settings(max_examples=200)
@given(
    scheme=st.sampled_from(DATABASE_SCHEMES + ENDPOINT_SCHEMES),
    parameter=st.sampled_from(SECRET_PARAMETERS), secret=passwords, encoded=st.booleans(),
    host=hosts, port=ports,
)  # fmt: skip
def test_a_secret_query_parameter_is_masked(
    scheme: str, parameter: str, secret: str, encoded: bool, host: str, port: str
) -> None:
    # Unencoded, a `#` ends the query and `&name=` starts another parameter: nothing
    # reads such a value as one secret. An unencoded `@` may mask the host as well
    # (lapse/config/redact.py): never generated raw either.
    assume(encoded or not any(c in secret for c in "#=@"))
    user = "kfp@" if scheme in DATABASE_SCHEMES else ""  # a user alone: kept there only
    url = f"{scheme}://{user}{host}{port}/x?a=1&{parameter}={_raw_or_encoded(secret, encoded)}"
    assert redact_url(f"{url}&sslmode=require") == (
        f"{scheme}://{user}{host}{port}/x?a=1&{parameter}={MASK}&sslmode=require"
    )


@settings(max_examples=200)
@given(
    schemes=st.lists(st.sampled_from(NATS_SCHEMES), min_size=2, max_size=3),
    password=passwords.filter(lambda p: "," not in p),
)
def test_each_of_several_nats_servers_is_masked(schemes: list[str], password: str) -> None:
    url = ",".join(f"{s}://lapse:{password}@n{i}:4222" for i, s in enumerate(schemes))
    assert redact_url(url) == ",".join(
        f"{s}://lapse:{MASK}@n{i}:4222" for i, s in enumerate(schemes)
    )


@settings(max_examples=150)
@given(
    scheme=st.sampled_from(DATABASE_SCHEMES + NATS_SCHEMES + ENDPOINT_SCHEMES),
    user=users, password=passwords, host=hosts, port=ports, path=paths,
)  # fmt: skip
def test_a_url_in_a_log_line_or_traceback_loses_its_password(
    scheme: str, user: str, password: str, host: str, port: str, path: str
) -> None:
    # Free text is read line by line, and a new URL starts only after a separator: a
    # password with a line break or `://` in it is only masked in a known URL value.
    assume("\n" not in password and "://" not in password)
    url = f"{scheme}://{user}:{password}@{host}{port}{path}"
    text = (
        f"Traceback (most recent call last):\n  File 'x.py', line 3, in connect\n"
        f"OSError: cannot reach {url} (attempt 3 of 5)\n  @dataclass\n"
    )
    shown = redact(text)
    expected = f"{scheme}://{user}:{MASK}@{host}{port}{path}"
    assert shown == text.replace(url, expected)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # The finding: a raw `/` (SQLAlchemy reads the password up to the `@`).
        ("postgresql://kfp:pa/ss@db:5432/mlpipeline", "postgresql://kfp:***@db:5432/mlpipeline"),
        ("mysql://root:a@b:c#d?e f%g@db/x", "mysql://root:***@db/x"),
        ("postgresql://kfp:pässwörd/ü@db/x", "postgresql://kfp:***@db/x"),
        ("nats://s3cr3t-t0ken@nats:4222", "nats://***@nats:4222"),
        ("https://AKIA123:abc/def+ghi@minio:9000", "https://AKIA123:***@minio:9000"),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=beef",
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***",
        ),
        ("postgresql://kfp@db/x?sslpassword=p@ss", "postgresql://kfp@db/x?sslpassword=***"),
        ("postgresql://kfp@db/mlpipeline", "postgresql://kfp@db/mlpipeline"),
        ("sqlite:////var/lib/lapse/kfp.db", "sqlite:////var/lib/lapse/kfp.db"),
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_log_record_with_a_raw_slash_password_is_masked() -> None:
    import logging

    record = logging.LogRecord(
        "x", logging.INFO, __file__, 1, "connecting to %s", ("mysql://u:pa/ss@db/x",), None
    )
    assert RedactingFilter().filter(record)
    assert record.getMessage() == "connecting to mysql://u:***@db/x"


@pytest.mark.parametrize("secret", ["a@b/c", "p@ss:w0rd@db", "x y@z"])
def test_an_unencoded_at_sign_in_a_query_secret_never_shows_it(secret: str) -> None:
    shown = redact_url(f"postgresql://kfp:pw@db:5432/x?sslpassword={secret}&sslmode=require")
    assert shown is not None and secret not in shown and ":pw@" not in shown
    assert shown.startswith("postgresql://kfp:***@")


def test_an_empty_host_still_ends_the_userinfo_and_a_digest_is_no_userinfo() -> None:
    # A Unix-socket database URL; an image digest after a URL in a log line.
    socket = "postgresql://kfp:p@ss/w@/mlpipeline?host=/run/postgresql"
    assert redact_url(socket) == "postgresql://kfp:***@/mlpipeline?host=/run/postgresql"
    assert redact(f"cannot reach {socket} now") == (
        "cannot reach postgresql://kfp:***@/mlpipeline?host=/run/postgresql now"
    )
    line = "cluster https://127.0.0.1:6443 (context lapse); image ghcr.io/x@sha256:0123abc"
    assert redact(line) == line
