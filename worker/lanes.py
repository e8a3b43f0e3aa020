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
The steps of a worker process's attempts that arrive together share one statement
(`admit_keys`, through `worker.grouped`), each key decided as alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from outbox.core.actions import ActionSettings
from outbox.store import lanes as q
from worker.outcomes import LaneWaiting, LeaseGivenUp, Superseded
from worker.siblings import ATTEMPT_ARRAYS
from worker.store import Claim, KeyStore, attempt_params

# The parallel arrays of `ADMIT_KEYS`, from each key's `ADMIT` parameters.
_COLUMNS = {
    **ATTEMPT_ARRAYS,
    "orderings": "ordering",
    "on_failures": "on_failure",
    "ttl_seconds": "ttl_seconds",
}


def order(
    store: KeyStore, route: ActionSettings, claim: Claim
) -> LaneWaiting | Superseded | LeaseGivenUp | None:
    """None when the key may act now (or is in no lane); else what the lane step recorded."""
    if claim.lane is None or route.order_by is None:
        # A route that stopped ordering lets its keys go (their parked siblings are handed
        # on by the lanes' own changes, or by the sweeper).
        return None
    row = store.admit(
        {
            # The lane step's outcome and error code are its decision's (outbox.store.lanes).
            **attempt_params(claim, "deferred_lane"),
            "ordering": "supersede" if route.versions == "supersede" else "accepted",
            "on_failure": route.lane_on_failure,
            "ttl_seconds": route.lane_ttl_seconds,
        }
    )
    match row["decision"]:
        case "go":
            return None
        case "wait":
            return LaneWaiting(float(row["retry_after"]))
        case "superseded":
            return Superseded(str(row["superseded_by"]))
        case _:
            return LeaseGivenUp("lease_lost")


def admit_keys(store: KeyStore, steps: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The lane steps of several keys in one statement (`ADMIT_KEYS`), each from its `ADMIT`
    parameters; each key's decision, as `KeyStore.admit` gives it. A key with no decision was
    left out (it or its lane was held elsewhere at that moment): its caller sends it alone.
    The keys are distinct."""
    params = {name: [step[column] for step in steps] for name, column in _COLUMNS.items()}
    return {row["idempotency_key"]: row for row in store.all(q.ADMIT_KEYS, params)}
