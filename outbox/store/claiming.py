"""What a claim of a worker's or workflow's key writes, when a key may be claimed, and what a
claim returns: the parts `lifecycle.CLAIM_KEY` (one key) and `siblings.CLAIM_KEYS` (an event's
deliveries at once) share, so that a key is taken by the same rule whichever statement takes
it. Each fragment reads the key as `k` and its row before the claim as `previous`."""

from __future__ import annotations


def taken(token: str, owner: str = ":owner") -> str:
    """The SET list of a claim storing the lease token `token` and its holder `owner` (each a
    parameter or a column): the attempt counted, the fence one higher, the lease from the
    database clock, and a reclaim (an expired lease) counted and made uncertain: the last
    holder may have acted."""
    return f"""status = 'processing',
               fence = k.fence + 1,
               attempts = k.attempts + 1,
               reclaimed_count = k.reclaimed_count
                   + CASE WHEN k.status = 'processing' THEN 1 ELSE 0 END,
               uncertain = k.uncertain OR k.status = 'processing',
               lease_token = {token},
               lease_owner = {owner},
               locked_until = now() + make_interval(secs => :lease_seconds),
               next_attempt_at = NULL,
               updated_at = now()"""


# Nobody holds it: pending, a retry that is due, or processing with a lease run out.
CLAIMABLE = """(k.status = 'pending'
                OR (k.status = 'failed_retryable'
                    AND (k.next_attempt_at IS NULL OR k.next_attempt_at <= now()))
                OR (k.status = 'processing' AND k.locked_until < now()))"""

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
