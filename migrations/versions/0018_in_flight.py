"""The in-flight rule: no key changes hands while its last request may still land.

- `idempotency_keys.in_flight_until`: until when a request sent for the key may still reach its
  downstream. A claim sets it to the lease's end plus the route's in-flight window (connect plus
  read timeout and a margin; a python action's time limit), a renewal moves it with the lease,
  and the holder's outcome sets it to what its last request still needs (nothing after an
  answer). No claim, takeover, re-drive, replay, lane hand-on, resume or release makes the key
  actionable before it (docs/explanation/architecture.md, "The in-flight rule").
- `idempotency_keys.delivered_to`: the destinations a fan-out event was delivered to, kept on
  the event's key, so a backfill after a delivery's key was purged adds nothing. Filled here
  from the deliveries that exist, in batches.
- The lane functions: a key whose outcome is uncertain (a retry that will reconcile, or a dead
  letter still open) holds its lane under every mode until a lookup answers, and a lane handed
  on while a request of it may land is handed on when it can no longer land. Supersession never
  clears uncertainty.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from alembic import op
from sqlalchemy import text

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Fan-out events whose destinations are recorded per statement of the backfill.
_BATCH = 5000

# A key of the lane (`o`) holds it: it runs, or its outcome may have reached the downstream and
# no lookup has answered yet (a worker's retry, or a dead letter still open). A workflow's
# failed claim does not hold (its workflow may never return).
_HELD = """(o.status = 'processing'
             OR (o.uncertain AND o.actor = 'worker'
                 AND (o.status = 'failed_retryable'
                      OR (o.status IN ('failed_final', 'quarantined')
                          AND EXISTS (SELECT 1 FROM dead_letters d
                                       WHERE d.idempotency_key = o.idempotency_key
                                         AND d.resolution = 'open')))))"""

# Statuses of the lane index (migration 0011): a key that still has a place in its lane. Only
# such a key may have a request in flight (a success or a supersession clears it), and naming
# them keeps every look at a lane a range of that index, however many finished keys it had.
_UNFINISHED = "('pending', 'processing', 'failed_retryable', 'failed_final', 'quarantined')"

# ... or a request of it may still land.
_HOLDS = f"""(o.status IN {_UNFINISHED}
             AND ({_HELD} OR o.in_flight_until > clock_timestamp()))"""

# Keys of a lane that still hold its order (not finished).
_LIVE = "('pending', 'processing', 'failed_retryable')"

_SUPERSEDE_OLDER = """
CREATE OR REPLACE FUNCTION lane_supersede_older(
    p_route text, p_lane text, p_rank numeric, p_version text, p_blocking boolean
) RETURNS integer LANGUAGE plpgsql AS $$
-- Keys of the lane older than rank p_rank that wait (parked, or, when dead letters hold the
-- lane (p_blocking), dead-lettered) are superseded by version p_version: latest wins, and the
-- older never runs. A key whose effect is unknown (uncertain) is never superseded: it holds
-- the lane until a lookup answers. Under `skip` an older dead letter stays open for an
-- operator. Keys another transaction holds are skipped (their own gate decides), at most 1000
-- per call.
DECLARE
    n integer;
BEGIN
    WITH older AS (
        SELECT k.idempotency_key FROM idempotency_keys k
         WHERE k.route = p_route AND k.lane = p_lane AND k.lane_rank < p_rank
           AND NOT k.uncertain
           AND ((k.status = 'pending' AND k.error_code = 'lane_waiting')
                OR (p_blocking AND k.status IN ('failed_final', 'quarantined')))
         ORDER BY k.lane_rank
         LIMIT 1000
           FOR UPDATE SKIP LOCKED
    ), superseded AS (
        UPDATE idempotency_keys k
           SET status = 'superseded', superseded_by = p_version, error_code = NULL,
               error_detail = NULL, next_attempt_at = NULL, updated_at = now()
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
CREATE OR REPLACE FUNCTION lane_admit(
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
        -- a late write of the older never lands over the newer. A superseded key keeps its
        -- uncertainty: nobody has looked.
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
                   error_detail = NULL, lease_token = NULL, lease_owner = NULL,
                   locked_until = NULL, in_flight_until = NULL, next_attempt_at = NULL,
                   updated_at = now()
             WHERE idempotency_key = p_key;
            RETURN QUERY SELECT 'superseded'::text, v_newer, 0;
            RETURN;
        END IF;
        -- This is the newest: older keys waiting (or a dead letter blocking) are superseded.
        PERFORM lane_supersede_older(
            k.route, k.lane, k.lane_rank, k.version, p_on_failure = 'block');
    END IF;

    -- Another key of the lane holds it (see _HOLDS in migration 0018), under every mode; or,
    -- in acceptance order, an older key has not finished or holds the lane with a dead
    -- letter. (Measured from the clock, not the transaction's start: a lease taken after
    -- this transaction began would otherwise look longer than it is.)
    SELECT GREATEST(1, CEIL(EXTRACT(EPOCH FROM
               COALESCE(max(GREATEST(o.locked_until, o.next_attempt_at, o.in_flight_until)),
                        clock_timestamp()) - clock_timestamp())))::integer
      INTO v_wait
      FROM idempotency_keys o
     WHERE o.route = k.route AND o.lane = k.lane AND o.idempotency_key <> p_key
       AND {_HOLDS}
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
        -- Parked: pending with no delivery, the claim's attempt given back (it sent nothing).
        -- The lane's next change hands it on (lane_wake); the sweeper looks after a lane left
        -- idle.
        UPDATE idempotency_keys
           SET status = 'pending', attempts = GREATEST(attempts - 1, 0),
               error_code = 'lane_waiting',
               error_detail = 'waiting for the earlier events of its lane',
               lease_token = NULL, lease_owner = NULL, locked_until = NULL,
               in_flight_until = NULL, next_attempt_at = NULL, updated_at = now()
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

_WAKE = f"""
CREATE OR REPLACE FUNCTION lane_wake(p_route text, p_lane text) RETURNS integer
LANGUAGE plpgsql AS $$
#variable_conflict use_column
-- Hand a free lane to its next parked key: the oldest in acceptance order, the newest under
-- supersede (older parked keys are superseded by it first). Nothing when a key of the lane
-- runs, or its outcome may have reached the downstream and no lookup has answered, or
-- (acceptance order) an older key is still on its way or holds the lane with a dead letter:
-- that key's own change wakes the lane later. While a request of the lane's last holder may
-- still land, the next key's delivery is due only once it can no longer land.
DECLARE
    ln record;
    nxt record;
    v_due timestamptz;
BEGIN
    SELECT ordering, on_failure INTO ln FROM lanes
     WHERE route = p_route AND lane = p_lane FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    IF EXISTS (SELECT 1 FROM idempotency_keys o
                WHERE o.route = p_route AND o.lane = p_lane
                  AND {_HELD})
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
    SELECT max(o.in_flight_until) INTO v_due
      FROM idempotency_keys o
     WHERE o.route = p_route AND o.lane = p_lane AND o.status IN {_UNFINISHED}
       AND o.in_flight_until > now();
    UPDATE idempotency_keys
       SET error_code = 'lane_released', error_detail = 'its lane is free', updated_at = now()
     WHERE idempotency_key = nxt.idempotency_key;
    INSERT INTO outbox (idempotency_key, task_name, correlation_id, available_at)
    VALUES (nxt.idempotency_key, 'idem.process', nxt.correlation_id,
            GREATEST(now(), v_due));
    RETURN 1;
END
$$
"""


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE idempotency_keys
            ADD COLUMN in_flight_until timestamptz,
            ADD COLUMN delivered_to    text[]
        """
    )
    # A key held now may have a request on its way: until its lease ends, as before.
    op.execute(
        "UPDATE idempotency_keys SET in_flight_until = locked_until"
        " WHERE status = 'processing' AND locked_until IS NOT NULL"
    )
    bind = op.get_bind()
    while True:
        filled = bind.execute(
            text(
                """
                -- Each fan-out event's destinations, from the deliveries that exist.
                UPDATE idempotency_keys k
                   SET delivered_to = COALESCE(
                           (SELECT array_agg(v.destination ORDER BY v.destination)
                              FROM idempotency_keys v WHERE v.event_key = k.idempotency_key),
                           '{}')
                 WHERE k.idempotency_key IN (
                       SELECT idempotency_key FROM idempotency_keys
                        WHERE status = 'fanned_out' AND delivered_to IS NULL
                        LIMIT :batch)
                """
            ),
            {"batch": _BATCH},
        ).rowcount
        if not filled:
            break
    op.execute(_SUPERSEDE_OLDER)
    op.execute(_ADMIT)
    op.execute(_WAKE)


def downgrade() -> None:
    # The lane functions as revision 0011 made them.
    spec = importlib.util.spec_from_file_location(
        "lanes", Path(__file__).with_name("0011_lanes.py")
    )
    assert spec is not None and spec.loader is not None
    lanes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lanes)
    for body in (lanes._SUPERSEDE_OLDER, lanes._ADMIT, lanes._WAKE):
        op.execute(body.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
    op.execute("ALTER TABLE idempotency_keys DROP COLUMN delivered_to, DROP COLUMN in_flight_until")
