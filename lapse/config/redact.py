"""The one way lapse shows a URL or a text that may hold one: without its credentials.

`nats.url` may carry a user and password or a token (`nats://lapse:secret@host:4222`,
`nats://token@host`), `database.url` a password (in the userinfo or as `?password=`), an
S3 endpoint keys in its userinfo, a presigned URL its signature in the query. lapse prints
URLs in `lapse status`, its start-up log and its errors. Every such place goes through
`redact_url` (a value known to be a URL) or `redact` (any text: log records, error
messages, tracebacks), so a secret is never printed: the password, a token or a secret
query parameter becomes `***`; the scheme, user name (it says which identity was used),
host, port and database stay.

People paste passwords as they are, unencoded: `postgresql://kfp:a/b@c?d#e f@db/x` is
accepted by SQLAlchemy (its password runs to the `@`). So the userinfo is everything up to
the last `@` that a host follows, whatever characters it holds: a password never shows;
an unencoded `@` in a query string may mask the host too (less is shown, never more).
"""

from __future__ import annotations

import logging
import re
from typing import Final

MASK: Final = "***"

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# Where a URL starts in free text: a scheme at the start of a line or after a separator
# (not after `:` or a letter, so a `x://` inside a password is not taken for a new URL).
_URL_START = re.compile(r"(?:^|(?<=[\s,;'\"(\[<>=`|]))" + _SCHEME.pattern, re.MULTILINE)
# A user alone is not a secret in a database URL (`postgresql://kfp@db/x`: a password
# comes from elsewhere); anywhere else (`nats://token@host`, `https://token@host`) it is.
_USER_ONLY_SCHEMES: Final = ("postgresql", "postgres", "mysql", "mariadb", "sqlite")
# Query parameters that carry a secret: SQLAlchemy passes `password`/`sslpassword` to the
# driver; presigned S3/GCS/Azure URLs carry a signature, a session token, a credential.
_SECRET_NAME = (
    r"[\w.-]*(?:pass|pwd|secret|token|signature|credential|api_?key|private_?key)[\w.-]*"
    r"|sig|key|auth|code"
)
# In a URL value a secret runs to the next `&name=` or `#` (a raw `&` in a password stays
# masked); in free text also to a space or quote.
_SECRET_QUERY_VALUE = re.compile(rf"(?i)([?&;](?:{_SECRET_NAME})=)[^&#]*(?:&(?![\w.~%-]*=)[^&#]*)*")
_SECRET_QUERY_TEXT = re.compile(rf"(?i)([?&;](?:{_SECRET_NAME})=)[^&#\s'\"]*")
# Several NATS servers in one value: `nats://a:p@h1,nats://b:q@h2`.
_NEXT_SERVER = re.compile(r",(?=\s*" + _SCHEME.pattern + ")")


# What follows the userinfo's `@`: a host (name, address or [IPv6]) and maybe a port, then
# the path, query, fragment or the end (of the URL, or of a URL in a sentence).
# (An empty host too: `postgresql://kfp:pw@/mlpipeline?host=/run/postgresql`.)
_AUTHORITY = re.compile(r"(?:\[[\w:.%]*\]|[\w.~%-]*)(?::\d*)?(?=$|[/?#\s'\",;)>\]])")


def _userinfo_end(rest: str, *, whole_url: bool) -> int:
    """Where the userinfo ends: the last `@` a host follows (the true one is such an `@`,
    so a later one only masks more). With none, in a value known to be a URL the last `@`
    (to be safe), in free text -1 (`image@sha256:...` after a URL is no userinfo)."""
    at = len(rest)
    while (at := rest.rfind("@", 0, at)) >= 0:
        if _AUTHORITY.match(rest, at + 1):
            return at
    return rest.rfind("@") if whole_url else -1


def _mask_userinfo(url: str, *, whole_url: bool = True) -> str:
    """One URL (`url` starts with its scheme) with the userinfo masked."""
    scheme, _, rest = url.partition("://")
    at = _userinfo_end(rest, whole_url=whole_url)
    if at < 0:
        return url
    userinfo, host = rest[:at], rest[at + 1 :]
    user, colon, _password = userinfo.partition(":")
    if colon:
        shown = f"{user}:{MASK}"
    elif scheme.lower().partition("+")[0] in _USER_ONLY_SCHEMES:
        shown = userinfo
    else:
        shown = MASK
    return f"{scheme}://{shown}@{host}"


def redact_url(url: str | None) -> str | None:
    """A value known to be one URL (or several NATS servers, comma-separated) without its
    credentials, whatever characters its password holds."""
    if url is None:
        return None
    if not _SCHEME.match(url.lstrip()):
        return redact(url)
    servers = _NEXT_SERVER.split(url)
    return ",".join(
        _SECRET_QUERY_VALUE.sub(rf"\1{MASK}", _mask_userinfo(server)) for server in servers
    )


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it masked (several URLs, comma-separated
    or in a sentence, each). A URL in free text is taken to run to the next URL or the end
    of its line: a password may hold spaces, so a later `@` on the line masks up to it."""
    if "://" not in text:
        return text
    return "\n".join(_redact_line(line) for line in text.split("\n"))


def _redact_line(line: str) -> str:
    starts = [match.start() for match in _URL_START.finditer(line)]
    if not starts:
        return line
    parts = [line[: starts[0]]]
    for start, end in zip(starts, [*starts[1:], len(line)], strict=True):
        parts.append(_mask_userinfo(line[start:end], whole_url=False))
    return _SECRET_QUERY_TEXT.sub(rf"\1{MASK}", "".join(parts))


class RedactingFilter(logging.Filter):
    """Masks credentials in every log record's message, whoever logged it (lapse, nats-py,
    SQLAlchemy with --debug): installed on the handlers by the command line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            # The traceback is formatted once and cached on the record: mask that text.
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True
