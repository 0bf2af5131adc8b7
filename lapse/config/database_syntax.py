"""Which databases lapse supports, checked without SQLAlchemy: the configuration's view.

Every function reads the same lapse.yaml, and only the row-reaper connects to a database,
so the check `database.url` gets at load time must not need SQLAlchemy: the other functions'
images do not carry it (images/README.md, "What each function image carries"). The grammar
is SQLAlchemy 2.0's own (`sqlalchemy.engine.url._parse_url`, and its integer port), so a
URL accepted here is one the database edge parses (`lapse.config.database_url.async_url`);
tests/unit/test_database_syntax.py holds the two to the same answers.
"""

from __future__ import annotations

import re

from lapse.errors import LapseError

# Plain dialects and the async driver each means; an explicit `dialect+driver` is kept.
ASYNC_DRIVERS = {
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "mysql": "mysql+aiomysql",
    "mariadb": "mysql+aiomysql",
    "sqlite": "sqlite+aiosqlite",
}

_URL = re.compile(
    r"""
        (?P<name>[\w\+]+)://
        (?:
            (?P<username>[^:/]*)
            (?::(?P<password>[^@]*))?
        @)?
        (?:
            (?:
                \[(?P<ipv6host>[^/\?]+)\] |
                (?P<ipv4host>[^/:\?]+)
            )?
            (?::(?P<port>[^/\?]*))?
        )?
        (?:/(?P<database>[^\?]*))?
        (?:\?(?P<query>.*))?
    """,
    re.X,
)


class DatabaseURLError(LapseError, ValueError):
    """The configured database URL cannot be used."""


def parses(url: str) -> bool:
    """Whether SQLAlchemy's `make_url` parses `url` (its pattern, then its integer port)."""
    match = _URL.match(url)
    if match is None:
        return False
    port = match.group("port")
    if port is not None:
        # SQLAlchemy refuses an empty port too (`host:`): not an integer.
        try:
            int(port)
        except ValueError:
            return False
    return True


def drivername(url: str) -> str:
    """The `dialect+driver` lapse connects with: an explicit driver kept, a plain dialect
    mapped to its async driver; DatabaseURLError (never echoing the URL) otherwise."""
    if not parses(url):
        # Not the text itself: it usually carries a password.
        raise DatabaseURLError("not a database URL (e.g. postgresql://user:password@host/db)")
    name = url.split("://", 1)[0]
    if "+" in name:
        return name
    driver = ASYNC_DRIVERS.get(name)
    if driver is None:
        supported = ", ".join(sorted(ASYNC_DRIVERS))
        raise DatabaseURLError(f"unsupported database '{name}' (use {supported})")
    return driver
