"""The operators' statements: listing and resolving dead letters, replays, stats.

Optional filters are written `(:x IS NULL OR column = :x)` so each statement stays one readable
piece of SQL with named binds. Globs arrive already turned into LIKE patterns.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

LIST_DEAD_LETTERS: TextClause = text(
    """
    SELECT d.id, d.idempotency_key, d.kind, d.error_code, d.attempts, d.first_failed_at,
           d.last_failed_at, d.resolution, d.resolved_by, d.resolved_at, d.created_at,
           k.source, k.event_type, k.route, k.status, k.destination
      FROM dead_letters d JOIN idempotency_keys k USING (idempotency_key)
     WHERE (CAST(:event_type_like AS text) IS NULL OR k.event_type LIKE :event_type_like)
       AND (CAST(:destination AS text) IS NULL OR k.destination = :destination)
       AND (CAST(:source AS text) IS NULL OR k.source = :source)
       AND (CAST(:kind AS text) IS NULL OR d.kind = :kind)
       AND (CAST(:resolution AS text) IS NULL OR d.resolution = :resolution)
       AND (CAST(:since AS timestamptz) IS NULL OR d.created_at >= :since)
       AND (CAST(:until AS timestamptz) IS NULL OR d.created_at < :until)
       AND (CAST(:before_id AS bigint) IS NULL OR d.id < :before_id)
     ORDER BY d.id DESC
     LIMIT :limit
    """
)

GET_DEAD_LETTER: TextClause = text(
    """
    SELECT d.*, k.source, k.event_type, k.route, k.status, k.correlation_id,
           k.attempts AS key_attempts, k.created_at AS accepted_at, k.reclaimed_count,
           k.blocked_deliveries, k.duplicate_count, k.event_key, k.destination,
           e.external_id, e.version, e.payload
      FROM dead_letters d
      JOIN idempotency_keys k USING (idempotency_key)
      JOIN events e ON e.idempotency_key = COALESCE(k.event_key, k.idempotency_key)
     WHERE d.id = :id
    """
)

DEAD_LETTER_HISTORY: TextClause = text(
    """
    -- Every dead letter the key has had: the attempt history across replays.
    SELECT id, kind, error_code, attempts, first_failed_at, last_failed_at, resolution,
           resolved_by, resolved_at
      FROM dead_letters
     WHERE idempotency_key = :key
     ORDER BY id
    """
)

DISCARD_DEAD_LETTER: TextClause = text(
    """
    -- Only an open dead letter can be discarded; the answer says whether one was.
    UPDATE dead_letters
       SET resolution = 'discarded', resolved_by = :by, resolved_at = now(),
           resolution_note = :reason
     WHERE id = :id AND resolution = 'open'
    RETURNING id
    """
)

REPLAY_AS_OF: TextClause = text(
    """
    -- The dry run's time: what it shows is the keys as of now; a later change moves a key's
    -- updated_at past it.
    SELECT now()
    """
)

REPLAY_CANDIDATES: TextClause = text(
    """
    -- One page of the keys a replay filter matches, in key order after :after and up to
    -- :through, with what decides whether each may be replayed. Read without locks: the
    -- reset (lifecycle.RESET_FOR_REPLAY) checks each key again under its row lock.
    SELECT k.idempotency_key, k.status, k.event_type, k.source, k.route,
           (k.status = 'processing' AND k.locked_until >= now()) AS lease_live
      FROM idempotency_keys k
     WHERE (CAST(:keys AS text[]) IS NULL OR k.idempotency_key = ANY(:keys))
       AND (CAST(:statuses AS text[]) IS NULL OR k.status = ANY(:statuses))
       AND (CAST(:event_type_like AS text) IS NULL OR k.event_type LIKE :event_type_like)
       AND (CAST(:source AS text) IS NULL OR k.source = :source)
       AND (CAST(:destination AS text) IS NULL OR k.destination = :destination)
       AND (CAST(:since AS timestamptz) IS NULL OR k.updated_at >= :since)
       AND (CAST(:until AS timestamptz) IS NULL OR k.updated_at < :until)
       AND k.idempotency_key > :after
       AND (CAST(:through AS text) IS NULL OR k.idempotency_key <= :through)
     ORDER BY k.idempotency_key
     LIMIT :limit
    """
)

MARK_DEAD_LETTERS_REPLAYED: TextClause = text(
    """
    UPDATE dead_letters
       SET resolution = 'replayed', resolved_by = :by, resolved_at = now()
     WHERE idempotency_key = ANY(:keys) AND resolution = 'open'
    """
)

RECORD_REPLAY: TextClause = text(
    """
    INSERT INTO replays (requested_by, filter, key_count, keys)
    VALUES (:by, CAST(:filter AS jsonb), :count, :keys)
    RETURNING id
    """
)

ADD_TO_REPLAY: TextClause = text(
    """
    -- A batched replay's audit row grows with each batch, in that batch's transaction.
    UPDATE replays SET key_count = key_count + :count, keys = keys || CAST(:keys AS text[])
     WHERE id = :id
    """
)

STATS_KEYS_UNFINISHED: TextClause = text(
    """
    -- Exact counts of every status but succeeded, each through its partial index, so the
    -- cost follows the keys in these states, not the table (a million succeeded keys are
    -- never read); by destination too (NULL: a key that is no fan-out delivery).
    SELECT status, destination, count(*) AS keys FROM idempotency_keys
     WHERE status IN ('pending', 'failed_retryable') GROUP BY status, destination
    UNION ALL
    SELECT 'processing', destination, count(*) FROM idempotency_keys
     WHERE status = 'processing' GROUP BY destination
    UNION ALL
    SELECT status, destination, count(*) FROM idempotency_keys
     WHERE status IN ('failed_final', 'quarantined') GROUP BY status, destination
    """
)

STATS_FANNED_OUT: TextClause = text(
    """
    -- Fan-out events (their keys never run) through their partial index (migration 0015),
    -- counted up to :limit at most (NULL: all of them).
    SELECT count(*)
      FROM (SELECT 1 FROM idempotency_keys WHERE status = 'fanned_out'
             LIMIT CAST(:limit AS bigint)) AS fanned
    """
)

STATS_FANNED_OUT_ESTIMATE: TextClause = text(
    """
    -- Fan-out events as the planner estimates them: the partial index's entries at the last
    -- ANALYZE (which samples them) per page, times the pages it has now. 0 while the index is
    -- its meta page alone; NULL when it has grown since statistics said it was empty (then
    -- they are counted).
    SELECT CASE WHEN c.reltuples <= 0 OR c.relpages <= 1 THEN
                     CASE WHEN pg_relation_size(c.oid) <= current_setting('block_size')::int
                          THEN 0 END
                ELSE c.reltuples / c.relpages
                     * (pg_relation_size(c.oid) / current_setting('block_size')::int)
           END AS estimate
      FROM pg_class c
     WHERE c.oid = 'idempotency_keys_fanned_out_idx'::regclass
    """
)

STATS_KEYS_SUPERSEDED: TextClause = text(
    """
    -- Exact, through the partial index of superseded keys (migration 0011): its cost follows
    -- the superseded keys alone, never the others.
    SELECT count(*) FROM idempotency_keys WHERE status = 'superseded'
    """
)

STATS_KEYS_ESTIMATE: TextClause = text(
    """
    -- The table's rows as the planner estimates them: the density at the last ANALYZE
    -- times the pages the table has now (no rows are read). NULL before the first ANALYZE.
    SELECT CASE WHEN c.reltuples < 0 THEN NULL
                WHEN c.relpages = 0 THEN c.reltuples
                ELSE c.reltuples / c.relpages
                     * (pg_relation_size(c.oid) / current_setting('block_size')::int)
           END AS estimate
      FROM pg_class c
     WHERE c.oid = 'idempotency_keys'::regclass
    """
)

STATS_KEYS_SUCCEEDED: TextClause = text(
    """
    -- The exact count, used only while the table is small (see stats.EXACT_BELOW).
    SELECT count(*) FROM idempotency_keys WHERE status = 'succeeded'
    """
)

STATS_COUNTER_TOTALS: TextClause = text(
    """
    -- Repeats blocked and leases reclaimed, kept as they happen (migration 0007's trigger):
    -- a handful of rows, never a sum over the keys.
    SELECT COALESCE(sum(duplicates), 0) AS duplicates, COALESCE(sum(blocked), 0) AS blocked,
           COALESCE(sum(refused_claims), 0) AS refused_claims,
           COALESCE(sum(reclaimed), 0) AS reclaimed
      FROM key_counter_totals
    """
)

STATS_OUTBOX: TextClause = text(
    """
    SELECT count(*) FILTER (WHERE available_at <= now()) AS due,
           count(*) AS unpublished,
           COALESCE(EXTRACT(EPOCH FROM now() - min(available_at)
                            FILTER (WHERE available_at <= now())), 0) AS oldest_due_age
      FROM outbox WHERE published_at IS NULL
    """
)

STATS_RELAY_LEAD: TextClause = text(
    """
    -- The relay that publishes now (outbox/relay/lead.py): no row when none holds a running
    -- lead (no relay runs or reaches the database, or RELAY_LEAD_SECONDS is 0).
    SELECT holder FROM relay_lead WHERE held_until > now()
    """
)

STATS_PROCESSING: TextClause = text(
    """
    SELECT count(*) AS processing,
           COALESCE(EXTRACT(EPOCH FROM now() - min(updated_at)), 0) AS oldest_age,
           count(*) FILTER (WHERE locked_until < now()) AS lease_expired
      FROM idempotency_keys WHERE status = 'processing'
    """
)

STATS_DEAD_LETTERS: TextClause = text(
    """
    -- Open dead letters by kind and by destination (NULL: not a delivery's), each key looked
    -- up by its primary key: the cost follows the open dead letters.
    SELECT d.kind,
           (SELECT k.destination FROM idempotency_keys k
             WHERE k.idempotency_key = d.idempotency_key) AS destination,
           count(*) AS open
      FROM dead_letters d
     WHERE d.resolution = 'open'
     GROUP BY 1, 2
    """
)

STUCK_KEYS: TextClause = text(
    """
    -- Keys not finished long after their last change: a worker or broker problem to look at.
    -- A key waiting on a paused route or an open circuit is held on purpose, not stuck; a
    -- key parked behind a dead letter of its lane (lane_on_failure block, or under any mode a
    -- dead letter whose effect is unknown) waits for an operator, and BLOCKED_LANES shows its
    -- lane once. Two branches, each through its partial index (waiting keys,
    -- processing keys); a parked key's lane is looked at through the lane index.
    SELECT idempotency_key, status, event_type, attempts, updated_at,
           EXTRACT(EPOCH FROM now() - updated_at) AS age_seconds
      FROM (SELECT idempotency_key, status, event_type, attempts, updated_at
              FROM idempotency_keys k
             WHERE status IN ('pending', 'failed_retryable')
               AND updated_at < now() - make_interval(secs => :older_than_seconds)
               AND (status <> 'failed_retryable' OR next_attempt_at < now())
               AND NOT EXISTS (
                   SELECT 1 FROM route_state r
                    WHERE r.route = k.route AND (r.paused OR r.circuit <> 'closed'))
               AND NOT (k.error_code = 'lane_waiting' AND EXISTS (
                   SELECT 1 FROM lanes l
                     JOIN idempotency_keys h ON h.route = l.route AND h.lane = l.lane
                     JOIN dead_letters d ON d.idempotency_key = h.idempotency_key
                    WHERE l.route = k.route AND l.lane = k.lane
                      AND (l.on_failure = 'block' OR h.uncertain)
                      AND h.lane_rank < k.lane_rank
                      AND h.status IN ('failed_final', 'quarantined')
                      AND d.resolution = 'open'))
            UNION ALL
            SELECT idempotency_key, status, event_type, attempts, updated_at
              FROM idempotency_keys
             WHERE status = 'processing'
               AND updated_at < now() - make_interval(secs => :older_than_seconds)) unfinished
     ORDER BY updated_at
     LIMIT :limit
    """
)

BLOCKED_LANES: TextClause = text(
    """
    -- Lanes held by a dead letter (lane_on_failure block, or under any mode one whose effect
    -- is unknown: it holds its lane until a lookup answers, `held_by` uncertain): the lane's
    -- oldest unfinished key is failed or quarantined with an open dead letter, and keys
    -- parked behind it wait. The
    -- lanes come from the keys parked longer than :older_than_seconds (their partial index);
    -- each lane's head and its waiting keys are ranges of the lane index. Read only; the
    -- lanes whose keys have waited longest first, at most :limit.
    WITH parked AS (
        SELECT route, lane, min(updated_at) AS waiting_since
          FROM idempotency_keys
         WHERE status = 'pending' AND error_code = 'lane_waiting'
           AND updated_at < now() - make_interval(secs => :older_than_seconds)
         GROUP BY route, lane
    )
    SELECT p.route, p.lane, h.idempotency_key AS head_key, h.status AS head_status,
           h.error_code AS head_error_code, h.event_type AS head_event_type,
           CASE WHEN h.uncertain THEN 'uncertain' ELSE 'dead_letter' END AS held_by,
           d.id AS dead_letter_id, d.created_at AS blocked_since, w.waiting, p.waiting_since,
           EXTRACT(EPOCH FROM now() - d.created_at) AS blocked_seconds
      FROM parked p
      JOIN lanes l ON l.route = p.route AND l.lane = p.lane
     CROSS JOIN LATERAL (
           -- The head: the lane's first key in lane order that has not finished (a dead
           -- letter still open holds its key unfinished).
           SELECT k.idempotency_key, k.status, k.error_code, k.event_type, k.lane_rank,
                  k.uncertain
             FROM idempotency_keys k
            WHERE k.route = p.route AND k.lane = p.lane
              AND (k.status IN ('pending', 'processing', 'failed_retryable')
                   OR (k.status IN ('failed_final', 'quarantined')
                       AND EXISTS (SELECT 1 FROM dead_letters o
                                    WHERE o.idempotency_key = k.idempotency_key
                                      AND o.resolution = 'open')))
            ORDER BY k.lane_rank
            LIMIT 1) h
     CROSS JOIN LATERAL (
           SELECT o.id, o.created_at FROM dead_letters o
            WHERE o.idempotency_key = h.idempotency_key AND o.resolution = 'open'
            ORDER BY o.id DESC
            LIMIT 1) d
     CROSS JOIN LATERAL (
           SELECT count(*) AS waiting FROM idempotency_keys b
            WHERE b.route = p.route AND b.lane = p.lane AND b.lane_rank > h.lane_rank
              AND b.status = 'pending' AND b.error_code = 'lane_waiting') w
     WHERE h.status IN ('failed_final', 'quarantined') AND w.waiting > 0
       AND (l.on_failure = 'block' OR h.uncertain)
     ORDER BY p.waiting_since, p.route, p.lane
     LIMIT :limit
    """
)
