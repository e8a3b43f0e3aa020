"""The lane statements: the attempt's lane step, the sweeper's look after idle lanes, purge.

The decisions themselves are PL/pgSQL functions of migration 0011 (`lane_admit`, `lane_wake`,
`lane_supersede_older`), so that each reads what it decides on after taking the lane's row
lock, and decides and writes in the one call. Triggers of the same migration hand a lane on in
the very transaction that frees it: a lane key leaving `processing` (any outcome) and a lane's
dead letter discarded. docs/explanation/architecture.md, "Lanes", has the rules.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

from outbox.store import attempts

ADMIT: TextClause = text(
    f"""
    -- The lane step of an attempt (or of a claim): `go`, `wait` (parked: pending with no
    -- delivery, the attempt given back; the lane's next change hands it on), `superseded`
    -- (recorded, with the version that superseded it) or `lost` (no longer held). A wait and
    -- a supersede are the attempt's outcome: logged in the same statement.
    WITH d AS (
        SELECT decision, superseded_by, retry_after, CAST(:key AS text) AS idempotency_key,
               CAST(:attempt AS integer) AS attempts
          FROM lane_admit(:key, :fence, :token, :ordering, :on_failure, :ttl_seconds)
    ), {
        attempts.logged(
            "d",
            outcome="CASE decision WHEN 'wait' THEN 'deferred_lane' ELSE 'superseded' END",
            error_code="CASE decision WHEN 'wait' THEN 'lane_waiting' ELSE 'superseded' END",
            where="WHERE decision IN ('wait', 'superseded')",
        )
    }
    SELECT decision, superseded_by, retry_after FROM d
    """
)

ADMIT_KEYS: TextClause = text(
    f"""
    -- The lane step of several keys at once (`lane_admit_many`, migration 0022): each key
    -- decided as ADMIT decides it alone, its wait or supersede logged as ADMIT logs it. A key
    -- the call left out (it or its lane was held elsewhere at that moment, or it is no longer
    -- this caller's) has no row: its caller sends it alone. The arrays are parallel, one
    -- element per key, the keys distinct.
    WITH d AS MATERIALIZED (
        SELECT m.idempotency_key, m.decision, m.superseded_by, m.retry_after
          FROM lane_admit_many(CAST(:keys AS text[]), CAST(:fences AS bigint[]),
                               CAST(:tokens AS text[]), CAST(:orderings AS text[]),
                               CAST(:on_failures AS text[]),
                               CAST(:ttl_seconds AS float8[])) m
    ), step AS (
        SELECT *
          FROM unnest(CAST(:keys AS text[]), CAST(:fences AS bigint[]),
                      CAST(:attempts AS integer[]), CAST(:started_at AS timestamptz[]),
                      CAST(:workers AS text[]))
            AS s(key, fence, attempt, started_at, worker)
    ), logged AS (
        INSERT INTO attempts (idempotency_key, attempt, fence, started_at, outcome, reconciled,
                              status_code, error_code, detail, worker)
        SELECT d.idempotency_key, s.attempt, s.fence, s.started_at,
               CASE d.decision WHEN 'wait' THEN 'deferred_lane' ELSE 'superseded' END, NULL,
               NULL, CASE d.decision WHEN 'wait' THEN 'lane_waiting' ELSE 'superseded' END,
               NULL, s.worker
          FROM d JOIN step s ON s.key = d.idempotency_key
         WHERE d.decision IN ('wait', 'superseded')
        RETURNING idempotency_key
    ), {attempts.trimmed()}
    SELECT idempotency_key, decision, superseded_by, retry_after FROM d
    """
)

WAKE_IDLE_LANES: TextClause = text(
    """
    -- The sweeper's look after lanes whose parked keys have waited past the grace period
    -- with nothing to wake them (a lane whose route lost `order_by`, say): each such lane is
    -- handed on if it is free. A bounded batch of lanes per pass.
    SELECT coalesce(sum(lane_wake(route, lane)), 0) AS woken
      FROM (SELECT DISTINCT route, lane FROM idempotency_keys
             WHERE status = 'pending' AND error_code = 'lane_waiting'
               AND updated_at < now() - make_interval(secs => :grace_seconds)
             LIMIT :limit) idle
    """
)

PURGE_IDLE_LANES: TextClause = text(
    """
    -- Lanes whose keys are all gone and whose time is up: what they remembered (the applied
    -- version) ends with the keys it guarded. A bounded batch at a time.
    WITH doomed AS (
        SELECT l.route, l.lane FROM lanes l
         WHERE l.expires_at < now()
           AND NOT EXISTS (SELECT 1 FROM idempotency_keys k
                            WHERE k.route = l.route AND k.lane = l.lane)
         LIMIT :limit
           FOR UPDATE SKIP LOCKED
    )
    DELETE FROM lanes l USING doomed
     WHERE l.route = doomed.route AND l.lane = doomed.lane
    RETURNING l.route
    """
)
