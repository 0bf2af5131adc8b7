"""What a database error means for a run: `Unavailable` (retry later) or `Rejected`."""

from __future__ import annotations

from typing import Final

from sqlalchemy import exc as sa_exc

from lapse.functions.row_reaper.ports import Rejected, Unavailable

# SQLSTATE classes where the same statement fails again: data exception, integrity
# violation, syntax or access rule, check option. Every other class (connection, rollback,
# resources, lock not available, shutdown, system error) may succeed later.
_PG_PERMANENT: Final = frozenset({"22", "23", "42", "44"})
# Too many connections, shutdown, lock wait timeout, deadlock, read-only (fail-over),
# interrupted, connection killed, max_execution_time, idle disconnect; 2xxx are client
# (connection) errors.
_MYSQL_TRANSIENT: Final = frozenset({1040, 1053, 1205, 1213, 1290, 1317, 1792, 1927, 3024, 4031})
# Access denied, unknown column, table/column privilege, no such table, foreign keys.
_MYSQL_PERMANENT: Final = frozenset({1044, 1045, 1054, 1142, 1143, 1146, 1451, 1452})
# Lost a race (serialization failure, deadlock, lock timeout): worth one immediate retry.
_PG_CONFLICTS: Final = frozenset({"40001", "40P01", "55P03"})
_MYSQL_CONFLICTS: Final = frozenset({1205, 1213})
_PERMANENT_CLASSES: Final = (
    sa_exc.DataError,
    sa_exc.IntegrityError,
    sa_exc.ProgrammingError,
    sa_exc.NotSupportedError,
)
DATABASE_ERRORS: Final = (sa_exc.SQLAlchemyError, OSError, TimeoutError)


def classify_failure(exc: BaseException) -> Unavailable | Rejected:
    """Retry later, or give up on this run? Re-raises what is lapse's own bug."""
    if isinstance(exc, sa_exc.SQLAlchemyError) and not isinstance(
        exc, sa_exc.DBAPIError | sa_exc.TimeoutError | sa_exc.DisconnectionError
    ):
        raise exc  # a statement lapse built wrongly: a bug, not the database's doing
    if isinstance(exc, TimeoutError):
        return Unavailable("the database did not answer in time")
    if not isinstance(exc, sa_exc.DBAPIError):
        return Unavailable(f"database unreachable: {_one_line(exc)}")
    original = exc.orig if exc.orig is not None else exc
    # asyncpg's errors arrive re-wrapped by SQLAlchemy's adapter; the cause reads better.
    cause = original.__cause__
    reason = _one_line(cause if isinstance(cause, Exception) else original)
    if exc.connection_invalidated:
        return Unavailable(f"database connection lost: {reason}")
    sqlstate = getattr(original, "sqlstate", None)
    if isinstance(sqlstate, str) and len(sqlstate) == 5:
        return _of_sqlstate(sqlstate, reason)
    errno = original.args[0] if original.args and isinstance(original.args[0], int) else None
    return _of_errno(exc, errno, reason)


def _of_sqlstate(sqlstate: str, reason: str) -> Unavailable | Rejected:
    """PostgreSQL's answer, by its SQLSTATE class."""
    if sqlstate[:2] in _PG_PERMANENT:
        return Rejected(f"the database refused the delete: {reason} (SQLSTATE {sqlstate})")
    if sqlstate.startswith("08"):
        return Unavailable(f"database unreachable: {reason} (SQLSTATE {sqlstate})")
    return Unavailable(f"database error, will retry: {reason} (SQLSTATE {sqlstate})")


def _of_errno(exc: sa_exc.DBAPIError, errno: int | None, reason: str) -> Unavailable | Rejected:
    """MySQL's and MariaDB's answer, by its error number (and SQLAlchemy's class)."""
    if errno is not None and 2000 <= errno < 3000:  # the client's own: connection errors
        return Unavailable(f"database unreachable: {reason}")
    if errno in _MYSQL_TRANSIENT:
        return Unavailable(f"database error, will retry: {reason}")
    if isinstance(exc, _PERMANENT_CLASSES) or errno in _MYSQL_PERMANENT:
        return Rejected(f"the database refused the delete: {reason}")
    # Unknown: retrying is the safe side (the runtime dead-letters after its tries).
    return Unavailable(f"database error, will retry: {reason}")


def is_conflict(exc: BaseException) -> bool:
    """Deadlock, serialization failure or lock timeout: this transaction lost a race."""
    original = exc.orig if isinstance(exc, sa_exc.DBAPIError) else None
    if original is None:
        return False
    if getattr(original, "sqlstate", None) in _PG_CONFLICTS:
        return True
    return bool(original.args) and original.args[0] in _MYSQL_CONFLICTS


def _one_line(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 500 else text[:497] + "..."
