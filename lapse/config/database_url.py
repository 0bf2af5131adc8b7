"""The SQLAlchemy URL lapse connects with: the async driver each plain URL means.

Users write the URL they know (postgresql://, mysql://, sqlite:///); lapse needs an async
driver for each, so plain dialects are mapped to one and an explicit driver is kept
(`lapse.config.database_syntax`, which the configuration checks `database.url` with at load
time, without SQLAlchemy). The database edge connects with the URL this returns.
"""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url

from lapse.config.database_syntax import ASYNC_DRIVERS, DatabaseURLError

__all__ = ["DatabaseURLError", "async_url"]


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
    driver = ASYNC_DRIVERS.get(parsed.drivername)
    if driver is None:
        supported = ", ".join(sorted(ASYNC_DRIVERS))
        raise DatabaseURLError(f"unsupported database '{parsed.drivername}' (use {supported})")
    return parsed.set(drivername=driver)
