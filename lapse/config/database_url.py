"""Which databases lapse supports, and the async driver each plain URL means.

Users write the URL they know (postgresql://, mysql://, sqlite:///); lapse needs an async
driver for each, so plain dialects are mapped to one and an explicit driver is kept. The
configuration checks `database.url` with this at load time; the database edge connects
with the URL it returns.
"""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url

from lapse.errors import LapseError

_ASYNC_DRIVERS = {
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "mysql": "mysql+aiomysql",
    "mariadb": "mysql+aiomysql",
    "sqlite": "sqlite+aiosqlite",
}


class DatabaseURLError(LapseError, ValueError):
    """The configured database URL cannot be used."""


def async_url(url: str | URL) -> URL:
    try:
        parsed = make_url(url)
    except Exception:  # SQLAlchemy raises ArgumentError for anything unparseable
        # Not SQLAlchemy's message: it quotes the whole text, password included.
        raise DatabaseURLError(
            "not a database URL (e.g. postgresql://user:password@host/db)"
        ) from None
    if "+" in parsed.drivername:
        return parsed
    driver = _ASYNC_DRIVERS.get(parsed.drivername)
    if driver is None:
        supported = ", ".join(sorted(_ASYNC_DRIVERS))
        raise DatabaseURLError(f"unsupported database '{parsed.drivername}' (use {supported})")
    return parsed.set(drivername=driver)
