"""The relay's statements: take a batch of due outbox rows under a lease, mark them published.

Each with the guarantee it gives; the relay's loop (`outbox.relay.loop`) decides when to run
them and owns the transactions.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

CLAIM_DUE_OUTBOX: TextClause = text(
    """
    -- Take a batch of due, unpublished rows that no relay holds, and hold them for
    -- :lease_seconds: committed at once, so the publish that follows runs with no transaction
    -- open. SKIP LOCKED and the lease keep concurrent relays on disjoint rows; selecting by
    -- state (not by id > last seen) never skips a late-committing row. A relay that dies
    -- before marking leaves its rows to whichever relay comes after the lease (a second
    -- publish is harmless: the worker's claim refuses a finished or held key). With :traced
    -- (tracing on) each row brings its event's stored trace context; off, the lookup never runs.
    -- A delivery's first row (created in the statement that created its key: at intake or a
    -- backfill, never a retry, re-drive, replay or lane wake) names its event, so the relay
    -- can carry an event's deliveries in one message.
    WITH due AS (
        SELECT id, created_at
          FROM outbox
         WHERE published_at IS NULL AND available_at <= now()
           AND (claimed_until IS NULL OR claimed_until < now())
         ORDER BY available_at, id
         LIMIT :limit
           FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox o
       SET claimed_until = now() + make_interval(secs => :lease_seconds),
           publish_attempts = o.publish_attempts + 1
      FROM due
     WHERE o.id = due.id AND o.created_at = due.created_at  -- the row's day: one partition
    RETURNING o.id, o.idempotency_key, o.task_name, o.correlation_id, o.available_at,
              o.created_at,
              EXTRACT(EPOCH FROM now() - o.available_at)::float8 AS waited_seconds,
              CASE WHEN :traced THEN (SELECT e.trace_context
                                        FROM idempotency_keys k
                                        JOIN events e ON e.idempotency_key
                                                       = COALESCE(k.event_key, k.idempotency_key)
                                       WHERE k.idempotency_key = o.idempotency_key)
              END AS trace_context,
              (SELECT k.event_key
                 FROM idempotency_keys k
                WHERE k.idempotency_key = o.idempotency_key
                  AND k.created_at = o.created_at) AS event_key
    """
)

# How long until the earliest row nobody holds falls due (negative: overdue; NULL: none).
_NEXT_DUE = """
    SELECT EXTRACT(EPOCH FROM min(available_at) - now()) AS seconds
      FROM outbox
     WHERE published_at IS NULL AND (claimed_until IS NULL OR claimed_until < now())
"""

MARK_PUBLISHED: TextClause = text(
    f"""
    -- After the send: a row is marked only once its message is in the broker. In the same
    -- round trip, the relay's idle check (SECONDS_UNTIL_NEXT_DUE): the rows this statement
    -- marks still read as held, by the snapshot it started with, so they are not counted.
    -- The batch's span of creation times (:oldest to :newest) leaves out every day partition
    -- outside it before the ids are looked up.
    WITH marked AS (
        UPDATE outbox
           SET published_at = now(), claimed_until = NULL
         WHERE id = ANY(:ids) AND created_at BETWEEN :oldest AND :newest
           AND published_at IS NULL
    )
    {_NEXT_DUE}
    """
)

RELEASE_OUTBOX_CLAIM: TextClause = text(
    """
    -- The broker refused a batch: give its unsent rows back at once instead of at the end
    -- of the lease, so any relay may try them again after its backoff.
    UPDATE outbox
       SET claimed_until = NULL
     WHERE id = ANY(:ids) AND created_at BETWEEN :oldest AND :newest
       AND published_at IS NULL
    """
)

SECONDS_UNTIL_NEXT_DUE: TextClause = text(
    f"""
    -- How long the relay may sleep before a row nobody holds falls due (a retry, or a row
    -- whose holder's lease ended). Rows another relay holds are that relay's to publish; if
    -- it dies, the poll finds them once its lease is over.
    {_NEXT_DUE}
    """
)

TAKE_OR_KEEP_LEAD: TextClause = text(
    """
    -- The relays' lead (outbox/relay/lead.py): renew it for :seconds when :holder holds it,
    -- take it when it is free, has run out, or its holder's server process is gone (the
    -- holder died and the server saw its connection close; through a transaction pool that
    -- process outlives the holder, and the lease alone applies), otherwise leave it. One row
    -- comes back when :holder holds the lead after the statement, none when another relay
    -- does. The upsert's row lock orders two relays that try at once: the second sees the
    -- first's lead.
    INSERT INTO relay_lead (id, holder, held_until, backend_pid)
    VALUES (1, :holder, now() + make_interval(secs => :seconds), pg_backend_pid())
    ON CONFLICT (id) DO UPDATE
       SET holder = EXCLUDED.holder,
           held_until = EXCLUDED.held_until,
           backend_pid = EXCLUDED.backend_pid,
           taken_at = CASE WHEN relay_lead.holder = EXCLUDED.holder
                           THEN relay_lead.taken_at ELSE now() END
     WHERE relay_lead.holder = EXCLUDED.holder
        OR relay_lead.held_until < now()
        OR NOT EXISTS (SELECT FROM pg_stat_activity a WHERE a.pid = relay_lead.backend_pid)
    RETURNING holder
    """
)

RESIGN_LEAD: TextClause = text(
    """
    -- A relay that stops gives its lead up at once, so a standby takes it at its next check
    -- instead of when the lease runs out. Only its own: a lead another relay took stays.
    UPDATE relay_lead SET held_until = '-infinity' WHERE id = 1 AND holder = :holder
    """
)
