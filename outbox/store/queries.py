"""The receiver's, the relay's and the sweeper's statements, each with the guarantee it gives.

The statements that move a key from state to state after it was created (claim, renew,
succeed, retry, fail, replay) are in `outbox.store.lifecycle`, the one owner of the key's states.
The receiver runs these through an async connection, the relay and the sweeper through sync
ones; the SQL is the same. Stores own the transactions; nothing here commits.
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
    -- the same. No row means the key is known with another payload or belongs to a workflow
    -- (a claims key), or was purged between.
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
           AND idempotency_keys.actor = 'worker'
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
           AND idempotency_keys.actor = 'worker'
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
           k.updated_at, k.expires_at, k.next_attempt_at, k.uncertain
      FROM idempotency_keys k
     WHERE k.idempotency_key = :key
    """
)

# -- relay ------------------------------------------------------------------------------------

CLAIM_DUE_OUTBOX: TextClause = text(
    """
    -- Take a batch of due, unpublished rows that no relay holds, and hold them for
    -- :lease_seconds: committed at once, so the publish that follows runs with no transaction
    -- open. SKIP LOCKED and the lease keep concurrent relays on disjoint rows; selecting by
    -- state (not by id > last seen) never skips a late-committing row. A relay that dies
    -- before marking leaves its rows to whichever relay comes after the lease (a second
    -- publish is harmless: the worker's claim refuses a finished or held key).
    WITH due AS (
        SELECT id
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
     WHERE o.id = due.id
    RETURNING o.id, o.idempotency_key, o.task_name, o.correlation_id, o.available_at,
              EXTRACT(EPOCH FROM now() - o.available_at)::float8 AS waited_seconds
    """
)

MARK_PUBLISHED: TextClause = text(
    """
    -- After the send: a row is marked only once its message is in the broker.
    UPDATE outbox
       SET published_at = now(), claimed_until = NULL
     WHERE id = ANY(:ids) AND published_at IS NULL
    """
)

RELEASE_OUTBOX_CLAIM: TextClause = text(
    """
    -- The broker refused a batch: give its unsent rows back at once instead of at the end
    -- of the lease, so any relay may try them again after its backoff.
    UPDATE outbox
       SET claimed_until = NULL
     WHERE id = ANY(:ids) AND published_at IS NULL
    """
)

SECONDS_UNTIL_NEXT_DUE: TextClause = text(
    """
    -- How long the relay may sleep before a row nobody holds falls due (a retry, or a row
    -- whose holder's lease ended). Rows another relay holds are that relay's to publish; if
    -- it dies, the poll finds them once its lease is over.
    SELECT EXTRACT(EPOCH FROM min(available_at) - now())
      FROM outbox
     WHERE published_at IS NULL AND (claimed_until IS NULL OR claimed_until < now())
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
    -- Worker keys whose holder stopped renewing (crashed, killed, partitioned): queue a new
    -- delivery (a workflow's expired claim is left to its workflow's next claim).
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
         WHERE k.status = 'processing' AND k.locked_until < now() AND k.actor = 'worker'
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
         WHERE k.status IN ('pending', 'failed_retryable') AND k.actor = 'worker'
           AND k.updated_at < now() - make_interval(secs => :grace_seconds)
           -- A paused route holds its keys on purpose; resuming queues them.
           AND NOT EXISTS (SELECT 1 FROM route_state r WHERE r.route = k.route AND r.paused)
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
