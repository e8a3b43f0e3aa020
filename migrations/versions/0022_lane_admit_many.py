"""`lane_admit_many`: the lane step of several keys in one call, so that the attempts of one
worker process that reach their lane step together share one statement.

Each key is decided by `lane_admit`, exactly as alone, in the order of its lane. What the call
adds is the order of its locks, so that it never waits in a cycle with another statement:
it first locks the keys still held by their callers (in key order, as the claims lock them),
makes the lanes that are new (in lane order), then takes each key's lane in lane order. A key
another transaction holds at that moment, or whose lane another transaction holds, is left
out of the answer (its caller then sends it alone, where it waits its turn as any single
step does): the call itself waits for no lock but a new lane's insert by another.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ADMIT_MANY = """
CREATE FUNCTION lane_admit_many(
    p_keys text[], p_fences bigint[], p_tokens text[], p_orderings text[],
    p_on_failures text[], p_ttl_seconds float8[]
) RETURNS TABLE (idempotency_key text, decision text, superseded_by text, retry_after integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_held text[];
    v_order text[];
    v_key text;
    n integer;
BEGIN
    -- The keys still held by their callers, locked in key order; one held elsewhere right now
    -- (a renewal, a copy of its message claiming it) is left to its caller.
    SELECT array_agg(h.idempotency_key) INTO v_held
      FROM (SELECT i.idempotency_key
              FROM idempotency_keys i
              JOIN unnest(p_keys, p_fences, p_tokens) AS u(key, fence, token)
                ON u.key = i.idempotency_key
             WHERE i.fence = u.fence AND i.lease_token = u.token
               AND i.status = 'processing' AND i.lane IS NOT NULL
             ORDER BY i.idempotency_key
               FOR UPDATE OF i SKIP LOCKED) h;
    IF v_held IS NULL THEN
        RETURN;
    END IF;
    -- New lanes, in lane order (`lane_admit` writes their settings as it would alone).
    INSERT INTO lanes AS l (route, lane, ordering, on_failure, expires_at)
    SELECT DISTINCT ON (i.route, i.lane) i.route, i.lane, u.ordering, u.on_failure,
           now() + make_interval(secs => u.ttl_seconds)
      FROM idempotency_keys i
      JOIN unnest(p_keys, p_orderings, p_on_failures, p_ttl_seconds)
        AS u(key, ordering, on_failure, ttl_seconds) ON u.key = i.idempotency_key
     WHERE i.idempotency_key = ANY(v_held)
     ORDER BY i.route, i.lane
    ON CONFLICT (route, lane) DO NOTHING;
    -- Each key's lane, taken in lane order (one held elsewhere: its keys are left out), then
    -- each key decided as alone, in that order.
    SELECT array_agg(t.key ORDER BY t.route, t.lane, t.key) INTO v_order
      FROM (SELECT u.key, l.route, l.lane
              FROM unnest(v_held) AS u(key)
              JOIN idempotency_keys i ON i.idempotency_key = u.key
              JOIN lanes l ON l.route = i.route AND l.lane = i.lane
             ORDER BY l.route, l.lane, u.key
               FOR UPDATE OF l SKIP LOCKED) t;
    FOREACH v_key IN ARRAY COALESCE(v_order, '{}') LOOP
        n := array_position(p_keys, v_key);
        RETURN QUERY
            SELECT v_key, a.decision, a.superseded_by, a.retry_after
              FROM lane_admit(v_key, p_fences[n], p_tokens[n], p_orderings[n],
                              p_on_failures[n], p_ttl_seconds[n]) a;
    END LOOP;
END
$$
"""


def upgrade() -> None:
    op.execute(_ADMIT_MANY)


def downgrade() -> None:
    op.execute("DROP FUNCTION lane_admit_many(text[], bigint[], text[], text[], text[], float8[])")
