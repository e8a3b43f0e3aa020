"""Whether a route can take a claimed key now, and what its outcome tells the route's breaker.

The guard runs between the claim and the action. A key its route cannot take is given back
unspent (`lifecycle.DEFER`: the claim's attempt is returned, the key waits in the outbox or, on
a paused route, as pending) after at most a short wait, so it neither costs an attempt nor
holds a worker for long:

    paused            → held as pending until an operator resumes the route
    circuit open      → waits until the probe time (plus a little spread)
    circuit half-open → one key is the probe; the others wait a cool-down, and come back at
                        once when the probe closes the circuit (ROUTE_ANSWERED makes them due)
    rate_per_second   → books the next send slot; a slot further off than a quarter second
                        is kept by the key (`rate_limited`) and used when it comes back
    max_in_flight     → takes a permit slot, polling for half a second; else waits a second

The breaker counts transient failures of attempts at the downstream. A probe the downstream
refuses (a failure that says it did nothing: 503, 429, connection refused) re-opens the circuit
and is itself given back unspent: a key pays for an outage at most the one attempt that found
it. Every state change is logged (`route.circuit_opened`, `route.circuit_closed`).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

from outbox.core.logs import get_logger
from outbox.core.routes import Route
from outbox.store import routes as q
from worker.errors import Failure
from worker.instruments import THROTTLED
from worker.store import Claim, KeyStore

log = get_logger(__name__)

# A rate slot this close is waited for in the worker: cheaper than a round trip through the
# outbox, and short enough not to hold a worker.
RATE_WAIT_INLINE_SECONDS = 0.25
# Polling for an in-flight permit: half a second in tenths, then the key goes back to the
# outbox for about a second (spread, so waiting keys do not return together).
PERMIT_WAIT_SECONDS = 0.5
PERMIT_POLL_SECONDS = 0.1
PERMIT_RETRY_SECONDS = 1.0
# The error code of a key waiting on an open circuit; ROUTE_ANSWERED releases exactly these.
CIRCUIT_OPEN = "circuit_open"
RATE_LIMITED = "rate_limited"


@dataclass(frozen=True)
class Admitted:
    """The route takes the key: with a permit slot to release, and whether it is the probe."""

    permit: int | None = None
    probe: bool = False


@dataclass(frozen=True)
class Held:
    """The route cannot take the key now: give it back for `delay` seconds, unspent."""

    reason: str
    delay: float
    detail: str


class RouteGuard:
    """The worker's side of a route's shared state (one per process)."""

    def __init__(self, store: KeyStore) -> None:
        self.store = store
        self._ensured: set[str] = set()
        self._lock = threading.Lock()

    def _ensure(self, route: Route) -> None:
        """The route's state row and permit slots exist (once per process and route)."""
        if route.label in self._ensured:
            return
        self.store.one(
            q.ENSURE_ROUTE, {"route": route.label, "max_in_flight": route.max_in_flight or 0}
        )
        with self._lock:
            self._ensured.add(route.label)

    def admit(
        self, route: Route, claim: Claim, probe_seconds: float, rng: random.Random
    ) -> Admitted | Held:
        """Decide for a claimed key; may wait briefly (a rate slot, a permit)."""
        self._ensure(route)
        state = claim.route_state
        if state.paused:
            return self._held(route, "paused", 0.0, "the route is paused")
        probe = False
        if state.circuit != "closed":
            cooldown = route.circuit_cooldown_seconds
            spread = rng.uniform(0, min(1.0, cooldown / 10))
            if state.open_until is not None and state.open_until > claim.claimed_at:
                wait = (state.open_until - claim.claimed_at).total_seconds() + spread
                return self._held(route, CIRCUIT_OPEN, wait, "the route's circuit is open")
            params = {
                "route": route.label,
                "key": claim.key,
                "fence": claim.fence,
                "probe_seconds": probe_seconds,
            }
            if self.store.one(q.TAKE_PROBE, params) is None:
                return self._held(
                    route, CIRCUIT_OPEN, cooldown + spread, "a probe of the route is running"
                )
            probe = True
            log.info("route.probe", route=route.label)
        if route.rate_per_second is not None and not probe:
            held = self._rate(route, claim)
            if held is not None:
                return held
        permit = None
        if route.max_in_flight is not None and not probe:
            permit = self._permit(route, claim)
            if permit is None:
                wait = PERMIT_RETRY_SECONDS * rng.uniform(0.5, 1.5)
                detail = f"the route's {route.max_in_flight} attempts in flight are taken"
                return self._held(route, "in_flight_limit", wait, detail)
        return Admitted(permit, probe)

    def _rate(self, route: Route, claim: Claim) -> Held | None:
        """Book a send slot unless the key comes back to the one it booked; wait for a near one."""
        if claim.previous_error_code == RATE_LIMITED:
            return None  # it was given back until its slot: the slot is now
        row = self.store.one(
            q.RESERVE_RATE,
            {"route": route.label, "rate": route.rate_per_second, "burst": route.burst},
        )
        wait = 0.0 if row is None else float(row["wait_seconds"])
        if wait > RATE_WAIT_INLINE_SECONDS:
            detail = f"the route sends at most {route.rate_per_second:g}/s; its slot is booked"
            return self._held(route, RATE_LIMITED, wait, detail)
        if wait > 0:
            time.sleep(wait)
        return None

    def _permit(self, route: Route, claim: Claim) -> int | None:
        params = {
            "route": route.label,
            "key": claim.key,
            "fence": claim.fence,
            "max_in_flight": route.max_in_flight,
            "lease_seconds": (claim.locked_until - claim.claimed_at).total_seconds(),
        }
        deadline = time.monotonic() + PERMIT_WAIT_SECONDS
        while True:
            row = self.store.one(q.TAKE_PERMIT, params)
            if row is not None:
                slot: int = row["slot"]
                return slot
            if time.monotonic() + PERMIT_POLL_SECONDS > deadline:
                return None
            time.sleep(PERMIT_POLL_SECONDS)

    @staticmethod
    def _held(route: Route, reason: str, delay: float, detail: str) -> Held:
        THROTTLED.labels(route.label, reason).inc()
        return Held(reason, max(0.0, delay), detail)

    def release(self, claim: Claim) -> None:
        """Free the claim's permit slot (the action is over); a failure leaves it to expire."""
        if claim.permit is None:
            return
        params = {"route": claim.route, "slot": claim.permit, "key": claim.key}
        try:
            self.store.one(q.RELEASE_PERMIT, {**params, "fence": claim.fence})
        except Exception as error:  # the slot frees itself when the lease would have ended
            log.warning("route.permit_release_failed", error=type(error).__name__)

    def answered(self, route: Route, claim: Claim, probe: bool) -> None:
        """The downstream answered: end a failure streak, close a circuit that was not closed."""
        state = claim.route_state
        if not probe and state.circuit == "closed" and state.failures == 0:
            return  # nothing to reset, as of the claim: the common case costs no statement
        row = self.store.one(q.ROUTE_ANSWERED, {"route": route.label})
        if row is not None and row["previous_circuit"] != "closed":
            log.info(
                "route.circuit_closed",
                route=route.label,
                reason="probe_succeeded" if probe else "downstream_answered",
                released=int(row["released"]),
            )

    def failed(self, route: Route, claim: Claim, failure: Failure, probe: bool) -> float | None:
        """Count a transient failure at the downstream. Returns the cool-down when the circuit
        is now open because of this failure (a probe's failure re-opens it), else None."""
        retry_after = failure.retry_after
        opens_now = retry_after is not None and retry_after > route.backoff_cap_seconds
        if probe:
            reason = f"probe_failed ({failure.error_code})"
        elif opens_now:
            reason = f"retry_after {retry_after:g} s ({failure.error_code})"
        else:
            reason = f"{route.circuit_failure_threshold} failures in a row ({failure.error_code})"
        row = self.store.one(
            q.ROUTE_FAILED,
            {
                "route": route.label,
                "key": claim.key,
                "fence": claim.fence,
                "threshold": route.circuit_failure_threshold,
                "opens_now": opens_now,
                "reason": reason,
                "cooldown": route.circuit_cooldown_seconds,
                "cooldown_cap": route.circuit_cooldown_cap_seconds,
                "retry_after": retry_after,
            },
        )
        if row is None or not row["opened"]:
            return None
        cooldown = float(row["cooldown_seconds"])
        log.warning(
            "route.circuit_opened", route=route.label, reason=reason, cooldown_seconds=cooldown
        )
        return cooldown
