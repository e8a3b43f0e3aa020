"""Whether a route can take a claimed key now (admit), and what its outcome tells the route's
breaker (tell), the two steps around the action in claim → admit → act → record → tell.

The guard runs between the claim and the action. A key its route cannot take is given back
unspent (`lifecycle.DEFER`: the claim's attempt is returned, the key waits in the outbox or, on
a paused route, as pending) after at most a short wait, so it neither costs an attempt nor
holds a worker for long:

    paused            → held as pending until an operator resumes the route
    circuit open      → waits until the cool-down is over (plus a little spread), or behind
                        the keys already waiting, whichever is later
    circuit half-open → up to `circuit_half_open_calls` keys are trial calls; the others wait
                        a cool-down (or behind those waiting), and come back at once when a
                        trial closes the circuit (the closing worker releases them, a batch at
                        a time)
    rate_per_second   → books the next send slot; a slot further off than a quarter second
                        is kept by the key (`rate_limited`) and used when it comes back
    max_in_flight     → takes a permit slot, polling for half a second; else waits a second

The breaker judges the route by its recent calls (`outbox.store.routes.ROUTE_CALLS`): the
failure rate over a sliding window with a minimum of calls from several keys, so one key the
downstream always refuses never opens it. A call that was sent spends its key's attempt like
any other, trials included, so every key ends within its budget; only a key held back unsent,
or whose request never reached anything that could act (`Failure.not_sent`), costs nothing.
Failures raised on our side before sending (`Failure.local`) are never told.

Telling comes after the outcome is recorded and can only lose bookkeeping, never an outcome:
an error here is logged and counted (`route.tell_failed`). Successes are counted in the worker
and sent with the next failure, or once a second, so a healthy route costs no statement per
success. Every state change is logged (`route.circuit_opened`, `route.circuit_closed`).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from outbox.core.actions import ActionSettings
from outbox.core.logs import get_logger
from outbox.store import routes as q
from worker.errors import Failure
from worker.instruments import BREAKER_ERRORS, THROTTLED
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
# The error code of a key waiting on an open circuit; a close releases exactly these.
CIRCUIT_OPEN = "circuit_open"
# Successes are sent to the route's window at most this often per process: the breaker needs
# them for its rate, not to the millisecond.
COUNT_EVERY_SECONDS = 1.0
# Keys made due per statement when a circuit closes: a few milliseconds each, far inside the
# statement timeout however many keys wait.
RELEASE_BATCH = 1000
RATE_LIMITED = "rate_limited"
# Keys an open circuit holds come back to look at it at about this rate per route, however
# many wait (up to an hour of line, HELD_WAIT_CAP_SECONDS): each is given back behind the last
# one waiting, this far apart. Waiting out the
# cool-down alone, a backlog of 100 000 keys behind a downstream that is down for hours came
# back every cool-down (5 s when nothing was sent), a claim and a deferral each, without end.
# The keys still come back at once when a trial closes the circuit, and a trial needs only one
# key to come back after the cool-down: with many waiting, one does within 1/rate.
HELD_RETURNS_PER_SECOND = 20.0
# However long the line, a held key looks again within this: a release that did not finish (its
# worker died) leaves keys due no later than this after the close.
HELD_WAIT_CAP_SECONDS = 3600.0


@dataclass(frozen=True)
class Admitted:
    """The route takes the key: with a permit slot to release, and whether it is a trial."""

    permit: int | None = None
    trial: bool = False


@dataclass(frozen=True)
class Held:
    """The route cannot take the key now: give it back for `delay` seconds, unspent."""

    reason: str
    delay: float
    detail: str


@dataclass
class _Tally:
    """Successes this process saw on a route and has not sent to its window yet."""

    successes: int = 0
    since: float = 0.0
    sent_at: float = field(default_factory=time.monotonic)


class RouteGuard:
    """The worker's side of a route's shared state (one per process)."""

    def __init__(self, store: KeyStore) -> None:
        self.store = store
        self._ensured: set[str] = set()
        self._lock = threading.Lock()
        self._tallies: dict[str, _Tally] = {}
        self._releasing: set[str] = set()

    def _ensure(self, route: ActionSettings) -> None:
        """The route's state row and permit slots exist (once per process and route)."""
        if route.label in self._ensured:
            return
        self.store.one(
            q.ENSURE_ROUTE, {"route": route.label, "max_in_flight": route.max_in_flight or 0}
        )
        with self._lock:
            self._ensured.add(route.label)

    def admit(
        self, route: ActionSettings, claim: Claim, probe_seconds: float, rng: random.Random
    ) -> Admitted | Held:
        """Decide for a claimed key; may wait briefly (a rate slot, a permit)."""
        self._ensure(route)
        state = claim.route_state
        if state.paused:
            return self._held(route, "paused", 0.0, "the route is paused")
        trial = False
        if state.circuit != "closed":
            cooldown = route.circuit_cooldown_seconds
            spread = rng.uniform(0, min(1.0, cooldown / 10))
            if state.open_until is not None and state.open_until > claim.claimed_at:
                wait = (state.open_until - claim.claimed_at).total_seconds() + spread
                wait = self._behind_held(route, wait)
                return self._held(route, CIRCUIT_OPEN, wait, "the route's circuit is open")
            params = {
                "route": route.label,
                "key": claim.key,
                "trials": route.circuit_half_open_calls,
                "probe_seconds": probe_seconds,
            }
            if self.store.one(q.TAKE_TRIAL, params) is None:
                wait = self._behind_held(route, cooldown + spread)
                return self._held(route, CIRCUIT_OPEN, wait, "the route's trial calls are running")
            trial = True
            log.info("route.trial", route=route.label)
        if route.rate_per_second is not None and not trial:
            held = self._rate(route, claim)
            if held is not None:
                return held
        permit = None
        if route.max_in_flight is not None and not trial:
            permit = self._permit(route, claim)
            if permit is None:
                wait = PERMIT_RETRY_SECONDS * rng.uniform(0.5, 1.5)
                detail = f"the route's {route.max_in_flight} attempts in flight are taken"
                return self._held(route, "in_flight_limit", wait, detail)
        return Admitted(permit, trial)

    def _behind_held(self, route: ActionSettings, wait: float) -> float:
        """`wait`, or the time that puts this key behind the last one the circuit holds."""
        row = self.store.one(q.HELD_TAIL, {"route": route.label})
        tail = None if row is None or row["seconds"] is None else float(row["seconds"])
        if tail is None:
            return wait
        return max(wait, min(tail + 1.0 / HELD_RETURNS_PER_SECOND, HELD_WAIT_CAP_SECONDS))

    def _rate(self, route: ActionSettings, claim: Claim) -> Held | None:
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

    def _permit(self, route: ActionSettings, claim: Claim) -> int | None:
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
    def _held(route: ActionSettings, reason: str, delay: float, detail: str) -> Held:
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

    def tell(
        self, route: ActionSettings, claim: Claim, failure: Failure | None, trial: bool
    ) -> None:
        """After the outcome is recorded: tell the route's breaker that the downstream answered
        (`failure` None) or failed transiently. Never raises: the outcome stands either way."""
        try:
            if failure is None:
                self._answered(route, claim, trial)
            else:
                self._failed(route, claim, failure, trial)
        except Exception as error:
            BREAKER_ERRORS.labels(route.label).inc()
            log.warning("route.tell_failed", route=route.label, error=type(error).__name__)

    def _take_tally(self, route: ActionSettings, due: bool) -> int | None:
        """The successes to send now (all of them, when `due` is False only if a second has
        passed since the last send); None when it is not time. Successes older than the window
        are dropped: they no longer say anything about the route."""
        now = time.monotonic()
        with self._lock:
            tally = self._tallies.setdefault(route.label, _Tally())
            if tally.successes and now - tally.since > route.circuit_window_seconds:
                tally.successes = 0
            if not due and now - tally.sent_at < COUNT_EVERY_SECONDS:
                return None
            taken, tally.successes, tally.sent_at = tally.successes, 0, now
            return taken

    def _count_success(self, route: ActionSettings) -> None:
        with self._lock:
            tally = self._tallies.setdefault(route.label, _Tally())
            if tally.successes == 0:
                tally.since = time.monotonic()
            tally.successes += 1

    def _answered(self, route: ActionSettings, claim: Claim, trial: bool) -> None:
        if not trial:
            self._count_success(route)
            successes = self._take_tally(route, due=False)
            if successes:
                self._calls(route, claim, successes, None, "", closing=False)
            return
        successes = (self._take_tally(route, due=True) or 0) + 1
        row = self._calls(route, claim, successes, None, "", closing=True)
        if row is not None and row["closed"]:
            log.info("route.circuit_closed", route=route.label, reason="trial_succeeded")
            self._release_in_background(route)

    def _failed(self, route: ActionSettings, claim: Claim, failure: Failure, trial: bool) -> None:
        retry_after = failure.retry_after
        opens_now = retry_after is not None and retry_after > route.backoff_cap_seconds
        if trial:
            reason = f"{route.circuit_half_open_calls} trial calls failed ({failure.error_code})"
        elif opens_now:
            reason = f"retry_after {retry_after:g} s ({failure.error_code})"
        else:
            reason = (
                f"{route.circuit_failure_rate:.0%} of the calls in {route.circuit_window_seconds:g}"
                f" s failed ({failure.error_code})"
            )
        successes = self._take_tally(route, due=True) or 0
        row = self._calls(route, claim, successes, failure, reason, closing=False)
        if row is not None and row["opened"]:
            log.warning(
                "route.circuit_opened",
                route=route.label,
                reason=reason,
                cooldown_seconds=round(float(row["cooldown_seconds"]), 2),
                calls=float(row["calls"]),
                failures=float(row["failures"]),
            )

    def _calls(
        self,
        route: ActionSettings,
        claim: Claim,
        successes: int,
        failure: Failure | None,
        reason: str,
        closing: bool,
    ) -> Mapping[str, Any] | None:
        retry_after = None if failure is None else failure.retry_after
        return self.store.one(
            q.ROUTE_CALLS,
            {
                "route": route.label,
                # A closing call names its key (the trial); a count of successes names none.
                "key": claim.key if failure is not None or closing else "",
                "successes": successes,
                "failed": failure is not None,
                "window": route.circuit_window_seconds,
                "minimum_calls": route.circuit_minimum_calls,
                "rate": route.circuit_failure_rate,
                "trials": route.circuit_half_open_calls,
                "opens_now": retry_after is not None and retry_after > route.backoff_cap_seconds,
                "reason": reason,
                **_cooldowns(route, failure),
                "retry_after": retry_after,
            },
        )

    def _release_in_background(self, route: ActionSettings) -> None:
        """Make the keys the circuit held due now, off the attempt's thread: the attempt is
        over, and a release of many keys must not hold a worker."""
        with self._lock:
            if route.label in self._releasing:
                return
            self._releasing.add(route.label)
        thread = threading.Thread(
            target=self.release_held, args=(route.label,), name="release", daemon=True
        )
        thread.start()

    def release_held(self, route: str) -> int:
        """Release the keys a closed circuit held, a batch per statement; how many. Stops at
        the first error: the rest come due at the times they were given."""
        released = 0
        try:
            while True:
                params = {"route": route, "batch": RELEASE_BATCH}
                row = self.store.one(q.RELEASE_CIRCUIT_HELD, params)
                count = 0 if row is None else int(row["released"])
                released += count
                if count == 0:
                    break
            log.info("route.circuit_released", route=route, released=released)
        except Exception as error:
            BREAKER_ERRORS.labels(route).inc()
            log.warning(
                "route.release_failed", route=route, released=released, error=type(error).__name__
            )
        finally:
            with self._lock:
                self._releasing.discard(route)
        return released


def _cooldowns(route: ActionSettings, failure: Failure | None) -> dict[str, float | bool]:
    """The cool-down a failure opens the circuit with, and its cap. Requests that never reached
    anything that could act (`Failure.not_sent`: a refused connection, a workflow not listening)
    re-open it for `not_sent_retry_seconds` at most, never doubled, and their re-openings are not
    counted towards a later doubling: such a trial costs the downstream nothing, and its return
    (a restart, a re-publish) is noticed within seconds, even when a trial sent meanwhile failed
    (a downstream that accepts connections before it answers)."""
    if failure is not None and failure.not_sent:
        short = min(route.circuit_cooldown_seconds, route.not_sent_retry_seconds)
        return {"cooldown": short, "cooldown_cap": short, "not_sent": True}
    return {
        "cooldown": route.circuit_cooldown_seconds,
        "cooldown_cap": route.circuit_cooldown_cap_seconds,
        "not_sent": False,
    }
