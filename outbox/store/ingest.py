"""The receiver's statements: accept an event (reserve its key, or count a repeat) and read a key.

The statements that move a key from state to state after it was created (claim, renew,
succeed, retry, fail, replay) are in `outbox.store.lifecycle`, the one owner of the key's states.
The receiver runs these through an async connection. Stores own the transactions; nothing here
commits.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

# Shared by the accept statements, after the key's INSERT: a repeat of a known key with the
# same payload hash is counted (`inserted` false: a new key's count is 0), and only a new key
# gets its event row.
_COUNT_A_REPEAT_OR_STORE_THE_EVENT = """ON CONFLICT (idempotency_key) DO UPDATE
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
    )"""

# In the accept statements' outbox INSERT, true for each row it writes, and in their answer,
# true for the key's row (a repeat writes no outbox row): the trigger on `outbox` then sends no
# NOTIFY for this transaction (migration 0020), since a NOTIFY holds a lock of the whole
# database through the commit's flush and so made the receivers' commits, and their repeats,
# go one at a time. The receiver wakes the relay itself once a new key's accept has committed
# (`outbox.ingest.wakeup`). Set for this transaction only, so it holds through a transaction
# pool too.
_WAKES_THE_RELAY_AFTER_COMMIT = (
    "set_config('idem.relay_wakeup', 'after_commit', true) = 'after_commit'"
)

RESERVE_KEY: TextClause = text(
    f"""
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
        {_COUNT_A_REPEAT_OR_STORE_THE_EVENT}, queued AS (
        INSERT INTO outbox (idempotency_key, task_name, correlation_id)
        SELECT idempotency_key, :task_name, correlation_id FROM reserved
         WHERE inserted AND {_WAKES_THE_RELAY_AFTER_COMMIT}
    )
    SELECT * FROM reserved WHERE {_WAKES_THE_RELAY_AFTER_COMMIT}
    """
)

RESERVE_FANNED_OUT: TextClause = text(
    f"""
    -- Like RESERVE_KEY for an event of a fan-out route: its key (status fanned_out: it never
    -- runs itself), the event, and, per destination, a delivery's key (pending, its route the
    -- destination's name, its lane and rank the destination's) with its outbox row, in ONE
    -- statement. A repeat is counted and answered as by RESERVE_KEY and makes no delivery:
    -- the event's deliveries exist exactly when its key does. The event's key remembers the
    -- destinations (`delivered_to`), beyond its deliveries' own lives.
    WITH reserved AS (
        INSERT INTO idempotency_keys (
            idempotency_key, status, payload_hash, correlation_id, source, event_type, route,
            workflow_name, execution_id, expires_at, delivered_to
        )
        VALUES (
            :key, 'fanned_out', :payload_hash, :correlation_id, :source, :event_type, :route,
            :workflow_name, :execution_id, now() + make_interval(secs => :ttl_seconds),
            CAST(:destinations AS text[])
        )
        {_COUNT_A_REPEAT_OR_STORE_THE_EVENT}, delivered AS (
        INSERT INTO idempotency_keys (
            idempotency_key, event_key, destination, payload_hash, correlation_id, source,
            event_type, route, workflow_name, execution_id, expires_at, lane, lane_rank
        )
        SELECT d.key, r.idempotency_key, d.destination, :payload_hash, r.correlation_id,
               :source, :event_type, d.destination, :workflow_name, :execution_id,
               now() + make_interval(secs => :ttl_seconds), d.lane,
               CASE WHEN d.lane IS NULL THEN NULL
                    ELSE COALESCE(d.rank, nextval('lane_acceptance')) END
          FROM reserved r,
               unnest(CAST(:delivery_keys AS text[]), CAST(:destinations AS text[]),
                      CAST(:delivery_lanes AS text[]), CAST(:delivery_ranks AS numeric[]))
                   AS d(key, destination, lane, rank)
         WHERE r.inserted
        RETURNING idempotency_key, correlation_id
    ), queued AS (
        INSERT INTO outbox (idempotency_key, task_name, correlation_id)
        SELECT idempotency_key, :task_name, correlation_id FROM delivered
         WHERE {_WAKES_THE_RELAY_AFTER_COMMIT}
    )
    SELECT * FROM reserved WHERE {_WAKES_THE_RELAY_AFTER_COMMIT}
    """
)

DELIVERIES_OF: TextClause = text(
    """
    -- An event's deliveries, in the order of its route's `fan_out` (:destinations), for its
    -- answer; a destination added later (a backfill) comes after them.
    SELECT k.destination, k.idempotency_key AS key, k.status, k.attempts, k.result,
           k.external_ref, k.error_code, k.uncertain, k.updated_at, k.next_attempt_at,
           k.superseded_by, k.lane
      FROM idempotency_keys k
     WHERE k.event_key = :key
     ORDER BY array_position(CAST(:destinations AS text[]), k.destination) NULLS LAST,
              k.destination
    """
)

MISSING_DELIVERIES: TextClause = text(
    """
    -- One page of a fan-out route's events accepted in [:since, :until) that have no delivery
    -- to :destination, in order of acceptance after (:after_at, :after_key): a backfill's walk.
    -- One delivered once has none when its key was purged after its TTL; the event remembers
    -- it (`delivered_to`), so it is never delivered again.
    SELECT k.idempotency_key, k.created_at
      FROM idempotency_keys k
     WHERE k.status = 'fanned_out' AND k.route = :route
       AND k.created_at >= :since
       AND (CAST(:until AS timestamptz) IS NULL OR k.created_at < :until)
       AND (k.created_at, k.idempotency_key) > (:after_at, :after_key)
       AND NOT :destination = ANY(COALESCE(k.delivered_to, '{}'))
       AND NOT EXISTS (SELECT 1 FROM idempotency_keys v
                        WHERE v.event_key = k.idempotency_key AND v.destination = :destination)
     ORDER BY k.created_at, k.idempotency_key
     LIMIT :limit
    """
)

ADD_DELIVERIES: TextClause = text(
    """
    -- A delivery to :destination for each of these events (a backfill), with its outbox row,
    -- in ONE statement. The events' rows are locked first, in key order (two backfills queue
    -- behind each other instead of deadlocking), so the purge cannot take one meanwhile; a
    -- delivery that exists already (another backfill), or existed once (the event remembers
    -- it), is left as it is. Each new delivery lives its route's TTL from now.
    WITH fanned AS (
        SELECT k.idempotency_key, k.payload_hash, k.correlation_id, k.source, k.event_type,
               k.workflow_name, k.execution_id, k.expires_at - k.created_at AS ttl
          FROM idempotency_keys k
         WHERE k.idempotency_key = ANY(:keys) AND k.status = 'fanned_out'
           AND NOT :destination = ANY(COALESCE(k.delivered_to, '{}'))
         ORDER BY k.idempotency_key
           FOR UPDATE
    ), delivered AS (
        INSERT INTO idempotency_keys (
            idempotency_key, event_key, destination, payload_hash, correlation_id, source,
            event_type, route, workflow_name, execution_id, expires_at
        )
        SELECT f.idempotency_key || :separator || :destination, f.idempotency_key,
               :destination, f.payload_hash, f.correlation_id, f.source, f.event_type,
               :destination, f.workflow_name, f.execution_id, now() + f.ttl
          FROM fanned f
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING idempotency_key, correlation_id
    ), remembered AS (
        UPDATE idempotency_keys k
           SET delivered_to = array_append(COALESCE(k.delivered_to, '{}'), :destination)
          FROM fanned f
         WHERE k.idempotency_key = f.idempotency_key
    ), queued AS (
        INSERT INTO outbox (idempotency_key, task_name, correlation_id)
        SELECT idempotency_key, :task_name, correlation_id FROM delivered
    )
    SELECT count(*) AS added FROM delivered
    """
)

RESERVE_KEY_QUARANTINED: TextClause = text(
    f"""
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
        {_COUNT_A_REPEAT_OR_STORE_THE_EVENT}, dead AS (
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
           k.updated_at, k.expires_at, k.next_attempt_at, k.uncertain, k.lane, k.superseded_by,
           k.route, k.event_key, k.destination
      FROM idempotency_keys k
     WHERE k.idempotency_key = :key
    """
)
