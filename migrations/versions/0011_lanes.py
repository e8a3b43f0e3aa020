"""Ordering lanes: events of one business object acted on one at a time, stale versions superseded.

A route with `order_by` gives each event a lane (the value its pointer names in the payload, or
the external id) and a rank in it: the event's version under `versions = "supersede"`, else the
order of acceptance (`lane_acceptance`). This revision adds:

- `idempotency_keys.lane`, `.lane_rank` and `.superseded_by`, and the terminal status
  `superseded` (no action; the version that superseded it is kept). A dead letter superseded by
  a newer version is resolved as `superseded`.
- `lanes`: one row per active lane, the lock every lane decision and every lane key's status
  change takes, and what the lane remembers: the highest version applied (`applied_rank`,
  `applied_version`). Purged with the lane's keys (`expires_at`).
- `lane_admit(...)`: the lane step of an attempt, decided and written in one call under the
  lane's lock: `go`, `wait` (the key is parked as pending with no delivery, its attempt given
  back), `superseded` (recorded), or `lost` (the caller no longer holds the key). Each query of
  a PL/pgSQL function takes a fresh snapshot, so what it reads after taking the lock is what
  every earlier holder of the lock committed.
- `lane_wake(route, lane)`: hands the lane on to its next parked key (an outbox row), when the
  lane is free; under `supersede` parked keys older than the one woken are superseded first.
- Triggers that call `lane_wake` in the same transaction as the change that frees a lane: a
  lane key leaving `processing` (success, retry, dead letter, deferral, supersession) and a
  lane's dead letter discarded. No path of the gateway can free a lane and forget to hand it
  on, and no path needs to know lanes exist.

Lock order, everywhere: the key's own row, then the lane's row, then other keys of the lane
only with SKIP LOCKED. A gate and a status change of two keys of one lane can therefore wait
for each other but never deadlock.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_STATUSES = (
    "'pending', 'processing', 'succeeded', 'failed_retryable', 'failed_final', 'quarantined'"
)

# Keys of a lane that still hold its order (not finished): the gate's and the wake's look.
_LIVE = "('pending', 'processing', 'failed_retryable')"

# The version an event of a key was sent with (supersede compares ranks; operators read this).
# A function, so the way from a key to its event is written once (fan-out's deliveries share
# their event: migration 0015 follows them).
_KEY_VERSION = """
CREATE FUNCTION key_version(p_key text) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT version FROM events WHERE idempotency_key = p_key
$$
"""

_SUPERSEDE_OLDER = """
CREATE FUNCTION lane_supersede_older(
    p_route text, p_lane text, p_rank numeric, p_version text, p_blocking boolean
) RETURNS integer LANGUAGE plpgsql AS $$
-- Keys of the lane older than rank p_rank that wait (parked, or, when dead letters hold the
-- lane (p_blocking), dead-lettered) are superseded by version p_version: latest wins, and the
-- older never runs. Under `skip` an older dead letter stays open for an operator (a replay of
-- it is superseded at its gate). Keys another transaction holds are skipped (their own gate
-- decides), at most 1000 per call.
DECLARE
    n integer;
BEGIN
    WITH older AS (
        SELECT k.idempotency_key FROM idempotency_keys k
         WHERE k.route = p_route AND k.lane = p_lane AND k.lane_rank < p_rank
           AND ((k.status = 'pending' AND k.error_code = 'lane_waiting')
                OR (p_blocking AND k.status IN ('failed_final', 'quarantined')))
         ORDER BY k.lane_rank
         LIMIT 1000
           FOR UPDATE SKIP LOCKED
    ), superseded AS (
        UPDATE idempotency_keys k
           SET status = 'superseded', superseded_by = p_version, error_code = NULL,
               error_detail = NULL, uncertain = false, next_attempt_at = NULL,
               updated_at = now()
          FROM older WHERE k.idempotency_key = older.idempotency_key
        RETURNING k.idempotency_key
    ), resolved AS (
        UPDATE dead_letters d
           SET resolution = 'superseded', resolved_by = 'lane', resolved_at = now(),
               resolution_note = 'superseded by version ' || p_version
          FROM superseded s
         WHERE d.idempotency_key = s.idempotency_key AND d.resolution = 'open'
    )
    SELECT count(*) INTO n FROM superseded;
    RETURN n;
END
$$
"""

_ADMIT = f"""
CREATE FUNCTION lane_admit(
    p_key text, p_fence bigint, p_token text, p_ordering text, p_on_failure text,
    p_ttl_seconds float8
) RETURNS TABLE (decision text, superseded_by text, retry_after integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    k record;
    ln record;
    v_newer text;
    v_wait integer;
BEGIN
    -- The key, still held by this caller (its row first: the lock order of every path).
    SELECT i.idempotency_key, i.route, i.lane, i.lane_rank, i.uncertain,
           key_version(i.idempotency_key) AS version INTO k
      FROM idempotency_keys i
     WHERE i.idempotency_key = p_key AND i.fence = p_fence AND i.lease_token = p_token
       AND i.status = 'processing'
       FOR UPDATE OF i;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'lost'::text, NULL::text, 0;
        RETURN;
    END IF;
    -- The lane's row, made if new and locked: every decision below reads after this lock.
    INSERT INTO lanes AS l (route, lane, ordering, on_failure, expires_at)
    VALUES (k.route, k.lane, p_ordering, p_on_failure,
            now() + make_interval(secs => p_ttl_seconds))
    ON CONFLICT (route, lane) DO UPDATE
       SET ordering = EXCLUDED.ordering, on_failure = EXCLUDED.on_failure,
           expires_at = GREATEST(l.expires_at, EXCLUDED.expires_at), updated_at = now()
    RETURNING l.applied_rank, l.applied_version INTO ln;

    IF p_ordering = 'supersede' THEN
        -- Applied already, or a newer version waits or runs: this one never acts. Unless an
        -- earlier attempt of this one may have reached the downstream (uncertain): it goes
        -- first and ends certain (reconcile, or act), and the newer one goes after it, so
        -- a late write of the older never lands over the newer.
        IF ln.applied_rank IS NOT NULL AND ln.applied_rank >= k.lane_rank THEN
            v_newer := ln.applied_version;
        ELSIF NOT k.uncertain THEN
            SELECT key_version(o.idempotency_key) INTO v_newer
              FROM idempotency_keys o
             WHERE o.route = k.route AND o.lane = k.lane AND o.lane_rank > k.lane_rank
               AND (o.status IN {_LIVE}
                    OR (p_on_failure = 'block' AND o.status IN ('failed_final', 'quarantined')
                        AND EXISTS (SELECT 1 FROM dead_letters d
                                     WHERE d.idempotency_key = o.idempotency_key
                                       AND d.resolution = 'open')))
             ORDER BY o.lane_rank DESC
             LIMIT 1;
        END IF;
        IF v_newer IS NOT NULL THEN
            UPDATE idempotency_keys
               SET status = 'superseded', superseded_by = v_newer, error_code = NULL,
                   error_detail = NULL, uncertain = false, lease_token = NULL,
                   lease_owner = NULL, locked_until = NULL, next_attempt_at = NULL,
                   updated_at = now()
             WHERE idempotency_key = p_key;
            RETURN QUERY SELECT 'superseded'::text, v_newer, 0;
            RETURN;
        END IF;
        -- This is the newest: older keys waiting (or a dead letter blocking) are superseded.
        PERFORM lane_supersede_older(
            k.route, k.lane, k.lane_rank, k.version, p_on_failure = 'block');
    END IF;

    -- Another key of the lane runs (a live lease or one a re-drive will take over) or, a
    -- worker's key, waits to retry after an outcome that may have reached the downstream (its
    -- retry is scheduled; a workflow that failed a claim may never come back, so its key does
    -- not hold the lane); or, in acceptance order, an older key has not finished or holds the
    -- lane with a dead letter.
    -- (Measured from the clock, not the transaction's start: a lease taken after this
    -- transaction began would otherwise look longer than it is.)
    SELECT GREATEST(1, CEIL(EXTRACT(EPOCH FROM
               max(COALESCE(o.locked_until, o.next_attempt_at)) - clock_timestamp())))::integer
      INTO v_wait
      FROM idempotency_keys o
     WHERE o.route = k.route AND o.lane = k.lane AND o.idempotency_key <> p_key
       AND (o.status = 'processing'
            OR (o.status = 'failed_retryable' AND o.uncertain AND o.actor = 'worker'))
    HAVING count(*) > 0;
    -- (An older key counts whether it waits or runs: it may have been claimed since the
    -- look above, which took its own snapshot; claims do not take the lane's lock.)
    IF v_wait IS NULL AND p_ordering = 'accepted' AND EXISTS (
        SELECT 1 FROM idempotency_keys o
         WHERE o.route = k.route AND o.lane = k.lane AND o.lane_rank < k.lane_rank
           AND (o.status IN ('pending', 'processing', 'failed_retryable')
                OR (p_on_failure = 'block' AND o.status IN ('failed_final', 'quarantined')
                    AND EXISTS (SELECT 1 FROM dead_letters d
                                 WHERE d.idempotency_key = o.idempotency_key
                                   AND d.resolution = 'open')))
    ) THEN
        v_wait := 1;
    END IF;
    IF v_wait IS NOT NULL THEN
        -- Parked: pending with no delivery, the claim's attempt given back. The lane's next
        -- change hands it on (lane_wake); the sweeper looks after a lane left idle.
        UPDATE idempotency_keys
           SET status = 'pending', attempts = GREATEST(attempts - 1, 0),
               error_code = 'lane_waiting',
               error_detail = 'waiting for the earlier events of its lane',
               lease_token = NULL, lease_owner = NULL, locked_until = NULL,
               next_attempt_at = NULL, updated_at = now()
         WHERE idempotency_key = p_key;
        -- An older key may have parked behind this one while it was claimed (each saw the
        -- other running): with this one parked, the lane may be free for the oldest.
        PERFORM lane_wake(k.route, k.lane);
        RETURN QUERY SELECT 'wait'::text, NULL::text, v_wait;
        RETURN;
    END IF;
    RETURN QUERY SELECT 'go'::text, NULL::text, 0;
END
$$
"""

_WAKE = """
CREATE FUNCTION lane_wake(p_route text, p_lane text) RETURNS integer
LANGUAGE plpgsql AS $$
#variable_conflict use_column
-- Hand a free lane to its next parked key: the oldest in acceptance order, the newest under
-- supersede (older parked keys are superseded by it first). Nothing when a key of the lane
-- runs or waits to retry an outcome that may have reached the downstream, or (acceptance
-- order) an older key is still on its way or holds the lane with a dead letter: that key's
-- own change wakes the lane later.
DECLARE
    ln record;
    nxt record;
BEGIN
    SELECT ordering, on_failure INTO ln FROM lanes
     WHERE route = p_route AND lane = p_lane FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    IF EXISTS (SELECT 1 FROM idempotency_keys
                WHERE route = p_route AND lane = p_lane
                  AND (status = 'processing'
                       OR (status = 'failed_retryable' AND uncertain AND actor = 'worker')))
    THEN
        RETURN 0;
    END IF;
    -- Two statements, each walking the lane index in its own direction: the first parked key
    -- is found at once however many wait.
    IF ln.ordering = 'supersede' THEN
        SELECT k.idempotency_key, k.lane_rank, k.correlation_id,
               key_version(k.idempotency_key) AS version INTO nxt
          FROM idempotency_keys k
         WHERE k.route = p_route AND k.lane = p_lane AND k.status = 'pending'
           AND k.error_code = 'lane_waiting' AND k.actor = 'worker'
         ORDER BY k.lane_rank DESC
         LIMIT 1
           FOR UPDATE OF k SKIP LOCKED;
    ELSE
        SELECT k.idempotency_key, k.lane_rank, k.correlation_id,
               key_version(k.idempotency_key) AS version INTO nxt
          FROM idempotency_keys k
         WHERE k.route = p_route AND k.lane = p_lane AND k.status = 'pending'
           AND k.error_code = 'lane_waiting' AND k.actor = 'worker'
         ORDER BY k.lane_rank
         LIMIT 1
           FOR UPDATE OF k SKIP LOCKED;
    END IF;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    IF ln.ordering = 'accepted' AND EXISTS (
        SELECT 1 FROM idempotency_keys o
         WHERE o.route = p_route AND o.lane = p_lane AND o.lane_rank < nxt.lane_rank
           AND ((o.status IN ('pending', 'failed_retryable')
                 AND o.error_code IS DISTINCT FROM 'lane_waiting')
                OR (ln.on_failure = 'block' AND o.status IN ('failed_final', 'quarantined')
                    AND EXISTS (SELECT 1 FROM dead_letters d
                                 WHERE d.idempotency_key = o.idempotency_key
                                   AND d.resolution = 'open')))
    ) THEN
        RETURN 0;
    END IF;
    IF ln.ordering = 'supersede' THEN
        PERFORM lane_supersede_older(
            p_route, p_lane, nxt.lane_rank, nxt.version, ln.on_failure = 'block');
    END IF;
    UPDATE idempotency_keys
       SET error_code = 'lane_released', error_detail = 'its lane is free', updated_at = now()
     WHERE idempotency_key = nxt.idempotency_key;
    INSERT INTO outbox (idempotency_key, task_name, correlation_id)
    VALUES (nxt.idempotency_key, 'idem.process', nxt.correlation_id);
    RETURN 1;
END
$$
"""

_KEY_LEFT_PROCESSING = """
CREATE FUNCTION lane_key_left_processing() RETURNS trigger LANGUAGE plpgsql AS $$
-- A lane key's status changed away from processing (in the statement that changed it): a
-- success under supersede is remembered as the lane's applied version, then the lane is
-- handed on. A key parking itself behind its lane (lane_waiting) hands nothing on.
BEGIN
    IF NEW.status = 'succeeded' THEN
        UPDATE lanes l
           SET applied_rank = NEW.lane_rank,
               applied_version = key_version(NEW.idempotency_key),
               applied_key = NEW.idempotency_key,
               expires_at = GREATEST(l.expires_at, NEW.expires_at), updated_at = now()
         WHERE l.route = NEW.route AND l.lane = NEW.lane AND l.ordering = 'supersede'
           AND (l.applied_rank IS NULL OR l.applied_rank < NEW.lane_rank);
    END IF;
    PERFORM lane_wake(NEW.route, NEW.lane);
    RETURN NULL;
END
$$
"""

_DEAD_LETTER_DISCARDED = """
CREATE FUNCTION lane_dead_letter_discarded() RETURNS trigger LANGUAGE plpgsql AS $$
-- A dead letter an operator discarded no longer holds its lane: hand the lane on.
DECLARE
    k record;
BEGIN
    SELECT route, lane INTO k FROM idempotency_keys
     WHERE idempotency_key = NEW.idempotency_key AND lane IS NOT NULL;
    IF FOUND THEN
        PERFORM lane_wake(k.route, k.lane);
    END IF;
    RETURN NULL;
END
$$
"""


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE idempotency_keys
            ADD COLUMN lane          text,
            ADD COLUMN lane_rank     numeric,
            ADD COLUMN superseded_by text
        """
    )
    op.execute("ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_status_check")
    # NOT VALID then VALIDATE: the check is wider than the one it replaces, and validating it
    # takes no lock that stops writers.
    op.execute(
        "ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_status_check"
        f" CHECK (status IN ({_STATUSES}, 'superseded')) NOT VALID"
    )
    op.execute("ALTER TABLE idempotency_keys VALIDATE CONSTRAINT idempotency_keys_status_check")
    op.execute("ALTER TABLE dead_letters DROP CONSTRAINT dead_letters_resolution_check")
    op.execute(
        "ALTER TABLE dead_letters ADD CONSTRAINT dead_letters_resolution_check"
        " CHECK (resolution IN ('open', 'replayed', 'discarded', 'superseded')) NOT VALID"
    )
    op.execute("ALTER TABLE dead_letters VALIDATE CONSTRAINT dead_letters_resolution_check")
    op.execute("CREATE SEQUENCE lane_acceptance")
    op.execute(
        """
        CREATE TABLE lanes (
            route            text NOT NULL,
            lane             text NOT NULL,
            ordering         text NOT NULL CHECK (ordering IN ('accepted', 'supersede')),
            on_failure       text NOT NULL CHECK (on_failure IN ('block', 'skip')),
            applied_rank     numeric,
            applied_version  text,
            applied_key      text,
            created_at       timestamptz NOT NULL DEFAULT now(),
            updated_at       timestamptz NOT NULL DEFAULT now(),
            expires_at       timestamptz NOT NULL,
            PRIMARY KEY (route, lane)
        )
        """
    )
    op.execute("CREATE INDEX lanes_expires_idx ON lanes (expires_at)")
    # A lane's unfinished keys in lane order: every lane decision is a range of this index,
    # which finished keys leave, so a long-lived lane costs no more than a new one.
    op.execute(
        "CREATE INDEX idempotency_keys_lane_idx ON idempotency_keys (route, lane, lane_rank)"
        " WHERE lane IS NOT NULL AND status IN"
        " ('pending', 'processing', 'failed_retryable', 'failed_final', 'quarantined')"
    )
    # Superseded keys, counted exactly by /v1/stats and /metrics (an index of their own:
    # they are finished, like succeeded ones, and leave the lane index).
    op.execute(
        "CREATE INDEX idempotency_keys_superseded_idx ON idempotency_keys (updated_at)"
        " WHERE status = 'superseded'"
    )
    # Purge's "is any key of this lane left?".
    op.execute(
        "CREATE INDEX idempotency_keys_lane_keys_idx ON idempotency_keys (route, lane)"
        " WHERE lane IS NOT NULL"
    )
    # The sweeper's look for lanes whose parked keys wait longer than they should.
    op.execute(
        "CREATE INDEX idempotency_keys_lane_parked_idx ON idempotency_keys (updated_at)"
        " WHERE status = 'pending' AND error_code = 'lane_waiting'"
    )
    op.execute(_KEY_VERSION)
    op.execute(_SUPERSEDE_OLDER)
    op.execute(_ADMIT)
    op.execute(_WAKE)
    op.execute(_KEY_LEFT_PROCESSING)
    op.execute(_DEAD_LETTER_DISCARDED)
    op.execute(
        """
        CREATE TRIGGER lane_key_left_processing
        AFTER UPDATE OF status ON idempotency_keys
        FOR EACH ROW
        WHEN (NEW.lane IS NOT NULL AND OLD.status = 'processing'
              AND NEW.status <> 'processing'
              AND NEW.error_code IS DISTINCT FROM 'lane_waiting')
        EXECUTE FUNCTION lane_key_left_processing()
        """
    )
    op.execute(
        """
        CREATE TRIGGER lane_dead_letter_discarded
        AFTER UPDATE OF resolution ON dead_letters
        FOR EACH ROW
        WHEN (OLD.resolution = 'open' AND NEW.resolution = 'discarded')
        EXECUTE FUNCTION lane_dead_letter_discarded()
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER lane_dead_letter_discarded ON dead_letters")
    op.execute("DROP TRIGGER lane_key_left_processing ON idempotency_keys")
    op.execute("DROP FUNCTION lane_dead_letter_discarded()")
    op.execute("DROP FUNCTION lane_key_left_processing()")
    op.execute("DROP FUNCTION lane_wake(text, text)")
    op.execute("DROP FUNCTION lane_admit(text, bigint, text, text, text, float8)")
    op.execute("DROP FUNCTION lane_supersede_older(text, text, numeric, text, boolean)")
    op.execute("DROP FUNCTION key_version(text)")
    op.execute("DROP INDEX idempotency_keys_lane_parked_idx")
    op.execute("DROP INDEX idempotency_keys_superseded_idx")
    op.execute("DROP INDEX idempotency_keys_lane_keys_idx")
    op.execute("DROP INDEX idempotency_keys_lane_idx")
    op.execute("DROP TABLE lanes")
    op.execute("DROP SEQUENCE lane_acceptance")
    # A superseded key becomes what it is closest to: finished without an effect of its own.
    op.execute(
        "UPDATE idempotency_keys SET status = 'succeeded',"
        " result = jsonb_build_object('superseded_by', superseded_by)"
        " WHERE status = 'superseded'"
    )
    op.execute("UPDATE dead_letters SET resolution = 'discarded' WHERE resolution = 'superseded'")
    op.execute("ALTER TABLE dead_letters DROP CONSTRAINT dead_letters_resolution_check")
    op.execute(
        "ALTER TABLE dead_letters ADD CONSTRAINT dead_letters_resolution_check"
        " CHECK (resolution IN ('open', 'replayed', 'discarded'))"
    )
    op.execute("ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_status_check")
    op.execute(
        "ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_status_check"
        f" CHECK (status IN ({_STATUSES}))"
    )
    op.execute(
        "ALTER TABLE idempotency_keys DROP COLUMN superseded_by, DROP COLUMN lane_rank,"
        " DROP COLUMN lane"
    )
