"""The worker's side of the key store: claim, renew, and finish under the fence.

Each step is ONE statement from `outbox.store.lifecycle`, atomic by itself, sent in autocommit: no
transaction is ever open across an external call, and a step costs one round trip instead of
four (pre-ping, BEGIN, statement, COMMIT). Every write after the claim names the fence and
the claim's random lease token and reports whether a row matched; a holder whose lease was
taken over changes nothing.

A statement that meets a connection the server has dropped (PostgreSQL restarted, an idle
connection cut) is sent once more on a fresh one. That is safe for every step: a repeated claim
of a key this worker already took finds its lease live and is blocked (the sweeper re-drives it
when the lease runs out), and a repeated fenced write matches no row once the first one landed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, TextClause
from sqlalchemy.exc import DataError

from outbox.core.logs import get_logger
from outbox.core.redaction import redact
from outbox.core.wire import PROCESS_TASK
from outbox.store import attempts, lanes, lifecycle
from outbox.store import routes as route_queries
from outbox.store.driven import rows_once_more
from worker.results import storable_ref, storable_result, storable_text

# Error details are for people reading a dead letter, not a place to keep response bodies.
MAX_DETAIL_CHARS = 2048

log = get_logger(__name__)


@dataclass(frozen=True)
class RouteView:
    """A route's pause and circuit as of the claim (no row yet: closed, not paused)."""

    paused: bool = False
    circuit: str = "closed"
    open_until: datetime | None = None


@dataclass(frozen=True)
class Claim:
    """A key this worker now holds, with the event to act on."""

    key: str
    fence: int
    token: str
    attempt: int
    correlation_id: str
    route: str
    source: str
    event_type: str
    external_id: str
    version: str | None
    payload: dict[str, Any]
    locked_until: datetime
    claimed_at: datetime
    first_failed_at: datetime | None
    previous_status: str
    previous_error_code: str | None
    # An earlier attempt may have had its effect: look before acting.
    uncertain: bool
    # The route's shared state as the claim saw it (read in the claim's own statement).
    route_state: RouteView = field(default_factory=RouteView)
    # The route's in-flight slot this attempt holds, renewed with the lease.
    permit: int | None = None
    # Its lane on a route with `order_by` (worker.lanes), else None.
    lane: str | None = None
    # Who holds it (host:pid:thread), for the attempt log.
    owner: str = ""
    # When the claim was sent, on this process's monotonic clock: no later than the database's
    # now() that set the lease, so the worker's trust in the lease is counted from here.
    sent: float = 0.0


@dataclass(frozen=True)
class Blocked:
    """A delivery that found the key finished, held, not yet due, or a workflow's."""

    status: str | None
    lease_live: bool
    actor: str | None = None


@dataclass(frozen=True)
class Failed:
    """What a failed attempt records: the error and what it says about the effect."""

    error_code: str
    detail: str
    # This attempt's outcome leaves the effect unknown (it may have happened).
    uncertain: bool
    # This attempt's reconcile asked the downstream and found no effect.
    reconciled_absent: bool
    # What the downstream answered, when it answered (for the attempt log).
    status_code: int | None = None
    # Another attempt might help (a dead letter of a spent budget is logged `transient`).
    transient: bool = True
    # How long a request of this attempt that got no answer may still land (0: none).
    in_flight_seconds: float = 0.0


@dataclass(frozen=True)
class InFlight:
    """How long a request of each route may still land after its sender gave up on it, as the
    claim statements read it (`outbox.core.inflight`): a claim's key is not anyone else's
    before its lease's end plus its route's window. No windows: a store that sends nothing."""

    windows: str = "{}"  # JSON: route label -> seconds
    default: float = 0.0  # a route not in `windows` (no longer configured)

    def params(self) -> dict[str, Any]:
        return {"in_flight": self.windows, "in_flight_default": self.default}


# A deferral's reason -> its class in the attempt log (a pause is decided by DEFER itself).
_DEFERRED = {"circuit_open": "deferred_circuit", "in_progress": "deferred_in_progress"}


class KeyStore:
    def __init__(self, engine: Engine, in_flight: InFlight | None = None) -> None:
        # The worker's engine is in autocommit (`create_sync_engine(autocommit=True)`): then
        # `begin()` adds no round trip. On any other engine each step is its own transaction.
        self.engine = engine
        self.in_flight = in_flight or InFlight()

    def one(self, statement: TextClause, params: dict[str, Any]) -> Mapping[str, Any] | None:
        """Run one statement; its first row, or None when it matched nothing."""
        rows = self.all(statement, params)
        return rows[0] if rows else None

    def all(self, statement: TextClause, params: dict[str, Any]) -> list[dict[str, Any]]:
        """Run one statement; its rows. Sent once more on a fresh connection when the server
        had dropped this one (see the module's docstring)."""
        return rows_once_more(self.engine, statement, params)

    def claim(self, key: str, owner: str, lease_seconds: float) -> Claim | Blocked:
        """Take the key with a fresh lease, fence and token, or say why not (counted).

        `owner` (host and process) is stored for operators only; the token proves holding.
        """
        token = lifecycle.new_lease_token()
        sent = time.monotonic()
        row = self.one(
            lifecycle.CLAIM_KEY,
            {
                "key": key,
                "actor": lifecycle.Actor.WORKER.value,
                "payload_hash": None,
                "token": token,
                "owner": owner,
                "lease_seconds": lease_seconds,
                **self.in_flight.params(),
            },
        )
        return self.blocked(key) if row is None else claim_of(row, token, owner, sent)

    def blocked(self, key: str) -> Blocked:
        """Why a delivery of `key` was refused (finished, held, not due, a workflow's), counted."""
        state = self.one(
            lifecycle.KEY_STATE, {"key": key, "payload_hash": None, "refused_by": "worker"}
        )
        if state is None:
            return Blocked(status=None, lease_live=False)
        return Blocked(
            status=state["status"], lease_live=bool(state["lease_live"]), actor=state["actor"]
        )

    def admit(self, step: dict[str, Any]) -> Mapping[str, Any]:
        """The lane step of one key (`worker.lanes`): `lane_admit`'s decision, which it gives
        for every call (`lost` for a key no longer held)."""
        return self.all(lanes.ADMIT, step)[0]

    def renew(self, claim: Claim, lease_seconds: float) -> datetime | None:
        """Extend the lease; None means it is lost (another holder has a newer fence)."""
        row = self.one(
            lifecycle.RENEW_LEASE,
            {
                "key": claim.key,
                "fence": claim.fence,
                "token": claim.token,
                "lease_seconds": lease_seconds,
            },
        )
        if row is None:
            return None
        if claim.permit is not None:
            self.one(
                route_queries.RENEW_PERMIT,
                {
                    "route": claim.route,
                    "slot": claim.permit,
                    "key": claim.key,
                    "fence": claim.fence,
                    "until": row["locked_until"],
                },
            )
        locked_until: datetime = row["locked_until"]
        return locked_until

    def succeed(
        self, claim: Claim, result: Any, external_ref: str | None, reconciled: bool | None = None
    ) -> bool:
        """Record the effect; False when the fence rejected the write.

        The effect happened, so the key ends `succeeded` whatever the result is: a value
        that is not JSON, too large, or refused by the database is replaced by what could be
        kept and a note saying why, and never makes the action run again. `reconciled`: this
        attempt's reconcile found the effect (True) or found none before acting (False).
        """
        params = success_params(claim, result, external_ref, reconciled)
        try:
            row = self.one(lifecycle.SUCCEED, params)
        except DataError as error:
            log.warning("attempt.result_unstorable", error=type(error.orig).__name__)
            params["result"] = json.dumps(
                {"result_dropped": f"the database refused it ({type(error.orig).__name__})"}
            )
            params["external_ref"] = None
            row = self.one(lifecycle.SUCCEED, params)
        return row is not None

    def schedule_retry(self, claim: Claim, delay_seconds: float, failed: Failed) -> bool:
        """Mark failed_retryable and queue the next attempt in the outbox, atomically."""
        row = self.one(
            lifecycle.SCHEDULE_RETRY,
            {
                **self._failure_params(
                    claim, failed, "uncertain" if failed.uncertain else "transient"
                ),
                "delay_seconds": delay_seconds,
                "task_name": PROCESS_TASK,
            },
        )
        return row is not None

    def defer(
        self,
        claim: Claim,
        delay_seconds: float,
        error_code: str,
        detail: str,
        starts_budget: bool = False,
        sent: bool = True,
    ) -> str | None:
        """Give the claim back unspent: the status it now waits in (`pending` when its route
        is paused, else `failed_retryable` with its delivery due later), or None when the fence
        rejected the write. `starts_budget`: a wait the downstream asked for, which starts the
        retry deadline's clock (`first_failed_at`) when nothing else has. Not `sent`: the
        attempt's request reached nothing that could act (the attempt log says `not_sent`)."""
        outcome = _DEFERRED.get(error_code, "deferred_limit") if sent else "not_sent"
        row = self.one(
            lifecycle.DEFER,
            {
                **attempt_params(
                    claim,
                    outcome,
                    error_code=error_code,
                    detail=detail,
                ),
                "route": claim.route,
                "delay_seconds": delay_seconds,
                "error_code": error_code,
                "error_detail": detail[:MAX_DETAIL_CHARS],
                "task_name": PROCESS_TASK,
                "starts_budget": starts_budget,
            },
        )
        return None if row is None else str(row["status"])

    def fail_final(self, claim: Claim, kind: str, failed: Failed) -> bool:
        """Mark failed_final (quarantined for a contract failure) and write the dead letter,
        atomically."""
        outcome = "permanent"
        if failed.uncertain or (failed.transient and kind == "retries_exhausted"):
            outcome = "uncertain" if failed.uncertain else "transient"
        row = self.one(
            lifecycle.FAIL_FINAL,
            {
                **self._failure_params(claim, failed, outcome),
                "kind": kind,
                "final_status": "quarantined" if kind == "quarantined" else "failed_final",
            },
        )
        return row is not None

    @staticmethod
    def _failure_params(claim: Claim, failed: Failed, outcome: str) -> dict[str, Any]:
        return {
            **attempt_params(
                claim,
                outcome,
                reconciled=False if failed.reconciled_absent else None,
                status_code=failed.status_code,
                error_code=failed.error_code,
                detail=failed.detail,
            ),
            "error_code": failed.error_code,
            "error_detail": storable_text(redact(failed.detail))[:MAX_DETAIL_CHARS],
            "uncertain": failed.uncertain,
            "reconciled_absent": failed.reconciled_absent,
            "in_flight_seconds": failed.in_flight_seconds,
        }


def success_params(
    claim: Claim, result: Any, external_ref: str | None, reconciled: bool | None
) -> dict[str, Any]:
    """`SUCCEED`'s parameters: the attempt row's, the result and reference as they can be kept."""
    answered = result.get("status_code") if isinstance(result, dict) else None
    return {
        **attempt_params(
            claim,
            "reconciled_found" if reconciled else "succeeded",
            reconciled=reconciled,
            status_code=answered if isinstance(answered, int) else None,
        ),
        "result": storable_result(result),
        "external_ref": storable_ref(external_ref),
    }


def attempt_params(
    claim: Claim,
    outcome: str,
    *,
    reconciled: bool | None = None,
    status_code: int | None = None,
    error_code: str | None = None,
    detail: str | None = None,
) -> dict[str, Any]:
    """The fenced write's own parameters and its attempt row's (`outbox.store.attempts`): the
    detail bounded and redacted like a dead letter's, only shorter."""
    return {
        "key": claim.key,
        "fence": claim.fence,
        "token": claim.token,
        "attempt": claim.attempt,
        "started_at": claim.claimed_at,
        "worker": claim.owner or None,
        "outcome": outcome,
        "reconciled": reconciled,
        "status_code": status_code,
        "log_error_code": error_code,
        "log_detail": None
        if detail is None
        else storable_text(redact(detail))[: attempts.DETAIL_CHARS],
    }


def claim_of(row: Mapping[str, Any], token: str, owner: str, sent: float) -> Claim:
    """The claim a row of `CLAIM_KEY` or `siblings.CLAIM_KEYS` describes."""
    return Claim(
        key=row["idempotency_key"],
        fence=row["fence"],
        token=token,
        attempt=row["attempts"],
        correlation_id=row["correlation_id"],
        route=row["route"],
        source=row["source"],
        event_type=row["event_type"],
        external_id=row["external_id"],
        version=row["version"],
        payload=row["payload"],
        locked_until=row["locked_until"],
        claimed_at=row["claimed_at"],
        first_failed_at=row["first_failed_at"],
        previous_status=row["previous_status"],
        previous_error_code=row["previous_error_code"],
        uncertain=row["uncertain"],
        route_state=RouteView(
            paused=bool(row["route_paused"]),
            circuit=row["route_circuit"] or "closed",
            open_until=row["route_open_until"],
        ),
        lane=row["lane"],
        owner=owner,
        sent=sent,
    )
