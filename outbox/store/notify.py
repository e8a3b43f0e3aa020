"""The statements behind notifications: the notifier's lock, its cursors, the history it reads
and the notices it writes and sends.

History is read in `(created_at, id)` order after a cursor and before a horizon: the start of
the oldest transaction still running (`HORIZON`), never more than `:max_lag` seconds back. A
row's `created_at` is its transaction's start (`now()`), so every row not yet committed is at
or after the horizon, and a row that commits late is read on a later pass, never skipped; an
id alone could be passed by a higher one that committed first. A transaction open longer than
`:max_lag` stops holding the horizon back (notices come at most that late).
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

TRY_NOTIFY_LOCK: TextClause = text(
    """
    -- One notifier cluster-wide: a session lock, held across the pass's sends (no
    -- transaction stays open during an HTTP call) and gone with the connection if it dies.
    SELECT pg_try_advisory_lock(:lock_id)
    """
)

NOTIFY_UNLOCK: TextClause = text("SELECT pg_advisory_unlock(:lock_id)")

HORIZON: TextClause = text(
    """
    -- Rows created before this are committed or gone: no transaction of this database that
    -- started earlier is still running (ours aside). Run it in a statement before the reads,
    -- so their snapshot is taken after it and sees every transaction it did not.
    SELECT GREATEST(now() - make_interval(secs => :max_lag),
                    LEAST(now(), (SELECT min(xact_start) FROM pg_stat_activity
                                   WHERE datname = current_database()
                                     AND pid <> pg_backend_pid()
                                     AND xact_start IS NOT NULL))) AS horizon
    """
)

READ_CURSOR: TextClause = text(
    """
    -- Where a source of notices was read up to (the row is created on first use, :back
    -- seconds before now).
    WITH created AS (
        INSERT INTO notify_cursors (name, position_at)
        VALUES (:name, now() - make_interval(secs => :back))
        ON CONFLICT (name) DO NOTHING
        RETURNING position_at, position
    )
    SELECT position_at, position FROM created
    UNION ALL
    SELECT position_at, position FROM notify_cursors WHERE name = :name
    """
)

MOVE_CURSOR: TextClause = text(
    """
    -- The source was read up to here; in the transaction that wrote its notices.
    UPDATE notify_cursors SET position_at = :at, position = :position, updated_at = now()
     WHERE name = :name
    """
)

NEW_DEAD_LETTERS: TextClause = text(
    """
    -- Dead letters written after the cursor and before the horizon, oldest first, at most
    -- :batch (through dead_letters_created_idx), with their key's route.
    SELECT d.id, d.created_at, d.idempotency_key, d.kind, d.error_code, k.route
      FROM dead_letters d
      JOIN idempotency_keys k ON k.idempotency_key = d.idempotency_key
     WHERE d.created_at >= :at AND (d.created_at, d.id) > (:at, :position)
       AND d.created_at < :horizon
     ORDER BY d.created_at, d.id
     LIMIT :batch
    """
)

NEW_ROUTE_CHANGES: TextClause = text(
    """
    -- Pauses, resumes and circuit transitions after the cursor and before the horizon.
    SELECT id, created_at, route, action, reason, requested_by
      FROM route_changes
     WHERE created_at >= :at AND (created_at, id) > (:at, :position) AND created_at < :horizon
     ORDER BY created_at, id
     LIMIT :batch
    """
)

OPEN_BATCH: TextClause = text(
    """
    -- The target's dead-letter notice not yet sent, to add a batch to (one at most: the
    -- notifier writes one only when none is open), and when the target was last told.
    SELECT o.id AS open_id, o.payload AS open_payload,
           (SELECT max(sent_at) FROM notices
             WHERE target = :target AND kind = 'dead_letters') AS last_sent_at
      FROM (SELECT 1) AS one
      LEFT JOIN LATERAL (
           SELECT id, payload FROM notices
            WHERE target = :target AND kind = 'dead_letters' AND sent_at IS NULL
            ORDER BY id LIMIT 1) AS o ON true
    """
)

INSERT_NOTICE: TextClause = text(
    """
    -- A notice, once: a second writer of the same change finds its dedupe_key taken.
    INSERT INTO notices (target, kind, dedupe_key, payload, due_at)
    VALUES (:target, :kind, :dedupe_key, CAST(:payload AS jsonb),
            GREATEST(now(), COALESCE(CAST(:due_at AS timestamptz), now())))
    ON CONFLICT (dedupe_key) DO NOTHING
    RETURNING id
    """
)

GROW_NOTICE: TextClause = text(
    """
    -- More dead letters into the target's open batch, while it is still unsent.
    UPDATE notices SET payload = CAST(:payload AS jsonb)
     WHERE id = :id AND sent_at IS NULL
    RETURNING id
    """
)

DUE_NOTICES: TextClause = text(
    """
    -- Unsent notices whose time has come, the oldest due first (notices_due_idx).
    SELECT id, target, kind, payload, tries, created_at
      FROM notices
     WHERE sent_at IS NULL AND due_at <= now()
     ORDER BY due_at, id
     LIMIT :batch
    """
)

MARK_SENT: TextClause = text(
    """
    -- The target answered 2xx: the notice is done.
    UPDATE notices SET sent_at = now(), tries = tries + 1, last_error = NULL
     WHERE id = :id AND sent_at IS NULL
    """
)

MARK_FAILED: TextClause = text(
    """
    -- The target did not take it: try again after :delay seconds.
    UPDATE notices
       SET tries = tries + 1, last_error = :error,
           due_at = now() + make_interval(secs => :delay)
     WHERE id = :id AND sent_at IS NULL
    """
)
