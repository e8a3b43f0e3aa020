"""The statements behind a route's shared state: breaker, limits, pause and resume.

PostgreSQL holds it (not Redis) for the reasons the key does: a pause or an open circuit must
survive a restart of anything, a resume must queue the waiting keys in the same transaction that
un-pauses the route, closing a circuit must make its waiting keys due in the same statement, and
a permit must be freed by time, not by the worker that holds it. Every statement is one round
trip on a row per route (or per permit slot), and a route without limits whose circuit is closed
costs none of them on the way to a success: its state comes back with the claim.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

ENSURE_ROUTE: TextClause = text(
    """
    -- A route's state row and its permit slots exist before any worker needs them.
    WITH state AS (
        INSERT INTO route_state (route) VALUES (:route) ON CONFLICT (route) DO NOTHING
    )
    INSERT INTO route_permits (route, slot)
    SELECT :route, slot FROM generate_series(0, :max_in_flight - 1) AS slot
    ON CONFLICT (route, slot) DO NOTHING
    RETURNING slot
    """
)

TAKE_PROBE: TextClause = text(
    """
    -- The one probe of a route whose cool-down is over (or whose last probe's time ran out):
    -- the row lock makes it one key at a time across every worker.
    UPDATE route_state
       SET circuit = 'half_open', probe_key = :key, probe_fence = :fence,
           probe_until = now() + make_interval(secs => :probe_seconds), updated_at = now()
     WHERE route = :route
       AND ((circuit = 'open' AND open_until <= now())
            OR (circuit = 'half_open' AND probe_until < now()))
    RETURNING route
    """
)

ROUTE_FAILED: TextClause = text(
    """
    -- One more transient failure in a row. A closed circuit opens at :threshold, or at once
    -- when :opens_now (a Retry-After longer than the route's backoff cap); a failed probe
    -- re-opens it. The cool-down doubles with each re-opening since the last close, up to the
    -- cap, and is never shorter than the downstream's Retry-After. `opened` says this
    -- statement opened it.
    UPDATE route_state r
       SET consecutive_failures = r.consecutive_failures + 1,
           circuit = CASE WHEN p.opening THEN 'open' ELSE r.circuit END,
           reopened_count = CASE WHEN NOT p.opening THEN r.reopened_count
                                 WHEN p.was = 'half_open' THEN r.reopened_count + 1
                                 ELSE 0 END,
           opened_at = CASE WHEN p.opening THEN now() ELSE r.opened_at END,
           open_reason = CASE WHEN p.opening THEN :reason ELSE r.open_reason END,
           open_until = CASE WHEN p.opening THEN now() + make_interval(secs => GREATEST(
                                 LEAST(:cooldown_cap, :cooldown * power(2, LEAST(
                                     CASE WHEN p.was = 'half_open'
                                          THEN r.reopened_count + 1 ELSE 0 END, 30))),
                                 COALESCE(CAST(:retry_after AS double precision), 0)))
                             ELSE r.open_until END,
           probe_key = CASE WHEN p.opening THEN NULL ELSE r.probe_key END,
           probe_fence = CASE WHEN p.opening THEN NULL ELSE r.probe_fence END,
           probe_until = CASE WHEN p.opening THEN NULL ELSE r.probe_until END,
           updated_at = now()
      FROM (SELECT route, circuit AS was,
                   (circuit = 'closed'
                    AND (consecutive_failures + 1 >= :threshold OR :opens_now))
                   OR (circuit = 'half_open' AND probe_key = :key
                       AND probe_fence = :fence) AS opening
              FROM route_state WHERE route = :route FOR UPDATE) p
     WHERE r.route = p.route
    RETURNING r.circuit, p.opening AS opened,
              EXTRACT(EPOCH FROM r.open_until - now()) AS cooldown_seconds
    """
)

ROUTE_ANSWERED: TextClause = text(
    """
    -- The downstream answered (a success, or a refusal that proves it is up): the streak ends
    -- and an open or half-open circuit closes. The keys that waited on the circuit become due
    -- now, in the same statement, so recovery does not wait for their old probe times.
    WITH previous AS (
        SELECT route, circuit FROM route_state WHERE route = :route FOR UPDATE
    ), closed AS (
        UPDATE route_state r
           SET consecutive_failures = 0, circuit = 'closed', reopened_count = 0,
               open_until = NULL, probe_key = NULL, probe_fence = NULL, probe_until = NULL,
               updated_at = now()
          FROM previous p
         WHERE r.route = p.route AND (r.consecutive_failures > 0 OR r.circuit <> 'closed')
        RETURNING p.circuit AS previous_circuit
    ), due AS (
        UPDATE idempotency_keys k
           SET next_attempt_at = now()
         WHERE k.route = :route AND k.status = 'failed_retryable' AND k.actor = 'worker'
           AND k.error_code = 'circuit_open' AND k.next_attempt_at > now()
           AND EXISTS (SELECT 1 FROM closed WHERE previous_circuit <> 'closed')
        RETURNING k.idempotency_key
    ), moved AS (
        UPDATE outbox o SET available_at = now()
          FROM due
         WHERE o.idempotency_key = due.idempotency_key AND o.published_at IS NULL
    )
    SELECT previous_circuit, (SELECT count(*) FROM due) AS released FROM closed
    """
)

RESERVE_RATE: TextClause = text(
    """
    -- Book the route's next send slot (GCRA): slots 1/rate apart, `burst` of them at once after
    -- a quiet spell. Returns how long until this booking's slot; the row lock orders concurrent
    -- bookings, and clock_timestamp() is used because the wait matters to the millisecond.
    INSERT INTO route_state AS r (route, rate_tat)
    VALUES (:route, clock_timestamp() + make_interval(secs => 1.0 / :rate))
    ON CONFLICT (route) DO UPDATE
       SET rate_tat = GREATEST(r.rate_tat, clock_timestamp()) + make_interval(secs => 1.0 / :rate)
    RETURNING GREATEST(0, EXTRACT(EPOCH FROM r.rate_tat - clock_timestamp())
                          - CAST(:burst AS double precision) / :rate)
              AS wait_seconds
    """
)

TAKE_PERMIT: TextClause = text(
    """
    -- Hold one of the route's max_in_flight slots for this claim. A slot is free when nobody
    -- holds it or its holder's time ran out (a dead worker's slot frees itself within a lease).
    -- SKIP LOCKED keeps concurrent takers on different slots; the test is on the slot row only.
    UPDATE route_permits p
       SET holder_key = :key, holder_fence = :fence,
           holder_until = now() + make_interval(secs => :lease_seconds)
     WHERE (p.route, p.slot) = (
           SELECT route, slot FROM route_permits
            WHERE route = :route AND slot < :max_in_flight
              AND (holder_until IS NULL OR holder_until < now())
            ORDER BY slot
            LIMIT 1
              FOR UPDATE SKIP LOCKED)
    RETURNING p.slot
    """
)

RENEW_PERMIT: TextClause = text(
    """
    -- The permit lives as long as the holder's lease: renewed with it, by the same holder only.
    UPDATE route_permits SET holder_until = :until
     WHERE route = :route AND slot = :slot AND holder_key = :key AND holder_fence = :fence
    RETURNING slot
    """
)

RELEASE_PERMIT: TextClause = text(
    """
    -- The action is over: the slot is free at once (only its own holder frees it).
    UPDATE route_permits SET holder_key = NULL, holder_fence = NULL, holder_until = NULL
     WHERE route = :route AND slot = :slot AND holder_key = :key AND holder_fence = :fence
    RETURNING slot
    """
)

PAUSE_ROUTE: TextClause = text(
    """
    -- An operator stops a route: its keys wait as pending from the next claim on. Answers
    -- only when this call paused it (a second pause changes nothing).
    INSERT INTO route_state AS r (route, paused, paused_reason, paused_by, paused_at)
    VALUES (:route, true, :reason, :by, now())
    ON CONFLICT (route) DO UPDATE
       SET paused = true, paused_reason = :reason, paused_by = :by, paused_at = now(),
           updated_at = now()
     WHERE NOT r.paused
    RETURNING route
    """
)

RESUME_ROUTE: TextClause = text(
    """
    -- An operator lets a paused route go again. It takes the row lock that DEFER shares, so
    -- ENQUEUE_RESUMED (the next statement, a fresh snapshot) sees every key held by the pause.
    UPDATE route_state
       SET paused = false, paused_reason = NULL, paused_by = NULL, paused_at = NULL,
           updated_at = now()
     WHERE route = :route AND paused
    RETURNING route
    """
)

ENQUEUE_RESUMED: TextClause = text(
    """
    -- After a resume: a delivery for each pending worker key of the route that has none
    -- waiting, in the order the keys were accepted (the relay sends rows in id order).
    INSERT INTO outbox (idempotency_key, task_name, correlation_id)
    SELECT k.idempotency_key, :task_name, k.correlation_id
      FROM idempotency_keys k
     WHERE k.route = :route AND k.status = 'pending' AND k.actor = 'worker'
       AND NOT EXISTS (SELECT 1 FROM outbox o
                        WHERE o.idempotency_key = k.idempotency_key AND o.published_at IS NULL)
     ORDER BY k.created_at, k.idempotency_key
    RETURNING idempotency_key
    """
)

RECORD_ROUTE_CHANGE: TextClause = text(
    """
    INSERT INTO route_changes (route, action, reason, requested_by)
    VALUES (:route, :action, :reason, :by)
    RETURNING id
    """
)

ROUTE_STATES: TextClause = text(
    """
    -- Every route's shared state, with how far off its probe is.
    SELECT route, paused, paused_reason, paused_by, paused_at, circuit, consecutive_failures,
           reopened_count, opened_at, open_until, open_reason,
           GREATEST(0, EXTRACT(EPOCH FROM open_until - now())) AS probe_in_seconds
      FROM route_state
    """
)

ROUTE_LOAD: TextClause = text(
    """
    -- Keys waiting (pending or a retry) and attempts running (a live lease), by route; each
    -- half reads its own partial index, never the finished keys.
    SELECT route, count(*) AS waiting, 0 AS in_flight
      FROM idempotency_keys
     WHERE status IN ('pending', 'failed_retryable') AND actor = 'worker'
     GROUP BY route
    UNION ALL
    SELECT route, 0, count(*)
      FROM idempotency_keys
     WHERE status = 'processing' AND locked_until > now() AND actor = 'worker'
     GROUP BY route
    """
)
