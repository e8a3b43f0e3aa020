"""The claims API's statements: the same keys and states as the event path, driven by a
workflow that performs the side effect itself.

The lease token is the holder's proof: a fresh random value stored in `lease_owner` by each
claim (with the fence bumped), and named by every later write. A stale token matches no row.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

CLAIMS_ROUTE = "(claims)"
"""The route label of keys created through the claims API (no worker acts on them)."""

CLAIM_NEW_KEY: TextClause = text(
    """
    -- First claim of an unknown key: reserve it already held, with its payload, in one
    -- statement. A concurrent first claim finds the row and falls through to CLAIM_KEY.
    WITH reserved AS (
        INSERT INTO idempotency_keys (
            idempotency_key, status, payload_hash, correlation_id, source, event_type, route,
            workflow_name, attempts, fence, lease_owner, locked_until, expires_at
        )
        VALUES (
            :key, 'processing', :payload_hash, :correlation_id, 'claims', 'claim',
            '(claims)', :workflow, 1, 1, :token,
            now() + make_interval(secs => :lease_seconds),
            now() + make_interval(secs => :ttl_seconds)
        )
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING idempotency_key, correlation_id, locked_until
    ), stored AS (
        INSERT INTO events (idempotency_key, source, event_type, external_id, payload)
        SELECT idempotency_key, 'claims', 'claim', :key, CAST(:payload AS jsonb)
          FROM reserved
    )
    SELECT idempotency_key, correlation_id, locked_until FROM reserved
    """
)

CLAIM_KEY: TextClause = text(
    """
    -- Take an existing key nobody holds: pending, failed_retryable, or processing with an
    -- expired lease (then `reclaimed`: the last holder may have acted). Same payload only.
    UPDATE idempotency_keys k
       SET status = 'processing', fence = k.fence + 1, attempts = k.attempts + 1,
           lease_owner = :token,
           locked_until = now() + make_interval(secs => :lease_seconds),
           reclaimed_count = k.reclaimed_count
               + CASE WHEN k.status = 'processing' THEN 1 ELSE 0 END,
           next_attempt_at = NULL, updated_at = now()
      FROM (SELECT status AS previous_status FROM idempotency_keys
             WHERE idempotency_key = :key FOR UPDATE) previous
     WHERE k.idempotency_key = :key
       AND (CAST(:payload_hash AS text) IS NULL OR k.payload_hash = :payload_hash)
       AND (k.status IN ('pending', 'failed_retryable')
            OR (k.status = 'processing' AND k.locked_until < now()))
    RETURNING k.correlation_id, k.locked_until, k.attempts, k.error_code,
              previous.previous_status
    """
)

KEY_STATE: TextClause = text(
    """
    -- Why a claim was refused: finished, held (and for how long), or another payload.
    SELECT status, correlation_id, result, external_ref, error_code,
           (CAST(:payload_hash AS text) IS NOT NULL AND payload_hash <> :payload_hash)
               AS payload_differs,
           GREATEST(0, CEIL(EXTRACT(EPOCH FROM locked_until - now()))) AS lease_remaining
      FROM idempotency_keys WHERE idempotency_key = :key
    """
)

HEARTBEAT: TextClause = text(
    """
    UPDATE idempotency_keys
       SET locked_until = now() + make_interval(secs => :lease_seconds), updated_at = now()
     WHERE idempotency_key = :key AND lease_owner = :token AND status = 'processing'
    RETURNING locked_until
    """
)

COMPLETE: TextClause = text(
    """
    UPDATE idempotency_keys
       SET status = 'succeeded', result = CAST(:result AS jsonb), external_ref = :external_ref,
           error_code = NULL, error_detail = NULL, lease_owner = NULL, locked_until = NULL,
           updated_at = now()
     WHERE idempotency_key = :key AND lease_owner = :token AND status = 'processing'
    RETURNING correlation_id
    """
)

FAIL_RETRYABLE: TextClause = text(
    """
    -- The workflow will try again: the key is free to claim at once, the error kept.
    UPDATE idempotency_keys
       SET status = 'failed_retryable', error_code = :error_code, error_detail = :detail,
           first_failed_at = COALESCE(first_failed_at, now()), lease_owner = NULL,
           locked_until = NULL, updated_at = now()
     WHERE idempotency_key = :key AND lease_owner = :token AND status = 'processing'
    RETURNING correlation_id
    """
)

FAIL_FINAL: TextClause = text(
    """
    -- The workflow gives up: failed_final and the dead letter in one statement.
    WITH failed AS (
        UPDATE idempotency_keys
           SET status = 'failed_final', error_code = :error_code, error_detail = :detail,
               first_failed_at = COALESCE(first_failed_at, now()), lease_owner = NULL,
               locked_until = NULL, updated_at = now()
         WHERE idempotency_key = :key AND lease_owner = :token AND status = 'processing'
        RETURNING idempotency_key, attempts, first_failed_at, correlation_id
    ), dead AS (
        INSERT INTO dead_letters (idempotency_key, kind, error_code, error_detail, attempts,
                                  first_failed_at, last_failed_at)
        SELECT idempotency_key, 'permanent', :error_code, :detail, attempts, first_failed_at,
               now()
          FROM failed
    )
    SELECT correlation_id FROM failed
    """
)
