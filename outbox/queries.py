"""The statements that carry the invariants, each with the guarantee it gives.

Every atomic step of a key's life is one statement here, with named binds. The receiver runs
them through an async connection, the relay and the worker through sync ones; the SQL is the
same. Stores own the transactions; nothing here commits.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

# -- receiver ---------------------------------------------------------------------------------

RESERVE_KEY: TextClause = text(
    """
    -- Reserve the key, store the event and write its outbox row in ONE statement: either all
    -- three exist at commit or none. A repeat is answered by the same statement: a known key
    -- with the same payload hash counts the repeat and returns the key's current state
    -- (`inserted` false: a new key's count is 0, a counted repeat's at least 1), and nothing
    -- else is written; a concurrent repeat waits for the first insert's transaction, then does
    -- the same. No row means the key is known with another payload (or was purged between).
    WITH reserved AS (
        INSERT INTO idempotency_keys (
            idempotency_key, payload_hash, correlation_id, source, event_type, route,
            workflow_name, execution_id, expires_at
        )
        VALUES (
            :key, :payload_hash, :correlation_id, :source, :event_type, :route,
            :workflow_name, :execution_id, now() + make_interval(secs => :ttl_seconds)
        )
        ON CONFLICT (idempotency_key) DO UPDATE
           SET duplicate_count = idempotency_keys.duplicate_count + 1
         WHERE idempotency_keys.payload_hash = EXCLUDED.payload_hash
        RETURNING idempotency_key, status, correlation_id, created_at, result, external_ref,
                  error_code, attempts, duplicate_count = 0 AS inserted
    ), stored AS (
        INSERT INTO events (idempotency_key, source, event_type, external_id, version, payload)
        SELECT idempotency_key, :source, :event_type, :external_id, :version,
               CAST(:payload AS jsonb)
          FROM reserved WHERE inserted
    ), queued AS (
        INSERT INTO outbox (idempotency_key, task_name, correlation_id)
        SELECT idempotency_key, :task_name, correlation_id FROM reserved WHERE inserted
    )
    SELECT * FROM reserved
    """
)

RESERVE_KEY_QUARANTINED: TextClause = text(
    """
    -- Like RESERVE_KEY for an event that breaks its route's contract: the key, the event and
    -- a dead letter of kind quarantined in ONE statement, and no outbox row, so no action runs.
    -- A repeat is counted and answered the same way.
    WITH reserved AS (
        INSERT INTO idempotency_keys (
            idempotency_key, status, payload_hash, correlation_id, source, event_type, route,
            workflow_name, execution_id, error_code, error_detail, first_failed_at, expires_at
        )
        VALUES (
            :key, 'quarantined', :payload_hash, :correlation_id, :source, :event_type, :route,
            :workflow_name, :execution_id, 'contract_violation', :error_detail, now(),
            now() + make_interval(secs => :ttl_seconds)
        )
        ON CONFLICT (idempotency_key) DO UPDATE
           SET duplicate_count = idempotency_keys.duplicate_count + 1
         WHERE idempotency_keys.payload_hash = EXCLUDED.payload_hash
        RETURNING idempotency_key, status, correlation_id, created_at, result, external_ref,
                  error_code, attempts, duplicate_count = 0 AS inserted
    ), stored AS (
        INSERT INTO events (idempotency_key, source, event_type, external_id, version, payload)
        SELECT idempotency_key, :source, :event_type, :external_id, :version,
               CAST(:payload AS jsonb)
          FROM reserved WHERE inserted
    ), dead AS (
        INSERT INTO dead_letters (idempotency_key, kind, error_code, error_detail, attempts,
                                  first_failed_at, last_failed_at)
        SELECT idempotency_key, 'quarantined', 'contract_violation', :error_detail, 0, now(),
               now()
          FROM reserved WHERE inserted
    )
    SELECT * FROM reserved
    """
)

KEY_EXISTS: TextClause = text(
    """
    -- Tells a payload conflict (the key exists) from a key purged just before RESERVE_KEY.
    SELECT 1 FROM idempotency_keys WHERE idempotency_key = :key
    """
)

GET_KEY: TextClause = text(
    """
    SELECT k.idempotency_key, k.status, k.attempts, k.result, k.external_ref, k.error_code,
           k.correlation_id, k.source, k.event_type, k.duplicate_count, k.created_at,
           k.updated_at, k.expires_at, k.next_attempt_at
      FROM idempotency_keys k
     WHERE k.idempotency_key = :key
    """
)

# -- relay ------------------------------------------------------------------------------------

FETCH_DUE_OUTBOX: TextClause = text(
    """
    -- Lock a batch of due, unpublished rows. SKIP LOCKED keeps concurrent relays on disjoint
    -- rows; selecting by state (not by id > last seen) never skips a late-committing row.
    SELECT id, idempotency_key, task_name, correlation_id
      FROM outbox
     WHERE published_at IS NULL AND available_at <= now()
     ORDER BY available_at, id
     LIMIT :limit
       FOR UPDATE SKIP LOCKED
    """
)

MARK_PUBLISHED: TextClause = text(
    """
    -- In the same transaction as the fetch: a row is marked only after its message was sent.
    UPDATE outbox
       SET published_at = now(), publish_attempts = publish_attempts + 1
     WHERE id = ANY(:ids)
    """
)

SECONDS_UNTIL_NEXT_DUE: TextClause = text(
    """
    -- How long the relay may sleep before a scheduled row (a retry) falls due.
    SELECT EXTRACT(EPOCH FROM min(available_at) - now())
      FROM outbox
     WHERE published_at IS NULL
    """
)

# -- worker -----------------------------------------------------------------------------------

CLAIM_KEY: TextClause = text(
    """
    -- Take the key if nobody holds it: pending, a due retry, or a processing key whose lease
    -- ran out. The lease comes from the database clock; the fence goes up so any earlier
    -- holder's writes are rejected from now on. Returns the event to act on.
    WITH claimed AS (
        UPDATE idempotency_keys k
           SET status = 'processing',
               fence = k.fence + 1,
               attempts = k.attempts + 1,
               reclaimed_count = k.reclaimed_count
                   + CASE WHEN k.status = 'processing' THEN 1 ELSE 0 END,
               lease_owner = :owner,
               locked_until = now() + make_interval(secs => :lease_seconds),
               next_attempt_at = NULL,
               updated_at = now()
          FROM (SELECT status AS previous_status
                  FROM idempotency_keys
                 WHERE idempotency_key = :key
                   FOR UPDATE) previous
         WHERE k.idempotency_key = :key
           AND (k.status = 'pending'
                OR (k.status = 'failed_retryable'
                    AND (k.next_attempt_at IS NULL OR k.next_attempt_at <= now()))
                OR (k.status = 'processing' AND k.locked_until < now()))
        RETURNING k.idempotency_key, k.fence, k.attempts, k.correlation_id, k.route,
                  k.event_type, k.source, k.locked_until, k.first_failed_at,
                  now() AS claimed_at, previous.previous_status,
                  k.error_code AS previous_error_code
    )
    SELECT c.*, e.external_id, e.version, e.payload
      FROM claimed c JOIN events e USING (idempotency_key)
    """
)

RECORD_BLOCKED_DELIVERY: TextClause = text(
    """
    -- A delivery that found the key finished or held: count it, say why.
    UPDATE idempotency_keys
       SET blocked_deliveries = blocked_deliveries + 1
     WHERE idempotency_key = :key
    RETURNING status, locked_until > now() AS lease_live
    """
)

RENEW_LEASE: TextClause = text(
    """
    -- Extend the lease only while we still hold it (same fence, still processing).
    UPDATE idempotency_keys
       SET locked_until = now() + make_interval(secs => :lease_seconds)
     WHERE idempotency_key = :key AND fence = :fence AND status = 'processing'
    RETURNING locked_until
    """
)

FINISH_SUCCEEDED: TextClause = text(
    """
    -- Store the result under the fence: a holder whose lease was taken over matches no row.
    UPDATE idempotency_keys
       SET status = 'succeeded', result = CAST(:result AS jsonb), external_ref = :external_ref,
           error_code = NULL, error_detail = NULL, lease_owner = NULL, locked_until = NULL,
           updated_at = now()
     WHERE idempotency_key = :key AND fence = :fence AND status = 'processing'
    RETURNING attempts
    """
)

SCHEDULE_RETRY: TextClause = text(
    """
    -- A transient failure: the fenced status change and the outbox row that brings the key
    -- back when due are one statement. The retry waits in the database, not in the broker.
    WITH failed AS (
        UPDATE idempotency_keys
           SET status = 'failed_retryable', error_code = :error_code,
               error_detail = :error_detail, lease_owner = NULL, locked_until = NULL,
               first_failed_at = COALESCE(first_failed_at, now()),
               next_attempt_at = now() + make_interval(secs => :delay_seconds),
               updated_at = now()
         WHERE idempotency_key = :key AND fence = :fence AND status = 'processing'
        RETURNING idempotency_key, correlation_id, next_attempt_at
    )
    INSERT INTO outbox (idempotency_key, task_name, correlation_id, available_at)
    SELECT idempotency_key, :task_name, correlation_id, next_attempt_at FROM failed
    RETURNING available_at
    """
)

FAIL_FINAL: TextClause = text(
    """
    -- A permanent failure, a spent budget or a broken contract (:final_status is failed_final
    -- or quarantined): the fenced status change and the dead letter an operator will see are
    -- one statement.
    WITH failed AS (
        UPDATE idempotency_keys
           SET status = :final_status, error_code = :error_code, error_detail = :error_detail,
               lease_owner = NULL, locked_until = NULL, next_attempt_at = NULL,
               first_failed_at = COALESCE(first_failed_at, now()), updated_at = now()
         WHERE idempotency_key = :key AND fence = :fence AND status = 'processing'
        RETURNING idempotency_key, attempts, first_failed_at
    )
    INSERT INTO dead_letters (idempotency_key, kind, error_code, error_detail, attempts,
                              first_failed_at, last_failed_at)
    SELECT idempotency_key, :kind, :error_code, :error_detail, attempts, first_failed_at, now()
      FROM failed
    RETURNING id
    """
)

# -- sweeper ----------------------------------------------------------------------------------

TRY_SWEEPER_LOCK: TextClause = text(
    """
    -- One sweeper at a time: the lock is held until this transaction ends.
    SELECT pg_try_advisory_xact_lock(:lock_id)
    """
)

REDRIVE_EXPIRED_LEASES: TextClause = text(
    """
    -- Keys whose holder stopped renewing (crashed, killed, partitioned): queue a new delivery.
    -- The next claim takes over the lease with a newer fence and reconciles first. A key with
    -- an unpublished row is left alone, and each re-send since the claim waits twice as long
    -- as the one before (grace, 2x, 4x ... 64x): a queue that is merely slow gets a few copies,
    -- not one per pass.
    WITH expired AS (
        SELECT k.idempotency_key, k.correlation_id
          FROM idempotency_keys k
          CROSS JOIN LATERAL (
              SELECT count(*) FILTER (WHERE o.created_at >= k.updated_at) AS resent,
                     COALESCE(bool_or(o.published_at IS NULL), false) AS waiting,
                     max(o.created_at) AS last_queued
                FROM outbox o WHERE o.idempotency_key = k.idempotency_key) sent
         WHERE k.status = 'processing' AND k.locked_until < now()
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
    """
    -- Keys waiting for a delivery whose message was published but never consumed (Redis
    -- restarted or flushed): pending or due for a retry, untouched for the grace period, no
    -- unpublished row, and the last message older than the grace period doubled for each
    -- re-send since the key's last change (so a slow queue is not flooded with copies).
    WITH stalled AS (
        SELECT k.idempotency_key, k.correlation_id
          FROM idempotency_keys k
          CROSS JOIN LATERAL (
              SELECT count(*) FILTER (WHERE o.created_at >= k.updated_at) AS queued,
                     COALESCE(bool_or(o.published_at IS NULL), false) AS waiting,
                     max(o.published_at) AS last_published
                FROM outbox o WHERE o.idempotency_key = k.idempotency_key) sent
         WHERE k.status IN ('pending', 'failed_retryable')
           AND k.updated_at < now() - make_interval(secs => :grace_seconds)
           AND (k.next_attempt_at IS NULL
                OR k.next_attempt_at < now() - make_interval(secs => :grace_seconds))
           AND NOT sent.waiting
           AND sent.last_published < now() - make_interval(
                   secs => :grace_seconds * power(2, LEAST(GREATEST(sent.queued - 1, 0), 6)))
         LIMIT :limit
           FOR UPDATE OF k SKIP LOCKED
    )
    INSERT INTO outbox (idempotency_key, task_name, correlation_id)
    SELECT idempotency_key, :task_name, correlation_id FROM stalled
    RETURNING idempotency_key
    """
)
