"""An event's deliveries taken and finished together: one statement for several keys.

A fan-out event's deliveries arrive at a worker in one message (`worker.deliveries`). Each is
still a key of its own, with its own fence, token, lease and outcome; these statements only
carry several of them in one round trip, so a delivery costs its row's work instead of a
statement's. Each row is decided exactly as `lifecycle.CLAIM_KEY` and `lifecycle.SUCCEED`
decide one key: a key that is held, finished or not yet due is left alone (and its caller asks
`KEY_STATE` why, as for one key), and a success whose fence or token no longer matches writes
nothing.

Rows are locked in key order, so two copies of one message (the broker redelivered it while
the first was claiming) queue behind each other instead of deadlocking.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

from outbox.store import attempts, claiming

CLAIM_KEYS: TextClause = text(
    f"""
    -- Take each of :keys that nobody holds, as CLAIM_KEY takes one (pending, a due retry, or
    -- an expired lease, which makes the key uncertain), each with its own token and holder
    -- (:tokens and :owners, in the same order), a fence one higher and its attempt counted.
    -- Only the worker's keys. Whether a key may be taken is decided on the row `previous`
    -- locks (by the primary key; a row another transaction changed meanwhile is read again
    -- by the lock), and the update finds its rows by key alone: with the rule in the
    -- update's own condition, the planner could read the keys through the partial indexes
    -- of waiting and held keys, which under a backlog hold thousands of entries (mostly rows
    -- that have moved on and wait for vacuum), where the primary key finds each in one probe.
    WITH wanted AS (
        SELECT key, token, owner
          FROM unnest(CAST(:keys AS text[]), CAST(:tokens AS text[]), CAST(:owners AS text[]))
            AS w(key, token, owner)
    ), previous AS MATERIALIZED (
        SELECT k.idempotency_key, k.status AS previous_status, k.lease_owner AS previous_owner,
               k.updated_at AS previous_updated_at,
               k.actor = 'worker' AND {claiming.CLAIMABLE} AS claimable
          FROM idempotency_keys k
         WHERE k.idempotency_key = ANY(CAST(:keys AS text[]))
         ORDER BY k.idempotency_key
           FOR UPDATE
    ), claimed AS (
        UPDATE idempotency_keys k
           SET {claiming.taken("w.token", "w.owner")}
          FROM previous
          JOIN wanted w ON w.key = previous.idempotency_key
         WHERE k.idempotency_key = previous.idempotency_key AND previous.claimable
        {claiming.RETURNED}
    ), {attempts.CLAIMED}
    {claiming.WITH_EVENT}
    """
).bindparams(*claiming.window_binds())

SUCCEED_KEYS: TextClause = text(
    f"""
    -- Several effects happened: each key succeeds under its own fence and token, as SUCCEED
    -- records one, with its attempt in the log. The arrays are parallel, one element per key.
    -- The status a key must still have comes from the materialized list (`held`), not as a
    -- constant: a constant would let the planner read the keys through the partial index of
    -- processing keys, which under a backlog holds thousands of entries (mostly rows that
    -- have moved on and wait for vacuum), where the primary key finds each key in one probe.
    WITH outcome AS MATERIALIZED (
        SELECT *, 'processing' AS held
          FROM unnest(CAST(:keys AS text[]), CAST(:fences AS bigint[]),
                      CAST(:tokens AS text[]), CAST(:attempts AS integer[]),
                      CAST(:started_at AS timestamptz[]), CAST(:workers AS text[]),
                      CAST(:outcomes AS text[]), CAST(:reconciled AS boolean[]),
                      CAST(:status_codes AS integer[]), CAST(:results AS jsonb[]),
                      CAST(:external_refs AS text[]))
            AS o(key, fence, token, attempt, started_at, worker, outcome, reconciled,
                 status_code, result, external_ref)
    ), done AS (
        UPDATE idempotency_keys k
           SET status = 'succeeded', result = o.result, external_ref = o.external_ref,
               error_code = NULL, error_detail = NULL, uncertain = false, lease_token = NULL,
               lease_owner = NULL, locked_until = NULL, in_flight_until = NULL,
               updated_at = now()
          FROM outcome o
         WHERE k.idempotency_key = o.key AND k.fence = o.fence AND k.lease_token = o.token
           AND k.status = o.held
        RETURNING k.idempotency_key
    ), logged AS (
        INSERT INTO attempts (idempotency_key, attempt, fence, started_at, outcome, reconciled,
                              status_code, error_code, detail, worker)
        SELECT o.key, o.attempt, o.fence, o.started_at, o.outcome, o.reconciled,
               o.status_code, NULL, NULL, o.worker
          FROM outcome o JOIN done d ON d.idempotency_key = o.key
        RETURNING idempotency_key
    ), {attempts.trimmed()}
    SELECT idempotency_key FROM done
    """
)
