"""The one NATS connection helper: reconnects that never give up, and the security the
configuration asks for (user/password, token, nkey seed, creds file; TLS with a CA and an
optional client certificate).

Secrets are read from their files when connecting (a rotated file is picked up by the next
start) and handed to nats-py only; they are never logged. A server that refuses lapse (a
wrong credential, a certificate it does not trust or lapse does not) is not an outage to
wait out: the first refusal ends the attempt with a `NatsRefused`, one line naming the key
to fix, which the command line reports with exit code 2. Anything else (the server not up
yet, the network) is retried for as long as it takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import APIError, BucketNotFoundError
from nats.js.kv import KeyValue

from lapse.config import ConfigError, NatsConfig
from lapse.config.redact import redact
from lapse.embedded.nats_identities import inbox_prefix

log = logging.getLogger(__name__)

# How soon a connection that went silent (black-holed: a firewall or NAT that dropped its
# state, a node gone without a reset) is known dead and replaced: a PING every
# PING_INTERVAL seconds, and the connection given up when MAX_OUTSTANDING_PINGS of them
# are unanswered, 20-30 s after it went silent. nats-py's defaults (120 s, 2) took 4-6
# minutes, in which `lapse up` fetched, acked and published into the void, and kept doing
# so after the network had mended, since only new connections pass then.
PING_INTERVAL = 10
MAX_OUTSTANDING_PINGS = 2
# A reconnect that is accepted and never answered (black-holed) gives up after this.
CONNECT_TIMEOUT = 5


class NatsRefused(ConfigError):
    """The NATS server refused lapse's credentials or TLS, or a secret file is unreadable:
    the configuration must change. `str()` is one line naming the key."""

    def __init__(self, problem: str) -> None:
        super().__init__([problem])


OPEN_SERVER_WARNING = (
    "NATS without authentication: anyone who can reach it can schedule deletions; "
    "see docs/security.md"
)


def authenticates(url: str, config: NatsConfig | None) -> bool:
    """Whether lapse presents a credential: a configured one, or one in the URL
    (`nats://user:password@host`, `nats://token@host`)."""
    if config is not None and config.auth_key is not None:
        return True
    return any("@" in server.partition("://")[2].split("/")[0] for server in url.split(","))


async def connect(url: str, *, name: str = "lapse", config: NatsConfig | None = None) -> NATS:
    """Connect with reconnects that never give up: a NATS restart must not end lapse. With
    `config`, authenticate and use TLS as it says; a refusal raises `NatsRefused`."""
    if not authenticates(url, config):
        # A server that admits anyone lets anyone put a due event: said at every start
        # (the one-shot commands' log hides it unless --debug; `lapse up`, serve, bridge,
        # the functions and the dead-letter sink show it).
        log.warning(OPEN_SERVER_WARNING)
    options = security_options(config) if config is not None else {}
    client = NATS()
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[str] = loop.create_future()
    connected = False

    async def on_error(exc: Exception) -> None:
        problem = refusal(exc, config)
        if problem is not None and not connected:
            if not refused.done():  # the same refusal may be reported again before we stop
                refused.set_result(problem)
            return
        # One line, without the traceback nats-py's default handler prints for each retry.
        # A reset while connecting is how a server that refuses us often hangs up before
        # its reason is read; the reason comes with the next try, so it is not news yet.
        quiet = not connected and isinstance(exc, ConnectionResetError)
        log.log(logging.DEBUG if quiet else logging.WARNING, "nats: %s", _one_line(exc))

    settings: dict[str, Any] = {
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": CONNECT_TIMEOUT,
        "ping_interval": PING_INTERVAL,
        "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
        "error_cb": on_error,
        **options,
    }
    # nats.url may name several servers, comma-separated (a cluster): nats-py takes them as
    # a list and fails over between them; given the text whole it refuses the URL.
    servers = [server.strip() for server in url.split(",") if server.strip()]
    attempt = asyncio.ensure_future(client.connect(servers, **settings))
    racing: set[asyncio.Future[Any]] = {attempt, refused}
    await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
    if attempt.done() and attempt.exception() is None:
        connected = True
        refused.cancel()
        return client
    attempt.cancel()
    with contextlib.suppress(BaseException):
        await attempt
    with contextlib.suppress(Exception):
        await client.close()
    if refused.done() and not refused.cancelled():
        raise NatsRefused(refused.result())
    raise attempt.exception() or RuntimeError("NATS connection attempt ended without a result")


def security_options(config: NatsConfig) -> dict[str, Any]:
    """nats-py's connect options for the configured authentication and TLS. Reads the
    secret files; an unreadable one raises `NatsRefused` naming its key."""
    options: dict[str, Any] = {}
    if config.user is not None:
        options["user"] = config.user
        # Inboxes of this identity's own, which no other may subscribe to (docs/deploy.md,
        # "NATS identities"): with the shared `_INBOX.`, another identity could learn
        # where lapse waits for its deliveries and send it some of its own.
        options["inbox_prefix"] = inbox_prefix(config.user)
        if config.password is not None:
            options["password"] = config.password.get_secret_value()
        elif config.password_file is not None:
            options["password"] = _secret_file(config.password_file, "nats.password_file")
    if config.token is not None:
        options["token"] = config.token.get_secret_value()
    elif config.token_file is not None:
        options["token"] = _secret_file(config.token_file, "nats.token_file")
    if config.nkey_file is not None:
        # Read here so a missing file is this key's error, not a signing failure later;
        # nats-py takes the seed as text.
        options["nkeys_seed_str"] = _secret_file(config.nkey_file, "nats.nkey_file")
    if config.creds_file is not None:
        _secret_file(config.creds_file, "nats.creds_file")  # readable now; nats-py reads it
        options["user_credentials"] = str(config.creds_file)
    tls = config.tls
    if tls.ca_file is not None or tls.cert_file is not None:
        options["tls"] = tls_context(config)
    return options


def tls_context(config: NatsConfig) -> ssl.SSLContext:
    tls = config.tls
    try:
        context = ssl.create_default_context(
            cafile=str(tls.ca_file) if tls.ca_file is not None else None
        )
    except (OSError, ssl.SSLError) as exc:
        raise NatsRefused(f"nats.tls.ca_file: cannot use {tls.ca_file}: {_reason(exc)}") from None
    if tls.cert_file is not None and tls.key_file is not None:
        try:
            context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
        except (OSError, ssl.SSLError) as exc:
            raise NatsRefused(
                f"nats.tls.cert_file: cannot use {tls.cert_file} with nats.tls.key_file "
                f"{tls.key_file}: {_reason(exc)}"
            ) from None
    return context


def refusal(exc: BaseException, config: NatsConfig | None) -> str | None:
    """The one-line problem when `exc` means the server refused lapse's credentials or TLS
    (configuration to fix); None for anything worth retrying."""
    text = str(exc).lower()
    if isinstance(exc, ssl.SSLCertVerificationError):
        ca = config.tls.ca_file if config is not None else None
        trusted = f"signed by nats.tls.ca_file ({ca})" if ca else "trusted by the system"
        return (
            f"nats.tls.ca_file: the NATS server's certificate is not {trusted}: "
            f"{exc.verify_message or _reason(exc)}"
        )
    if isinstance(exc, ssl.SSLError):
        has_cert = config is not None and config.tls.cert_file is not None
        key = "nats.tls.cert_file" if has_cert else "nats.tls"
        hint = "" if has_cert else " (the server may require a client certificate)"
        return f"{key}: the TLS handshake with the NATS server failed{hint}: {_reason(exc)}"
    if "authorization violation" in text or "authentication" in text:
        auth_key = config.auth_key if config is not None else None
        if auth_key is None:
            return (
                "nats.url: the NATS server requires authentication; set nats.user and "
                "nats.password_file, nats.token_file, nats.nkey_file or nats.creds_file"
            )
        return f"{auth_key}: the NATS server refused the credentials ({_one_line(exc)})"
    if "secure connection" in text and "required" in text:
        return f"nats.tls: {_one_line(exc)}"
    return None


def _secret_file(path: Path, key: str) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NatsRefused(f"{key}: cannot read {path}: {_reason(exc)}") from None
    value = text.strip()
    if not value:
        raise NatsRefused(f"{key}: {path} is empty")
    return value


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    text = redact(" ".join(str(exc).split())) or type(exc).__name__
    return text.removeprefix("nats: ").strip("'")


def max_payload(js: JetStreamContext) -> int | None:
    """The server's max_payload (headers and body of one message) from its INFO, or None
    when the context is not backed by a connected client."""
    client = getattr(js, "_nc", None)
    limit = getattr(client, "max_payload", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def unreachable(js: JetStreamContext) -> str | None:
    """Why the connection behind `js` is down now (nats-py reconnecting, with the last error
    it met), or None while it is up (or closed, on the way out)."""
    client = getattr(js, "_nc", None)
    if not isinstance(client, NATS) or client.is_connected or client.is_closed:
        return None
    last = client.last_error
    because = _one_line(last) if last is not None else "connection lost"
    return f"NATS unreachable, reconnecting ({because})"


async def key_value_bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    """The key-value bucket `config` names, created on first use. Every process may try at
    once: the one that loses the race (an APIError, perhaps for other settings) opens the
    bucket the winner made."""
    assert config.bucket is not None
    try:
        return await js.key_value(config.bucket)
    except BucketNotFoundError:
        try:
            return await js.create_key_value(config=config)
        except APIError:
            return await js.key_value(config.bucket)


class LazyBucket:
    """The key-value bucket `config` names, opened or made (`key_value_bucket`) on the first
    call and kept: a process that never uses a bucket never makes it."""

    def __init__(self, js: JetStreamContext, config: KeyValueConfig) -> None:
        self._js = js
        self._config = config
        self._kv: KeyValue | None = None

    async def __call__(self) -> KeyValue:
        if self._kv is None:
            self._kv = await key_value_bucket(self._js, self._config)
        return self._kv
