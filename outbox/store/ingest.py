"""The receiver's statements: accept an event (reserve its key, or count a repeat) and read a key.

The statements that move a key from state to state after it was created (claim, renew,
succeed, retry, fail, replay) are in `outbox.store.lifecycle`, the one owner of the key's states.
The receiver runs these through an async connection. Stores own the transactions; nothing here
commits.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

RESERVE_KEY: TextClause = text(
    """
    -- Reserve the key, store the event and write its outbox row in ONE statement: either all
    -- three exist at commit or none. A key with a lane gets its rank there: the version's
    -- (:lane_rank) or, in order of acceptance, the next number of `lane_acceptance`. A repeat
    -- is answered by the same statement: a known key
    -- with the same payload hash counts the repeat and returns the key's current state
    -- (`inserted` false: a new key's count is 0, a counted repeat's at least 1), and nothing
    -- else is written; a concurrent repeat waits for the first insert's transaction, then does
    -- the same. No row means the key is known with another payload or belongs to a workflow
    -- (a claims key), or was purged between. The event keeps the trace context it came with
    -- (NULL with tracing off), so every later step of the key joins its trace.
    WITH reserved AS (
        INSERT INTO idempotency_keys (
            idempotency_key, payload_hash, correlation_id, source, event_type, route,
            workflow_name, execution_id, expires_at, lane, lane_rank
        )
        VALUES (
            :key, :payload_hash, :correlation_id, :source, :event_type, :route,
            :workflow_name, :execution_id, now() + make_interval(secs => :ttl_seconds),
            :lane,
            CASE WHEN CAST(:lane AS text) IS NULL THEN NULL
                 ELSE COALESCE(CAST(:lane_rank AS numeric), nextval('lane_acceptance')) END
        )
        ON CONFLICT (idempotency_key) DO UPDATE
           SET duplicate_count = idempotency_keys.duplicate_count + 1
         WHERE idempotency_keys.payload_hash = EXCLUDED.payload_hash
           AND idempotency_keys.actor = 'worker'
        RETURNING idempotency_key, status, correlation_id, created_at, result, external_ref,
                  error_code, attempts, superseded_by, duplicate_count = 0 AS inserted
    ), stored AS (
        INSERT INTO events (idempotency_key, source, event_type, external_id, version, payload,
                            trace_context)
        SELECT idempotency_key, :source, :event_type, :external_id, :version,
               CAST(:payload AS jsonb), :trace_context
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
            workflow_name, execution_id, error_code, error_detail, first_failed_at, expires_at,
            lane, lane_rank
        )
        VALUES (
            :key, 'quarantined', :payload_hash, :correlation_id, :source, :event_type, :route,
            :workflow_name, :execution_id, 'contract_violation', :error_detail, now(),
            now() + make_interval(secs => :ttl_seconds), :lane,
            CASE WHEN CAST(:lane AS text) IS NULL THEN NULL
                 ELSE COALESCE(CAST(:lane_rank AS numeric), nextval('lane_acceptance')) END
        )
        ON CONFLICT (idempotency_key) DO UPDATE
           SET duplicate_count = idempotency_keys.duplicate_count + 1
         WHERE idempotency_keys.payload_hash = EXCLUDED.payload_hash
           AND idempotency_keys.actor = 'worker'
        RETURNING idempotency_key, status, correlation_id, created_at, result, external_ref,
                  error_code, attempts, superseded_by, duplicate_count = 0 AS inserted
    ), stored AS (
        INSERT INTO events (idempotency_key, source, event_type, external_id, version, payload,
                            trace_context)
        SELECT idempotency_key, :source, :event_type, :external_id, :version,
               CAST(:payload AS jsonb), :trace_context
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
           k.updated_at, k.expires_at, k.next_attempt_at, k.uncertain, k.lane, k.superseded_by
      FROM idempotency_keys k
     WHERE k.idempotency_key = :key
    """
)
