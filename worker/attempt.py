"""One attempt at a key, top to bottom: claim → order → admit → act (reconcile first when
uncertain) → record → tell, ending in one closed outcome.

The broker may deliver a message twice, late, or after another worker already finished the key;
the claim makes all of that harmless. Recording names the fence and the claim's token, so an
attempt that lost its lease records nothing (`lease_lost`).

Every path out of an attempt ends in a recorded outcome or in a lease given up:
- the attempt is counted at the claim, so a process that dies mid-action (OOM, a segfault,
  `os._exit`) still spends its budget; a claim past the budget is dead-lettered (`crash_loop`)
  without acting;
- the action runs in a thread of its own under the route's hard time limit; past it the attempt
  records an uncertain `action_timeout`, which gives the lease up, and whatever the action
  returns later is never recorded;
- when the lease is lost, or cannot be proven (the database is unreachable), the attempt stops
  waiting and records nothing; the next holder finds the key uncertain and looks first;
- a success whose result cannot be stored is still a success (`worker.results`);
- a key whose lane is not its turn is parked unspent, and a stale version is recorded
  `superseded`, before anything else (`worker.lanes`, order);
- a key its route cannot take now (paused, circuit open, over a limit) is given back unspent
  before any external call (`worker.guard`, admit);
- the outcome is recorded first, and only a recorded outcome at the downstream is then told to
  the route's breaker (tell): bookkeeping that fails can neither hide an outcome nor make the
  action run again.
"""

from __future__ import annotations

import contextvars
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import assert_never

import structlog

from outbox.core import contract, inflight, keys, tracing
from outbox.core.logs import get_logger
from outbox.core.routes import ActionSettings, RouteTable
from worker import spare
from worker.actions import INSTANT, ActionContext, ActionResult, get_action, get_reconciler
from worker.errors import Failure, TransientError, classify
from worker.guard import Admitted, Held, RouteGuard
from worker.instruments import ACTION_SECONDS, ATTEMPTS, OTHER_ROUTE, RECONCILED
from worker.lanes import order
from worker.lease import Heartbeat, holder
from worker.outcomes import (
    DeadLetter,
    Deferred,
    LaneWaiting,
    LeaseGivenUp,
    Outcome,
    RetryLater,
    Succeeded,
    Superseded,
    Told,
    after_failure,
    told,
)
from worker.store import Blocked, Claim, Failed, KeyStore
from worker.task_state import Finished

log = get_logger(__name__)

# The jitter of retries and deferrals: one generator per process, seeded anew in each forked
# child so that prefork children do not draw the same delays (a generator per attempt seeded
# itself from the OS each time: 1 % of the worker's samples). Its draws are thread-safe.
_RANDOM = random.Random()
os.register_at_fork(after_in_child=_RANDOM.seed)


def run_attempt(
    store: KeyStore,
    routes: RouteTable,
    key: str,
    *,
    lease_seconds: float,
    rng: random.Random | None = None,
    guard: RouteGuard | None = None,
) -> Finished:
    """Process one delivery of `key`; returns what happened, for the task's log line, with
    its error code (`Finished`) for the task's state.

    Without a `guard` routes have no limits, no breaker and no pause."""
    claim = store.claim(key, holder(), lease_seconds)
    if isinstance(claim, Blocked):
        log.info(
            "delivery.blocked",
            key=keys.mask_key(key),
            status=claim.status,
            lease_live=claim.lease_live,
            actor=claim.actor,
        )
        ATTEMPTS.labels("blocked", "").inc()
        return Finished("blocked")
    structlog.contextvars.bind_contextvars(
        key=keys.mask_key(key),
        correlation_id=claim.correlation_id,
        event_type=claim.event_type,
        attempt=claim.attempt,
    )
    log.info(
        "attempt.claimed",
        transition=f"{claim.previous_status} -> processing",
        fence=claim.fence,
        uncertain=claim.uncertain,
    )
    route = routes.by_label(claim.route) or routes.resolve(claim.event_type)
    tracing.attempt_route(route.label if route is not None else claim.route, claim.attempt)
    started = time.monotonic()
    outcome: Outcome
    # What the downstream did, for the breaker: set only when the action ran.
    heard: Told | None = None
    trial = False
    if route is None:
        outcome = DeadLetter(
            Failure(False, "no_route", f"no route named {claim.route!r} is configured"),
            "permanent",
        )
    elif claim.attempt > route.max_attempts and not _within_window(claim):
        outcome = DeadLetter(
            Failure(
                True,
                "crash_loop",
                f"attempt {claim.attempt} of at most {route.max_attempts}: the earlier ones "
                "ended without an outcome (the process died or lost its lease)",
            ),
            "retries_exhausted",
        )
    elif (turn := order(store, route, claim)) is not None:
        outcome = turn
    else:
        limit = inflight.action_limit(route, lease_seconds)
        rng = rng or _RANDOM
        # A trial's time: its action's limit and a lease, after which another key may try.
        admission = guard.admit(route, claim, limit + lease_seconds, rng) if guard else Admitted()
        if isinstance(admission, Held):
            outcome = Deferred(admission.reason, admission.delay, admission.detail)
        else:
            claim, trial = replace(claim, permit=admission.permit), admission.trial
            release = guard.release if guard else None
            outcome = _act(store, route, claim, lease_seconds, limit, rng, release)
            heard = told(outcome)
    recorded = not isinstance(outcome, LeaseGivenUp) and _record(store, claim, outcome)
    if recorded and guard is not None and route is not None and heard is not None:
        guard.tell(route, claim, heard.failure, trial)
    elapsed = time.monotonic() - started
    result = _log_finished(outcome, recorded, round(elapsed * 1000, 1))
    error_code = outcome.failure.error_code if isinstance(outcome, RetryLater | DeadLetter) else ""
    if isinstance(outcome, Deferred):
        error_code = outcome.reason
    if isinstance(outcome, LaneWaiting):
        error_code = "lane_waiting"
    ATTEMPTS.labels(result, error_code).inc()
    # The configured route's label: a key's stored route may name one no longer configured.
    ACTION_SECONDS.labels(route.label if route is not None else OTHER_ROUTE).observe(elapsed)
    return Finished(result, error_code)


def _log_finished(outcome: Outcome, recorded: bool, duration_ms: float) -> str:
    """The attempt's one canonical log line; returns the outcome's name."""
    if not recorded:
        log.warning(
            "attempt.finished",
            outcome="lease_lost",
            attempted=type(outcome).__name__,
            reason=outcome.reason if isinstance(outcome, LeaseGivenUp) else "fenced_out",
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
                uncertain=outcome.failure.uncertain,
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
        case Deferred():
            log.info(
                "attempt.finished",
                outcome="deferred",
                transition="processing -> pending or failed_retryable (attempt returned)",
                reason=outcome.reason,
                retry_in=round(outcome.delay, 2),
                duration_ms=duration_ms,
            )
            return "deferred"
        case LaneWaiting():
            log.info(
                "attempt.finished",
                outcome="lane_waiting",
                transition="processing -> pending (parked behind its lane, attempt returned)",
                expected_wait=outcome.expected,
                duration_ms=duration_ms,
            )
            return "deferred"
        case Superseded():
            log.info(
                "attempt.finished",
                outcome="superseded",
                transition="processing -> superseded",
                superseded_by=outcome.by,
                duration_ms=duration_ms,
            )
            return "superseded"
        case LeaseGivenUp():
            raise AssertionError("a lease given up is never recorded")
        case _:
            assert_never(outcome)


def _within_window(claim: Claim) -> bool:
    """Past the attempt budget, yet the last attempt ended with a recorded outcome (a retry,
    possibly deferred since): only a failure bounded by a window rather than by the attempt
    count gets here (n8n's "webhook not registered", `outcomes.after_failure`), and the window
    ends the key. A crash loop is a claim of a key whose last attempt never ended
    (`processing`, its lease expired)."""
    return claim.previous_status == "failed_retryable"


@dataclass
class _Run:
    """The action's thread and what it left: a result, an error, whether reconcile ran dry."""

    done: threading.Event
    # Set when the action ends and when the lease is given up: what the attempt waits on.
    wake: threading.Event
    result: ActionResult | None = None
    error: BaseException | None = None
    # Called when the action's thread ends, whenever that is (frees the route's permit).
    release: Callable[[Claim], None] | None = None
    reconciled_absent: bool = False
    # This attempt reconciled: found the effect (True) or none (False); None: it did not.
    reconciled: bool | None = None


def _act(
    store: KeyStore,
    route: ActionSettings,
    claim: Claim,
    lease_seconds: float,
    limit: float,
    rng: random.Random,
    release: Callable[[Claim], None] | None = None,
) -> Outcome:
    broken = contract.violations(route, claim.payload)
    if broken:
        if release is not None:
            release(claim)
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
        uncertain=claim.uncertain,
    )
    run = _Run(done=threading.Event(), wake=threading.Event(), release=release)
    with Heartbeat(store, claim, lease_seconds, ctx.cancelled, run.wake, claim.sent) as heartbeat:
        if heartbeat.lost:
            # The claim's answer came after its trust window: nothing starts, not even a lookup.
            if release is not None:
                release(claim)
            return LeaseGivenUp("lease_expired_unconfirmed")
        ctx.trusted_until = lambda: heartbeat.valid_until
        _start(run, route, ctx, claim)
        deadline = time.monotonic() + limit
        while not run.done.is_set():
            # Wake when the action ends, the keeper gives the lease up, the time limit passes
            # or our own view of the lease runs out (whichever comes first).
            run.wake.wait(max(0.0, min(deadline, heartbeat.valid_until) - time.monotonic()))
            if run.done.is_set():
                break
            if heartbeat.lost:
                # Stop waiting; the action may still finish, but its result is never recorded.
                return LeaseGivenUp("lease_lost")
            if time.monotonic() >= deadline:
                ctx.cancelled.set()
                failure = Failure(
                    True,
                    "action_timeout",
                    f"the action ran past its {limit:g} s limit; its late result is ignored",
                    None,
                    True,
                )
                return after_failure(
                    route, claim, failure, run.reconciled_absent, rng, lease_seconds
                )
            if time.monotonic() >= heartbeat.valid_until:
                heartbeat.give_up("lease_expired_unconfirmed")
    # The action ended: record what it did under the fence, which refuses a lost lease's write.
    if run.result is not None:
        return Succeeded(run.result, run.reconciled)
    assert run.error is not None
    return after_failure(
        route, claim, classify(run.error), run.reconciled_absent, rng, lease_seconds
    )


def _start(run: _Run, route: ActionSettings, ctx: ActionContext, claim: Claim) -> None:
    """Reconcile (when uncertain) then act, in a thread of its own (`worker.spare`) with the
    task's context; an action that returns at once (`INSTANT`) in the attempt's own thread."""
    reconciler = get_reconciler(route) if ctx.uncertain else None

    def work() -> None:
        try:
            if reconciler is not None:
                _still_held(ctx)
                found = reconciler(route, ctx)
                RECONCILED.labels("true" if found is not None else "false").inc()
                log.info("attempt.reconciled", found=found is not None)
                run.reconciled = found is not None
                if found is not None:
                    run.result = found
                    return
                run.reconciled_absent = True
            _still_held(ctx)
            run.result = get_action(route)(route, ctx)
        except BaseException as error:  # everything ends in an outcome
            run.error = error
        finally:
            if run.release is not None:
                run.release(claim)
            run.done.set()
            run.wake.set()

    if reconciler is None and route.action in INSTANT:
        return work()
    context = contextvars.copy_context()
    spare.run(partial(context.run, work), "action")


def _still_held(ctx: ActionContext) -> None:
    """Between steps of the action's thread: a lease lost meanwhile ends it before the next."""
    if not ctx.lease_held():
        raise TransientError("lease_lost", "the lease was lost before the action started")


def _failed(failure: Failure, reconciled_absent: bool, in_flight: float) -> Failed:
    return Failed(
        failure.error_code,
        failure.detail,
        failure.uncertain,
        reconciled_absent,
        failure.status_code,
        failure.transient,
        in_flight,
    )


def _record(store: KeyStore, claim: Claim, outcome: Outcome) -> bool:
    match outcome:
        case Succeeded(result, reconciled):
            return store.succeed(claim, result.result, result.external_ref, reconciled)
        case RetryLater(failure, delay, absent, in_flight):
            return store.schedule_retry(claim, delay, _failed(failure, absent, in_flight))
        case DeadLetter(failure, kind, absent, in_flight):
            return store.fail_final(claim, kind, _failed(failure, absent, in_flight))
        case Deferred(reason, delay, detail, starts_budget, not_sent):
            sent = not_sent is None
            return store.defer(claim, delay, reason, detail, starts_budget, sent) is not None
        case LaneWaiting() | Superseded():
            return True  # the lane step decided and wrote it in one call
        case LeaseGivenUp():
            return False
        case _:
            assert_never(outcome)
