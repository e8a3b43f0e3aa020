"""What a claim of a worker's or workflow's key writes, when a key may be claimed (the in-flight
rule included), what a claim returns, and why one was refused (`KEY_STATE`): the parts
`lifecycle.CLAIM_KEY` (one key) and `siblings.CLAIM_KEYS` (an event's deliveries at once)
share, so that a key is taken by the same rule whichever statement takes it. Each fragment
reads the key as `k` and its row before the claim as `previous`."""

from __future__ import annotations

from sqlalchemy import BindParameter, Float, Numeric, String, TextClause, bindparam, text

# How long a request of this key's route may still land after its sender gave up on it: the
# route's window from :in_flight (a JSON object by route label, `outbox.core.inflight.windows`),
# else :in_flight_default (a workflow's claim, or a route no longer configured).
WINDOW = """make_interval(secs => COALESCE(
               CAST(CAST(:in_flight AS jsonb) ->> k.route AS float8), :in_flight_default))"""


def window_binds() -> tuple[BindParameter[str], BindParameter[float]]:
    """`:in_flight` and `:in_flight_default` default to no window: a caller that never sends a
    request (a test's store) sends the statements as before."""
    return bindparam("in_flight", "{}", type_=String), bindparam(
        "in_flight_default", 0.0, type_=Float
    )


def any_lane() -> tuple[BindParameter[str], BindParameter[int]]:
    """`:lane` and `:lane_rank` default to NULL (matches any key), so the worker's claims,
    which never name a lane, send the statements as before."""
    return bindparam("lane", None, type_=String), bindparam("lane_rank", None, type_=Numeric)


def taken(token: str, owner: str = ":owner") -> str:
    """The SET list of a claim storing the lease token `token` and its holder `owner` (each a
    parameter or a column): the attempt counted, the fence one higher, the lease from the
    database clock, and a reclaim (an expired lease) counted and made uncertain: the last
    holder may have acted. Until the lease's end plus the route's window a request this
    holder sends may still land (`in_flight_until`): a holder that gives its lease up early
    does not shorten it, and a renewal moves it with the lease."""
    return f"""status = 'processing',
               fence = k.fence + 1,
               attempts = k.attempts + 1,
               reclaimed_count = k.reclaimed_count
                   + CASE WHEN k.status = 'processing' THEN 1 ELSE 0 END,
               uncertain = k.uncertain OR k.status = 'processing',
               lease_token = {token},
               lease_owner = {owner},
               locked_until = now() + make_interval(secs => :lease_seconds),
               in_flight_until = now() + make_interval(secs => :lease_seconds) + {WINDOW},
               next_attempt_at = NULL,
               updated_at = now()"""


# No request of the key may still land (the in-flight rule): every statement that makes a key
# actionable by someone new reads this.
LANDED = "(k.in_flight_until IS NULL OR k.in_flight_until <= now())"

# Nobody holds it: pending, a due retry, or processing with a lease run out; and no request of
# it may still land.
CLAIMABLE = f"""((k.status = 'pending'
                OR (k.status = 'failed_retryable'
                    AND (k.next_attempt_at IS NULL OR k.next_attempt_at <= now()))
                OR (k.status = 'processing' AND k.locked_until < now()))
               AND {LANDED})"""

# The `claimed` CTE's rows: what the attempt needs, and the previous holder's for the log.
RETURNED = """RETURNING k.idempotency_key, k.fence, k.attempts, k.correlation_id, k.route,
                  k.event_type, k.source, k.locked_until, k.first_failed_at, k.uncertain,
                  now() AS claimed_at, previous.previous_status,
                  k.error_code AS previous_error_code, k.lane, k.actor,
                  previous.previous_owner, previous.previous_updated_at, k.event_key"""

# Each claimed key with its event's payload (a delivery's is its event's, `event_key`) and its
# route's pause and circuit, read in the claim's own statement.
WITH_EVENT = """SELECT c.*, e.external_id, e.version, e.payload, r.paused AS route_paused,
           r.circuit AS route_circuit, r.open_until AS route_open_until
      FROM claimed c
      JOIN events e ON e.idempotency_key = COALESCE(c.event_key, c.idempotency_key)
      LEFT JOIN route_state r ON r.route = c.route"""

KEY_STATE: TextClause = text(
    """
    -- Why a claim was refused: another actor's key, finished (superseded: by which version),
    -- held (and for how long), or another payload, lane or version. Counts the refusal where
    -- it happened: a delivery the worker refused (:refused_by 'worker') or a claim the claims
    -- API refused ('claims').
    UPDATE idempotency_keys
       SET blocked_deliveries = blocked_deliveries + CAST(:refused_by = 'worker' AS integer),
           refused_claims = refused_claims + CAST(:refused_by = 'claims' AS integer)
     WHERE idempotency_key = :key
    RETURNING actor, status, correlation_id, result, external_ref, error_code, superseded_by,
              (CAST(:payload_hash AS text) IS NOT NULL AND payload_hash <> :payload_hash)
               OR (CAST(:lane AS text) IS NOT NULL AND lane IS DISTINCT FROM :lane)
               OR (CAST(:lane_rank AS numeric) IS NOT NULL
                   AND lane_rank IS DISTINCT FROM :lane_rank)
                  AS payload_differs,
              locked_until > now() AS lease_live,
              -- How long a request of its last holder may still land (the in-flight rule).
              GREATEST(0, CEIL(EXTRACT(EPOCH FROM in_flight_until - now())))
                  AS in_flight_remaining,
              GREATEST(0, CEIL(EXTRACT(EPOCH FROM locked_until - now()))) AS lease_remaining,
              -- How long the holder has held it: the claim sets updated_at, renewals do not.
              CASE WHEN status = 'processing'
                   THEN GREATEST(0, EXTRACT(EPOCH FROM now() - updated_at)) END AS held_seconds
    """
).bindparams(*any_lane())
