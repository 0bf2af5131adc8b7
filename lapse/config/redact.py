"""The one way lapse shows a URL or a text that may hold one: without its credentials.

`nats.url` may carry a user and password or a token (`nats://lapse:secret@host:4222`,
`nats://token@host`), and `database.url` a password; lapse prints URLs in `lapse status`,
its start-up log and its errors. Every such place goes through `redact`, so a secret is
never printed: the password (or a NATS token) becomes `***`, the user name stays (it says
which identity was used).
"""

from __future__ import annotations

import logging
import re
from typing import Final

MASK: Final = "***"

# scheme://userinfo@ anywhere in a text. The userinfo is everything up to the last `@`
# before the host: a password may itself contain `@` or `:` when not percent-encoded.
_CREDENTIALS = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s/?#,'\"]*)@")
# A token alone in a NATS URL is a secret; a user alone in a database URL is not.
_TOKEN_SCHEMES: Final = ("nats://", "tls://", "ws://", "wss://")
# Query parameters that carry a secret (SQLAlchemy passes them to the driver).
_SECRET_QUERY = re.compile(r"(?i)([?&](?:password|passwd|pwd|token|secret)=)[^&\s'\"]*")


def _userinfo(match: re.Match[str]) -> str:
    scheme, userinfo = match["scheme"], match["userinfo"]
    user, sep, _password = userinfo.partition(":")
    if sep:
        return f"{scheme}{user}:{MASK}@"
    if scheme.lower() in _TOKEN_SCHEMES:
        return f"{scheme}{MASK}@"
    return match[0]


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it masked (several URLs, comma-separated
    or in a sentence, each)."""
    if "://" not in text:
        return text
    return _SECRET_QUERY.sub(rf"\1{MASK}", _CREDENTIALS.sub(_userinfo, text))


def redact_url(url: str | None) -> str | None:
    return None if url is None else redact(url)


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
