"""The row-reaper's database edge: schema checks at start-up, then the deletes.

At start-up every table and column a target names is looked up in the reflected schema;
anything missing (or of a type a run's key cannot be compared with) fails at once with a
`SchemaMismatch` naming the configuration key. Statements are then built with SQLAlchemy
Core from the reflected `Table` objects: identifiers come from the reflection, values are
bound parameters, and nothing from an event is ever part of SQL text.

Deleting: one transaction per call, whatever number of runs it carries (`IN (...)` per
table). Per-run counts come from `DELETE ... RETURNING` where the dialect has it
(PostgreSQL, MariaDB, SQLite), otherwise from a locking `SELECT ... GROUP BY` before the
DELETE. A failed batch is retried run by run, so one bad run cannot hold back the others.
A transaction first locks and judges every run (its parent rows `FOR UPDATE`, held to the
run's namespace and to its precondition, data: functions/row_reaper/verdict.py), then
deletes what stands (store.py: `_transaction`; guard.py, footprints.py, delete.py; the
ledger they share is batch.py's `Batch`).
`CoalescingRowStore` (coalesce.py) is the front the row-reaper is given: the deletes of
runs handled concurrently share transactions, no two runs naming one uid or row key.
Database trouble is classified here, because only this module knows the drivers' errors:
`Unavailable` (retry later: unreachable, deadlock, lock timeout, shutdown) or `Rejected`
(retrying cannot help: bad data, a foreign key from an undeclared table).
"""

from lapse.edges.rows.coalesce import CoalescingRowStore
from lapse.edges.rows.failures import classify_failure
from lapse.edges.rows.reflect import SchemaMismatch
from lapse.edges.rows.store import DatabaseUnavailable, SqlRowStore, open_row_store

__all__ = [
    "CoalescingRowStore",
    "DatabaseUnavailable",
    "SchemaMismatch",
    "SqlRowStore",
    "classify_failure",
    "open_row_store",
]
