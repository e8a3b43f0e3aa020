"""The attempt's lane step (claim → order → admit → act → record → tell): on a route with
`order_by`, a claimed key acts only when it is its lane's turn.

The decision and its write are one call of `lane_admit` (migration 0011) under the lane's row
lock, so no other key of the lane can act between them:

    go          the lane is this key's: the attempt goes on to the route's guard
    wait        another key of the lane runs, or (in order of acceptance) an older one has not
                finished or holds the lane with a dead letter: the key is parked, unspent and
                with no delivery; the lane's next change hands it on (lane_wake, by trigger)
    superseded  (versions = "supersede") the lane applied this version or a newer one, or a
                newer one waits or runs: recorded `superseded`, never acted on
    lost        the claim's lease was taken over meanwhile: nothing is recorded

It runs before the guard, so a key waiting for its lane takes no rate slot, permit or trial.
"""

from __future__ import annotations

from outbox.core.actions import ActionSettings
from outbox.store import lanes as q
from worker.outcomes import LaneWaiting, LeaseGivenUp, Superseded
from worker.store import Claim, KeyStore, attempt_params


def order(
    store: KeyStore, route: ActionSettings, claim: Claim
) -> LaneWaiting | Superseded | LeaseGivenUp | None:
    """None when the key may act now (or is in no lane); else what the lane step recorded."""
    if claim.lane is None or route.order_by is None:
        # A route that stopped ordering lets its keys go (their parked siblings are handed
        # on by the lanes' own changes, or by the sweeper).
        return None
    row = store.one(
        q.ADMIT,
        {
            # The lane step's outcome and error code are its decision's (outbox.store.lanes).
            **attempt_params(claim, "deferred_lane"),
            "ordering": "supersede" if route.versions == "supersede" else "accepted",
            "on_failure": route.lane_on_failure,
            "ttl_seconds": route.lane_ttl_seconds,
        },
    )
    decision = None if row is None else row["decision"]
    match decision:
        case "go":
            return None
        case "wait":
            assert row is not None
            return LaneWaiting(float(row["retry_after"]))
        case "superseded":
            assert row is not None
            return Superseded(str(row["superseded_by"]))
        case _:
            return LeaseGivenUp("lease_lost")
