"""The statements behind a route's shared state: breaker, limits, pause and resume.

PostgreSQL holds it (not Redis) for the reasons the key does: a pause or an open circuit must
survive a restart of anything, a resume must un-pause the route under the lock that every
deferral shares, and a permit must be freed by time, not by the worker that holds it. Every
statement is one round trip on a row per route (or per permit slot), and a route without limits
whose circuit is closed costs none of them on the way to a success: its state comes back with
the claim, and the successes a worker saw are counted into the breaker's window at most once a
second (`ROUTE_CALLS`). The bulk steps (releasing the keys a circuit held, queueing the keys a
pause held) run a bounded batch per statement from an index of just those keys.
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

TAKE_TRIAL: TextClause = text(
    """
    -- One of the half-open route's trial calls, for a key that is not already one: when the
    -- cool-down is over (the first trial turns open into half-open), while fewer than :trials
    -- run, or when the running ones' time ran out (their workers died). The row lock makes
    -- the count hold across every worker.
    UPDATE route_state
       SET circuit = 'half_open',
           trial_keys = CASE WHEN circuit = 'open' OR probe_until < now()
                             THEN ARRAY[CAST(:key AS text)]
                             ELSE array_append(trial_keys, CAST(:key AS text)) END,
           trial_failures = CASE WHEN circuit = 'open' THEN 0 ELSE trial_failures END,
           probe_until = GREATEST(CASE WHEN circuit = 'half_open' AND probe_until >= now()
                                       THEN probe_until END,
                                  now() + make_interval(secs => :probe_seconds)),
           updated_at = now()
     WHERE route = :route
       AND ((circuit = 'open' AND open_until <= now())
            OR (circuit = 'half_open'
                AND (probe_until < now()
                     OR (cardinality(trial_keys) < :trials
                         AND NOT CAST(:key AS text) = ANY(trial_keys)))))
    RETURNING route
    """
)

ROUTE_CALLS: TextClause = text(
    """
    -- Count calls at the downstream into the route's sliding window: :successes answers and,
    -- when :failed, one transient failure of :key. The window is two buckets of :window
    -- seconds; the one before counts by the share of it still inside the window. Decides in
    -- the same statement, under the row lock:
    --   closed    → open when the window holds :minimum_calls calls of which :rate failed,
    --               from at least three keys (fewer if :minimum_calls is lower), or at once on
    --               :opens_now (a Retry-After longer than the route's backoff cap);
    --   half-open → a trial's answer closes it (and starts a fresh window); :trials failed
    --               trials (or :opens_now) re-open it.
    -- Each re-opening since the last close doubles the cool-down, up to :cooldown_cap, never
    -- shorter than the downstream's Retry-After; one by a request that was never sent
    -- (:not_sent, a refused connection) re-opens for :cooldown and is not counted, so a
    -- downstream down for minutes does not leave a sent failure after it a doubled cool-down.
    -- `opened` / `closed` say this statement did it, and a `route_changes` row records it in
    -- the same statement (the notifier reads those).
    WITH p AS (
        SELECT route, circuit AS was, trial_failures, reopened_count,
               CAST(:key AS text) = ANY(trial_keys) AND circuit = 'half_open' AS trial,
               CASE WHEN window_started_at IS NULL
                         OR window_started_at <= now() - make_interval(secs => 2 * :window)
                    THEN 'fresh'
                    WHEN window_started_at <= now() - make_interval(secs => :window)
                    THEN 'rolled'
                    ELSE 'same' END AS step,
               window_started_at, window_calls, window_failures, previous_calls,
               previous_failures, failed_keys
          FROM route_state WHERE route = :route FOR UPDATE
    ), w AS (
        SELECT p.*,
               CASE step WHEN 'fresh' THEN now()
                         WHEN 'rolled' THEN window_started_at + make_interval(secs => :window)
                         ELSE window_started_at END AS started,
               CASE step WHEN 'same' THEN window_calls ELSE 0 END + :successes
                   + CASE WHEN :failed THEN 1 ELSE 0 END AS calls,
               CASE step WHEN 'same' THEN window_failures ELSE 0 END
                   + CASE WHEN :failed THEN 1 ELSE 0 END AS failures,
               CASE step WHEN 'fresh' THEN 0 WHEN 'rolled' THEN window_calls
                         ELSE previous_calls END AS before_calls,
               CASE step WHEN 'fresh' THEN 0 WHEN 'rolled' THEN window_failures
                         ELSE previous_failures END AS before_failures,
               CASE WHEN step = 'fresh' THEN CAST('{}' AS text[]) ELSE failed_keys END AS keys
          FROM p
    ), k AS (
        SELECT w.*,
               CASE WHEN :failed AND cardinality(keys) < 3 AND NOT CAST(:key AS text) = ANY(keys)
                    THEN array_append(keys, CAST(:key AS text)) ELSE keys END AS failing_keys,
               GREATEST(0, 1 - EXTRACT(EPOCH FROM now() - started) / :window) AS weight
          FROM w
    ), d AS (
        SELECT k.*,
               before_calls * weight + calls AS estimated_calls,
               before_failures * weight + failures AS estimated_failures,
               :failed AND (
                   (was = 'closed'
                    AND (:opens_now
                         OR (before_calls * weight + calls >= :minimum_calls
                             AND before_failures * weight + failures
                                 >= :rate * (before_calls * weight + calls)
                             AND cardinality(failing_keys) >= LEAST(3, :minimum_calls))))
                   OR (was = 'half_open' AND (:opens_now
                                              OR (trial AND trial_failures + 1 >= :trials))))
                   AS opening,
               trial AND NOT :failed AS closing
          FROM k
    ), u AS (
    UPDATE route_state r
       SET circuit = CASE WHEN d.opening THEN 'open' WHEN d.closing THEN 'closed'
                          ELSE r.circuit END,
           reopened_count = CASE WHEN d.opening AND d.was = 'half_open' AND NOT :not_sent
                                 THEN r.reopened_count + 1
                                 WHEN d.opening AND d.was = 'half_open'
                                 THEN r.reopened_count
                                 WHEN d.opening OR d.closing THEN 0
                                 ELSE r.reopened_count END,
           opened_at = CASE WHEN d.opening THEN now() ELSE r.opened_at END,
           open_reason = CASE WHEN d.opening THEN :reason ELSE r.open_reason END,
           open_until = CASE WHEN d.opening THEN now() + make_interval(secs => GREATEST(
                                 LEAST(:cooldown_cap, :cooldown * power(2, LEAST(
                                     CASE WHEN d.was = 'half_open'
                                          THEN r.reopened_count + 1 ELSE 0 END, 30))),
                                 COALESCE(CAST(:retry_after AS double precision), 0)))
                             WHEN d.closing THEN NULL
                             ELSE r.open_until END,
           trial_keys = CASE WHEN d.opening OR d.closing THEN CAST('{}' AS text[])
                             WHEN d.trial THEN array_remove(r.trial_keys, CAST(:key AS text))
                             ELSE r.trial_keys END,
           trial_failures = CASE WHEN d.opening OR d.closing THEN 0
                                 WHEN d.trial AND :failed THEN r.trial_failures + 1
                                 ELSE r.trial_failures END,
           probe_until = CASE WHEN d.opening OR d.closing THEN NULL ELSE r.probe_until END,
           window_started_at = CASE WHEN d.closing THEN now() ELSE d.started END,
           window_calls = CASE WHEN d.closing THEN 0 ELSE d.calls END,
           window_failures = CASE WHEN d.closing THEN 0 ELSE d.failures END,
           previous_calls = CASE WHEN d.closing THEN 0 ELSE d.before_calls END,
           previous_failures = CASE WHEN d.closing THEN 0 ELSE d.before_failures END,
           failed_keys = CASE WHEN d.closing THEN CAST('{}' AS text[]) ELSE d.failing_keys END,
           updated_at = now()
      FROM d
     WHERE r.route = d.route
    RETURNING r.route, r.circuit, d.opening AS opened, d.closing AS closed,
              round(CAST(d.estimated_calls AS numeric), 1) AS calls,
              round(CAST(d.estimated_failures AS numeric), 1) AS failures,
              EXTRACT(EPOCH FROM r.open_until - now()) AS cooldown_seconds
    ), changed AS (
        INSERT INTO route_changes (route, action, reason, requested_by)
        SELECT route, CASE WHEN opened THEN 'circuit_opened' ELSE 'circuit_closed' END,
               CASE WHEN opened THEN :reason ELSE 'trial_succeeded' END, 'breaker'
          FROM u WHERE opened OR closed
    )
    SELECT circuit, opened, closed, calls, failures, cooldown_seconds FROM u
    """
)

HELD_TAIL: TextClause = text(
    """
    -- When the last key the route's open circuit holds is due, in seconds from now (None: no
    -- key waits): one probe of the index of just those keys, however many there are.
    SELECT EXTRACT(EPOCH FROM max(next_attempt_at) - now()) AS seconds
      FROM idempotency_keys
     WHERE route = :route AND status = 'failed_retryable' AND error_code = 'circuit_open'
    """
)

RELEASE_CIRCUIT_HELD: TextClause = text(
    """
    -- After the circuit closed: make up to :batch keys that waited on it due now (they and
    -- their deliveries), while it stays closed. Run until it answers 0; each batch is its own
    -- short statement on an index of just those keys, and an interrupted release leaves the
    -- rest due at the time they were given (a cool-down at most): safe to stop and rerun.
    -- A key whose last request may still land is due once it can no longer land.
    WITH closed AS (
        SELECT 1 FROM route_state WHERE route = :route AND circuit = 'closed'
    ), held AS (
        SELECT idempotency_key
          FROM idempotency_keys
         WHERE route = :route AND status = 'failed_retryable' AND error_code = 'circuit_open'
           AND actor = 'worker' AND EXISTS (SELECT 1 FROM closed)
         ORDER BY next_attempt_at
         LIMIT :batch
           FOR UPDATE SKIP LOCKED
    ), released AS (
        UPDATE idempotency_keys k
           SET next_attempt_at = GREATEST(now(), k.in_flight_until),
               error_code = 'circuit_closed',
               error_detail = 'the route''s circuit closed: due now', updated_at = now()
          FROM held
         WHERE k.idempotency_key = held.idempotency_key
        RETURNING k.idempotency_key, k.in_flight_until
    ), moved AS (
        UPDATE outbox o SET available_at = GREATEST(now(), released.in_flight_until)
          FROM released
         WHERE o.idempotency_key = released.idempotency_key AND o.published_at IS NULL
    )
    SELECT count(*) AS released FROM released
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
    -- An operator lets a paused route go again. It takes the row lock that DEFER shares: a
    -- key deferred before it is pending as `route_paused` (ENQUEUE_RESUMED queues it), a key
    -- deferred after it waits for its own delivery.
    UPDATE route_state
       SET paused = false, paused_reason = NULL, paused_by = NULL, paused_at = NULL,
           updated_at = now()
     WHERE route = :route AND paused
    RETURNING route
    """
)

ENQUEUE_RESUMED: TextClause = text(
    """
    -- After a resume, one batch: a delivery for up to :batch keys the pause held, the
    -- earliest accepted first (the relay sends rows in id order), while the route is not
    -- paused again. A queued key leaves the index it was found by, so running this until it
    -- answers 0 queues each held key once, and an interrupted resume is finished by running
    -- it again. A key whose last request may still land is due once it can no longer land.
    WITH running AS (
        SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM route_state WHERE route = :route AND paused)
    ), held AS (
        SELECT idempotency_key
          FROM idempotency_keys
         WHERE route = :route AND status = 'pending' AND error_code = 'route_paused'
           AND actor = 'worker' AND EXISTS (SELECT 1 FROM running)
         ORDER BY created_at, idempotency_key
         LIMIT :batch
           FOR UPDATE SKIP LOCKED
    ), resumed AS (
        UPDATE idempotency_keys k
           SET error_code = NULL, error_detail = NULL, updated_at = now()
          FROM held
         WHERE k.idempotency_key = held.idempotency_key
        RETURNING k.idempotency_key, k.correlation_id, k.created_at, k.in_flight_until
    ), queued AS (
        INSERT INTO outbox (idempotency_key, task_name, correlation_id, available_at)
        SELECT r.idempotency_key, :task_name, r.correlation_id,
               GREATEST(now(), r.in_flight_until)
          FROM resumed r
         WHERE NOT EXISTS (SELECT 1 FROM outbox o
                            WHERE o.idempotency_key = r.idempotency_key
                              AND o.published_at IS NULL)
         ORDER BY r.created_at, r.idempotency_key
    )
    SELECT count(*) AS queued FROM resumed
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
    SELECT route, paused, paused_reason, paused_by, paused_at, circuit, reopened_count,
           opened_at, open_until, open_reason, window_calls + previous_calls AS window_calls,
           window_failures + previous_failures AS window_failures,
           cardinality(trial_keys) AS trials_running, trial_failures,
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
