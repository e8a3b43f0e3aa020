"""One attempt at a key, top to bottom: claim → act → record, ending in one closed outcome.

The broker may deliver a message twice, late, or after another worker already finished the key;
the claim makes all of that harmless. Recording names the fence, so an attempt that lost its
lease records nothing (`lease_lost`).
"""

from __future__ import annotations

import os
import random
import socket
import time
from dataclasses import dataclass
from typing import assert_never

import structlog

from outbox import contract, keys
from outbox.logs import get_logger
from outbox.routes import Route, RouteTable
from worker.actions import ActionContext, ActionResult, get_action, get_reconciler
from worker.backoff import next_delay
from worker.errors import Failure, classify
from worker.instruments import ACTION_SECONDS, ATTEMPTS, RECONCILED
from worker.lease import Heartbeat
from worker.store import Blocked, Claim, KeyStore

log = get_logger(__name__)

# Failures after the request may have reached the downstream: the effect may exist.
# `lease_expired` marks a key an operator replayed out of `processing`.
UNCERTAIN_ERROR_CODES = frozenset(
    {"timeout_read", "timeout_write", "connection_dropped", "transport_error", "lease_expired"}
)


@dataclass(frozen=True)
class Succeeded:
    result: ActionResult


@dataclass(frozen=True)
class RetryLater:
    failure: Failure
    delay: float


@dataclass(frozen=True)
class DeadLetter:
    failure: Failure
    kind: str


Outcome = Succeeded | RetryLater | DeadLetter


def run_attempt(
    store: KeyStore,
    routes: RouteTable,
    key: str,
    *,
    lease_seconds: float,
    rng: random.Random | None = None,
) -> str:
    """Process one delivery of `key`; returns what happened, for the task's log line."""
    owner = f"{socket.gethostname()}:{os.getpid()}"
    claim = store.claim(key, owner, lease_seconds)
    if isinstance(claim, Blocked):
        log.info(
            "delivery.blocked",
            key=keys.mask_key(key),
            status=claim.status,
            lease_live=claim.lease_live,
        )
        ATTEMPTS.labels("blocked", "").inc()
        return "blocked"
    structlog.contextvars.bind_contextvars(
        key=keys.mask_key(key),
        correlation_id=claim.correlation_id,
        event_type=claim.event_type,
        attempt=claim.attempt,
    )
    log.info(
        "attempt.claimed", transition=f"{claim.previous_status} -> processing", fence=claim.fence
    )
    route = routes.by_label(claim.route) or routes.resolve(claim.event_type)
    started = time.monotonic()
    if route is None:
        outcome: Outcome = DeadLetter(
            Failure(False, "no_route", f"no route named {claim.route!r} is configured"),
            "permanent",
        )
    else:
        outcome = _act(store, route, claim, lease_seconds, rng or random.Random())
    recorded = _record(store, claim, outcome)
    elapsed = time.monotonic() - started
    result = _log_finished(outcome, recorded, round(elapsed * 1000, 1))
    error_code = "" if isinstance(outcome, Succeeded) else outcome.failure.error_code
    ATTEMPTS.labels(result, error_code).inc()
    ACTION_SECONDS.labels(claim.route).observe(elapsed)
    return result


def _log_finished(outcome: Outcome, recorded: bool, duration_ms: float) -> str:
    """The attempt's one canonical log line; returns the outcome's name."""
    if not recorded:
        log.warning(
            "attempt.finished",
            outcome="lease_lost",
            attempted=type(outcome).__name__,
            duration_ms=duration_ms,
        )
        return "lease_lost"
    match outcome:
        case Succeeded():
            log.info(
                "attempt.finished",
                outcome="succeeded",
                transition="processing -> succeeded",
                duration_ms=duration_ms,
                external_ref=outcome.result.external_ref,
            )
            return "succeeded"
        case RetryLater():
            log.info(
                "attempt.finished",
                outcome="retry",
                transition="processing -> failed_retryable",
                error_code=outcome.failure.error_code,
                retry_in=round(outcome.delay, 2),
                duration_ms=duration_ms,
            )
            return "retry"
        case DeadLetter():
            final = "quarantined" if outcome.kind == "quarantined" else "failed_final"
            log.warning(
                "attempt.finished",
                outcome="dead_letter",
                kind=outcome.kind,
                transition=f"processing -> {final}",
                error_code=outcome.failure.error_code,
                duration_ms=duration_ms,
            )
            return "dead_letter"
        case _:
            assert_never(outcome)


def is_uncertain(claim: Claim) -> bool:
    """Whether an earlier attempt may have had its effect although it recorded none."""
    return claim.previous_status == "processing" or (
        claim.previous_error_code in UNCERTAIN_ERROR_CODES
    )


def _act(
    store: KeyStore, route: Route, claim: Claim, lease_seconds: float, rng: random.Random
) -> Outcome:
    broken = contract.violations(route, claim.payload)
    if broken:
        return DeadLetter(Failure(False, "contract_violation", "; ".join(broken)), "quarantined")
    ctx = ActionContext(
        key=claim.key,
        correlation_id=claim.correlation_id,
        attempt=claim.attempt,
        source=claim.source,
        event_type=claim.event_type,
        external_id=claim.external_id,
        version=claim.version,
        payload=claim.payload,
        uncertain=is_uncertain(claim),
    )
    reconciler = get_reconciler(route) if ctx.uncertain else None
    try:
        with Heartbeat(store, claim.key, claim.fence, lease_seconds, ctx.cancelled):
            if reconciler is not None:
                found = reconciler(route, ctx)
                RECONCILED.labels("true" if found is not None else "false").inc()
                log.info("attempt.reconciled", found=found is not None)
                if found is not None:
                    return Succeeded(found)
            return Succeeded(get_action(route)(route, ctx))
    except Exception as error:
        failure = classify(error)
    if not failure.transient:
        return DeadLetter(failure, "permanent")
    if claim.attempt >= route.max_attempts:
        return DeadLetter(failure, "retries_exhausted")
    delay = next_delay(
        claim.attempt,
        failure.retry_after,
        base=route.backoff_base_seconds,
        cap=route.backoff_cap_seconds,
        rng=rng,
    )
    # The deadline runs from the first failure, on the database's clock. A retry (or a
    # server's Retry-After) that would land past it ends the key now rather than later.
    budget_started = claim.first_failed_at or claim.claimed_at
    spent = (claim.claimed_at - budget_started).total_seconds()
    if spent + delay > route.retry_deadline_seconds:
        return DeadLetter(failure, "retries_exhausted")
    return RetryLater(failure, delay)


def _record(store: KeyStore, claim: Claim, outcome: Outcome) -> bool:
    match outcome:
        case Succeeded(result):
            return store.succeed(claim.key, claim.fence, result.result, result.external_ref)
        case RetryLater(failure, delay):
            return store.schedule_retry(
                claim.key, claim.fence, delay, failure.error_code, failure.detail
            )
        case DeadLetter(failure, kind):
            return store.fail_final(
                claim.key, claim.fence, kind, failure.error_code, failure.detail
            )
        case _:
            assert_never(outcome)
