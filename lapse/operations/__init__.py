"""Operations on a running deployment: reconcile (backfill and safety net) and reading the
audit trail and pending schedules."""
