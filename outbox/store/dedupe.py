"""The Dedupe operation's statements: a test-and-mark key that is only ever "seen".

A dedupe key is a workflow key created already finished (`succeeded`, result `{"dedupe":
true}`): nothing acts on it, no claim or replay takes it, and purge removes it once its TTL
has passed. Apart from `outbox.store.lifecycle`, since no statement here moves a key from one
state to another. The claims context's `outbox.claims.dedupe` runs them.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

DEDUPE_NEW_KEY: TextClause = text(
    """
    -- The Dedupe operation's test-and-mark: create the key already finished, as a workflow key
    -- that says only "seen" (result {"dedupe": true}), living :ttl_seconds. One statement: of
    -- concurrent first calls exactly one creates it. No lease, nothing for a worker, a claim
    -- or a replay to act on (it is terminal); purge removes it once it expires.
    WITH marked AS (
        INSERT INTO idempotency_keys (
            idempotency_key, actor, status, payload_hash, correlation_id, source, event_type,
            route, workflow_name, attempts, result, expires_at
        )
        VALUES (
            :key, 'workflow', 'succeeded', 'no-payload', :correlation_id, 'claims', 'dedupe',
            '(dedupe)', :workflow, 0, '{"dedupe": true}'::jsonb,
            now() + make_interval(secs => :ttl_seconds)
        )
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING idempotency_key, created_at
    ), stored AS (
        INSERT INTO events (idempotency_key, source, event_type, external_id, payload)
        SELECT idempotency_key, 'claims', 'dedupe', :key, 'null'::jsonb FROM marked
    )
    SELECT created_at FROM marked
    """
)

DEDUPE_RENEW_EXPIRED: TextClause = text(
    """
    -- A dedupe key past its TTL that purge has not removed yet is new again: marked afresh
    -- under the row lock, so of concurrent callers exactly one sees it new.
    UPDATE idempotency_keys
       SET created_at = now(), updated_at = now(), correlation_id = :correlation_id,
           workflow_name = :workflow,
           expires_at = now() + make_interval(secs => :ttl_seconds)
     WHERE idempotency_key = :key AND actor = 'workflow' AND event_type = 'dedupe'
       AND status = 'succeeded' AND expires_at <= now()
    RETURNING created_at
    """
)

DEDUPE_KEY_STATE: TextClause = text(
    """
    -- What holds a key a Dedupe call did not create: a live dedupe mark (seen), or a key of
    -- another use (an event's, or a claim's), which a Dedupe call never touches.
    SELECT actor, status, event_type = 'dedupe' AND status = 'succeeded' AS is_dedupe,
           created_at, expires_at, expires_at <= now() AS expired
      FROM idempotency_keys
     WHERE idempotency_key = :key
    """
)
