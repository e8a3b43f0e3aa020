"""The closed set of outcomes an attempt ends in, and how a classified failure becomes one:
retry later within the key's budget and deadline, wait unspent when the downstream runs the key
already, or dead-letter. Pure decisions on the claim, the route and the failure; recording them
is `worker.attempt`'s."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from outbox.core import inflight
from outbox.core.actions import ActionSettings
from worker.actions import ActionResult
from worker.backoff import next_delay
from worker.errors import Failure
from worker.store import Claim


@dataclass(frozen=True)
class Succeeded:
    result: ActionResult
    # This attempt reconciled first: found the effect (True) or none, then acted (False).
    reconciled: bool | None = None


@dataclass(frozen=True)
class RetryLater:
    failure: Failure
    delay: float
    reconciled_absent: bool = False
    # How long this attempt's unanswered request may still land (`in_flight_after`).
    in_flight: float = 0.0


@dataclass(frozen=True)
class DeadLetter:
    failure: Failure
    kind: str
    reconciled_absent: bool = False
    in_flight: float = 0.0


@dataclass(frozen=True)
class LeaseGivenUp:
    """The lease was lost or could not be proven: nothing may be recorded."""

    reason: str


@dataclass(frozen=True)
class Deferred:
    """The route could not take the key now, or the downstream is running it already: given
    back unspent, to come back later."""

    reason: str
    delay: float
    detail: str
    # A wait the downstream asked for: it starts the retry deadline (so waits end within it).
    starts_budget: bool = False
    # A failure whose request never reached anything that could act (`Failure.not_sent`):
    # given back unspent like a wait, and told to the breaker like any failure there.
    not_sent: Failure | None = None


@dataclass(frozen=True)
class LaneWaiting:
    """Its lane is not its turn: parked unspent by the lane step (recorded already), handed
    on when the lane frees. `expected` is about how long the key running there still holds
    it, for the log line."""

    expected: float


@dataclass(frozen=True)
class Superseded:
    """A newer version of the object was applied, waits or runs: recorded `superseded` by the
    lane step, never acted on."""

    by: str


Outcome = Succeeded | RetryLater | DeadLetter | LeaseGivenUp | Deferred | LaneWaiting | Superseded


@dataclass(frozen=True)
class Told:
    """What an action's outcome says about its route: answered (None) or a failure there."""

    failure: Failure | None


def told(outcome: Outcome) -> Told | None:
    """What to tell the breaker of an action's outcome, or None when it says nothing of the
    downstream (a broken contract, an error raised before sending, a lost lease)."""
    match outcome:
        case Succeeded():
            return Told(None)
        case RetryLater(failure) | DeadLetter(failure) if failure.at_downstream:
            return Told(failure)
        case DeadLetter(failure, "permanent") if not failure.local:
            return Told(None)  # the downstream answered, with a refusal
        case Deferred(not_sent=failure) if failure is not None:
            return Told(failure)
        case _:
            return None


def after_failure(
    route: ActionSettings,
    claim: Claim,
    failure: Failure,
    reconciled_absent: bool,
    rng: random.Random,
    lease_seconds: float,
) -> Outcome:
    """Retry later within the budget and deadline, wait (spending nothing) when the downstream
    runs the key already, or dead-letter. A retry or a dead letter carries how long this
    attempt's request may still land; the store keeps the key from everyone until then."""
    in_flight = in_flight_after(route, failure, lease_seconds)
    outcome = _after_failure(route, claim, failure, reconciled_absent, rng, in_flight)
    if isinstance(outcome, RetryLater | DeadLetter):
        return replace(outcome, in_flight=in_flight)
    return outcome


def _after_failure(
    route: ActionSettings,
    claim: Claim,
    failure: Failure,
    reconciled_absent: bool,
    rng: random.Random,
    in_flight: float,
) -> Outcome:
    # The deadline runs from the first failure, on the database's clock. A retry (or a
    # server's Retry-After) that would land past it ends the key now rather than later.
    budget_started = claim.first_failed_at or claim.claimed_at
    spent = (claim.claimed_at - budget_started).total_seconds()
    if failure.wait:
        # Not a failure: the attempt is returned, so only the deadline bounds the waits.
        wait = min(failure.retry_after or 0.0, route.backoff_cap_seconds)
        if spent + wait > route.retry_deadline_seconds:
            return DeadLetter(failure, "retries_exhausted", reconciled_absent)
        return Deferred(failure.error_code, wait, failure.detail, starts_budget=True)
    if failure.window_seconds is not None and spent >= failure.window_seconds:
        detail = f"{failure.detail}; still so {spent:.0f} s after the first failure"
        return DeadLetter(replace(failure, transient=False, detail=detail), "permanent")
    if not failure.transient:
        return DeadLetter(failure, "permanent", reconciled_absent)
    if failure.not_sent:
        return _not_sent(route, failure, spent, reconciled_absent, rng)
    # A failure with a window (an action's `TransientError(window_seconds=…)`) is bounded by
    # its window, not by the attempt count: every key still ends, at the window's end at the
    # latest.
    if claim.attempt >= route.max_attempts and failure.window_seconds is None:
        return DeadLetter(failure, "retries_exhausted", reconciled_absent)
    delay = next_delay(
        claim.attempt,
        failure.retry_after,
        base=route.backoff_base_seconds,
        cap=route.backoff_cap_seconds,
        rng=rng,
    )
    delay = max(delay, in_flight)
    if failure.window_seconds is not None:
        # The last try lands at the window's end, not past it.
        delay = min(delay, failure.window_seconds - spent)
    if spent + delay > route.retry_deadline_seconds:
        return DeadLetter(failure, "retries_exhausted", reconciled_absent)
    return RetryLater(failure, delay, reconciled_absent)


def _not_sent(
    route: ActionSettings,
    failure: Failure,
    spent: float,
    reconciled_absent: bool,
    rng: random.Random,
) -> Outcome:
    """Nothing could have acted (a refused connection, a workflow not listening): the attempt is
    given back, so a restart or a deploy of the downstream costs no key its budget. The key asks
    again every `not_sent_retry_seconds` or a little sooner (half of it at least, so keys that
    failed together spread out), and a downstream that comes back is noticed within that;
    `retry_deadline_seconds` alone ends it. The breaker hears of each, and once it opens the
    route's other keys wait without calling at all."""
    ceiling = min(route.not_sent_retry_seconds, route.backoff_cap_seconds)
    delay = max(rng.uniform(ceiling / 2, ceiling), failure.retry_after or 0.0)
    if failure.window_seconds is not None:
        delay = min(delay, failure.window_seconds - spent)
    if spent + delay > route.retry_deadline_seconds:
        return DeadLetter(failure, "retries_exhausted", reconciled_absent)
    return Deferred(failure.error_code, delay, failure.detail, starts_budget=True, not_sent=failure)


def in_flight_after(route: ActionSettings, failure: Failure, lease_seconds: float) -> float:
    """How long after this failure its request may still land (`outbox.core.inflight`).

    A request whose answer never came (a read or write timeout, a dropped connection, the
    action's time limit) can reach the downstream after its attempt has ended: a slow or lossy
    link delays it, a busy server takes it late. Whoever looks the key up next acts again when
    the lookup finds nothing, so no lookup may come before such a request had the time it was
    given to land: the route's in-flight window. A python action that ran past its limit may
    still be running; one that raised an uncertain error has ended, and only its margin is
    kept. An answered failure (a 500) has landed already.
    """
    if not failure.uncertain or failure.status_code is not None:
        return 0.0
    if route.action == "python" and failure.error_code != "action_timeout":
        return route.in_flight_margin_seconds
    return inflight.window(route, lease_seconds)
