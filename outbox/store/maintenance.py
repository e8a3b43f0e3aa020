"""The maintenance statements: the sweeper's re-drives and the purge's bounded deletes.

The sweeper (`outbox.maintenance.sweeper`) re-sends keys whose delivery was lost, one sweeper
at a time; the purge (`outbox.maintenance.purge`) forgets expired keys and old published outbox
rows in bounded batches. Callers own the transactions; nothing here commits.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

from outbox.store.claiming import LANDED

# -- sweeper ----------------------------------------------------------------------------------

TRY_SWEEPER_LOCK: TextClause = text(
    """
    -- One sweeper at a time: the lock is held until this transaction ends.
    SELECT pg_try_advisory_xact_lock(:lock_id)
    """
)

REDRIVE_EXPIRED_LEASES: TextClause = text(
    f"""
    -- Worker keys whose holder stopped renewing (crashed, killed, partitioned): queue a new
    -- delivery (a workflow's expired claim is left to its workflow's next claim).
    -- The next claim takes over the lease with a newer fence and reconciles first. A key with
    -- an unpublished row is left alone, and each re-send since the claim waits twice as long
    -- as the one before (grace, 2x, 4x ... 64x): a queue that is merely slow gets a few copies,
    -- not one per pass. Not before a request of the last holder can no longer land.
    WITH expired AS (
        SELECT k.idempotency_key, k.correlation_id
          FROM idempotency_keys k
          CROSS JOIN LATERAL (
              SELECT count(*) FILTER (WHERE o.created_at >= k.updated_at) AS resent,
                     COALESCE(bool_or(o.published_at IS NULL), false) AS waiting,
                     max(o.created_at) AS last_queued
                FROM outbox o WHERE o.idempotency_key = k.idempotency_key) sent
         WHERE k.status = 'processing' AND k.locked_until < now() AND k.actor = 'worker'
           AND {LANDED}
           AND NOT sent.waiting
           AND (sent.resent = 0
                OR sent.last_queued < now() - make_interval(
                       secs => :grace_seconds * power(2, LEAST(sent.resent - 1, 6))))
         LIMIT :limit
           FOR UPDATE OF k SKIP LOCKED
    )
    INSERT INTO outbox (idempotency_key, task_name, correlation_id)
    SELECT idempotency_key, :task_name, correlation_id FROM expired
    RETURNING idempotency_key
    """
)

REDRIVE_STALLED_KEYS: TextClause = text(
    f"""
    -- Keys waiting for a delivery whose message was published but never consumed (Redis
    -- restarted or flushed): pending or due for a retry, untouched for the grace period, no
    -- unpublished row, and the last message older than the grace period doubled for each
    -- re-send since the key's last change (so a slow queue is not flooded with copies). A key
    -- whose rows the retention pruned was last sent long ago. Not before a request of its
    -- last attempt can no longer land.
    WITH stalled AS (
        SELECT k.idempotency_key, k.correlation_id
          FROM idempotency_keys k
          CROSS JOIN LATERAL (
              SELECT count(*) FILTER (WHERE o.created_at >= k.updated_at) AS queued,
                     COALESCE(bool_or(o.published_at IS NULL), false) AS waiting,
                     max(o.published_at) AS last_published
                FROM outbox o WHERE o.idempotency_key = k.idempotency_key) sent
         WHERE k.status IN ('pending', 'failed_retryable') AND k.actor = 'worker'
           AND k.updated_at < now() - make_interval(secs => :grace_seconds)
           -- A paused route holds its keys on purpose; resuming queues them. A key parked
           -- behind its lane is handed on by its lane (WAKE_IDLE_LANES looks after idle ones).
           AND k.error_code IS DISTINCT FROM 'lane_waiting'
           AND NOT EXISTS (SELECT 1 FROM route_state r WHERE r.route = k.route AND r.paused)
           AND (k.next_attempt_at IS NULL
                OR k.next_attempt_at < now() - make_interval(secs => :grace_seconds))
           AND {LANDED}
           AND NOT sent.waiting
           AND COALESCE(sent.last_published, '-infinity') < now() - make_interval(
                   secs => :grace_seconds * power(2, LEAST(GREATEST(sent.queued - 1, 0), 6)))
         LIMIT :limit
           FOR UPDATE OF k SKIP LOCKED
    )
    INSERT INTO outbox (idempotency_key, task_name, correlation_id)
    SELECT idempotency_key, :task_name, correlation_id FROM stalled
    RETURNING idempotency_key
    """
)

# -- purge ------------------------------------------------------------------------------------

STATEMENT_TIMEOUT_SECONDS: TextClause = text(
    """
    -- The statement timeout this connection runs under, in seconds (0: none); the purge
    -- sizes its batches against it.
    SELECT CAST(setting AS float8) / 1000 FROM pg_settings WHERE name = 'statement_timeout'
    """
)

COUNT_PURGEABLE: TextClause = text(
    f"""
    -- What PURGE_EXPIRED_KEYS would remove, counted (the same conditions).
    SELECT count(*) FROM idempotency_keys k
     WHERE k.expires_at < now()
       AND k.updated_at + (k.expires_at - k.created_at) < now()
       AND NOT k.uncertain AND {LANDED}
       AND (k.status IN ('succeeded', 'failed_final', 'quarantined', 'superseded')
            OR (k.actor = 'workflow' AND k.status IN ('pending', 'failed_retryable'))
            OR (k.status = 'fanned_out'
                AND NOT EXISTS (SELECT 1 FROM idempotency_keys v
                                 WHERE v.event_key = k.idempotency_key)))
       AND NOT EXISTS (SELECT 1 FROM dead_letters d
                        WHERE d.idempotency_key = k.idempotency_key AND d.resolution = 'open')
    """
)

PURGE_EXPIRED_KEYS: TextClause = text(
    f"""
    -- Expired keys go with their event, outbox rows and resolved dead letters (cascade), a
    -- bounded batch at a time. A key expires its TTL after its last change (the TTL is
    -- expires_at - created_at, fixed when the key was made; expires_at < now() is implied and
    -- lets the index find them). Finished keys go, and workflow keys waiting for a claim that
    -- never came (their workflow gave up). Never a key that may have had its effect
    -- (uncertain), never a processing key (live lease or not: its holder may be acting), never
    -- a worker key still on its way (the sweeper drives it to an end first), never a key with
    -- an open dead letter. A fan-out event's key goes once none of its deliveries is left
    -- (each is a key of its own, purged by these rules). The row lock and the conditions are
    -- one statement, so a key a claim takes meanwhile is skipped.
    WITH doomed AS (
        SELECT k.idempotency_key FROM idempotency_keys k
         WHERE k.expires_at < now()
           AND k.updated_at + (k.expires_at - k.created_at) < now()
           AND NOT k.uncertain AND {LANDED}
           AND (k.status IN ('succeeded', 'failed_final', 'quarantined', 'superseded')
                OR (k.actor = 'workflow' AND k.status IN ('pending', 'failed_retryable'))
                OR (k.status = 'fanned_out'
                    AND NOT EXISTS (SELECT 1 FROM idempotency_keys v
                                     WHERE v.event_key = k.idempotency_key)))
           AND NOT EXISTS (SELECT 1 FROM dead_letters d
                            WHERE d.idempotency_key = k.idempotency_key
                              AND d.resolution = 'open')
         LIMIT :limit
           FOR UPDATE SKIP LOCKED
    )
    DELETE FROM idempotency_keys k USING doomed
     WHERE k.idempotency_key = doomed.idempotency_key
    RETURNING k.idempotency_key
    """
)

COUNT_PRUNABLE_OUTBOX: TextClause = text(
    f"""
    -- What PRUNE_PUBLISHED_OUTBOX would remove. Rows of keys the purge removes anyway go with
    -- them (cascade), and those of the days it drops whole (:dropping, partition names) with
    -- their day; neither is counted here.
    SELECT count(*) FROM outbox o
     WHERE o.published_at < now() - make_interval(secs => :retention_seconds)
       AND CAST(o.tableoid AS regclass)::text <> ALL(CAST(:dropping AS text[]))
       AND o.created_at < date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                          - make_interval(days => 1, secs => :retention_seconds)
       AND NOT EXISTS (
           SELECT 1 FROM idempotency_keys k
            WHERE k.idempotency_key = o.idempotency_key
              AND k.expires_at < now()
              AND k.updated_at + (k.expires_at - k.created_at) < now()
              AND NOT k.uncertain AND {LANDED}
              AND (k.status IN ('succeeded', 'failed_final', 'quarantined', 'superseded')
                   OR (k.actor = 'workflow' AND k.status IN ('pending', 'failed_retryable')))
              AND NOT EXISTS (SELECT 1 FROM dead_letters d
                               WHERE d.idempotency_key = k.idempotency_key
                                 AND d.resolution = 'open'))
    """
)

PRUNE_PUBLISHED_OUTBOX: TextClause = text(
    """
    -- Published rows are history once past the retention; a bounded batch at a time. A day's
    -- rows normally go with their day's partition (outbox.maintenance.partitions); this reaches
    -- only rows a day later than that: the DEFAULT partition's, and those of a day kept by a
    -- row still unpublished. The bound on created_at lets the plan skip every other day.
    DELETE FROM outbox o USING (
        SELECT id, created_at FROM outbox
         WHERE published_at < now() - make_interval(secs => :retention_seconds)
           AND created_at < date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                            - make_interval(days => 1, secs => :retention_seconds)
         LIMIT :limit
    ) old
     WHERE o.id = old.id AND o.created_at = old.created_at
    RETURNING o.id
    """
)
