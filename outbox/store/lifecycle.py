"""The key's life: its states, who may move it, the allowed transitions, and the one fence.

Every statement that changes a key's status after it was created is here, and the worker, the
claims API, the sweeper and replays call these (the receiver's accept statements, which create
keys, are in `outbox.store.ingest`). A reader can check `TRANSITIONS` against the CHECK
constraint of `idempotency_keys.status` and against the table in docs/explanation/architecture.md;
a test does both.

Who acts (`actor`, decided when the key is created, never changed):
- `worker`: a key created by `POST /v1/events`; only the gateway's worker claims it.
- `workflow`: a key created by `POST /v1/claims`; only a workflow claims it. No path of the
  gateway (sweeper, replay, relay, worker) ever queues it for the worker.

One fencing scheme for both: a claim bumps `fence` and stores a fresh random `lease_token`
(128 bits or more). Every later write names both in the same WHERE and reports whether a row
matched; a stale holder, or anyone who guessed a number, changes nothing.

"It may still land" (`in_flight_until`) is one too: until then no statement here makes the key
someone else's (`claiming.LANDED`; docs/explanation/architecture.md, "The in-flight rule").

"It may have happened" (`uncertain`) is a fact on the key: set by a reclaim of an expired lease
and by every uncertain outcome, kept by every later failure, cleared only by a success or by a
reconcile that found no effect. The next holder reads it at claim and looks before acting.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from enum import StrEnum

from sqlalchemy import Float, TextClause, bindparam, text

from outbox.store import attempts, claiming


class Status(StrEnum):
    PENDING = "pending"
    PROCESSING = "processing"
    SUCCEEDED = "succeeded"
    FAILED_RETRYABLE = "failed_retryable"
    FAILED_FINAL = "failed_final"
    QUARANTINED = "quarantined"
    SUPERSEDED = "superseded"
    FANNED_OUT = "fanned_out"


class Actor(StrEnum):
    WORKER = "worker"
    WORKFLOW = "workflow"


@dataclass(frozen=True)
class Transition:
    """One allowed move: from which states, to which, by whom, through which statement."""

    name: str
    sources: tuple[Status | None, ...]  # None: the key does not exist yet
    target: Status
    by: str
    statement: str


_S = Status
TRANSITIONS: tuple[Transition, ...] = (
    Transition("accept", (None,), _S.PENDING, "receiver", "ingest.RESERVE_KEY"),
    Transition(
        "accept quarantined", (None,), _S.QUARANTINED, "receiver", "ingest.RESERVE_KEY_QUARANTINED"
    ),
    Transition(
        "accept fanned out", (None,), _S.FANNED_OUT, "receiver", "ingest.RESERVE_FANNED_OUT"
    ),
    Transition("deliver", (None,), _S.PENDING, "receiver or operator", "ingest.ADD_DELIVERIES"),
    Transition("first claim", (None,), _S.PROCESSING, "workflow", "CLAIM_NEW_KEY"),
    Transition(
        "claim",
        (_S.PENDING, _S.FAILED_RETRYABLE, _S.PROCESSING),  # processing: only an expired lease
        _S.PROCESSING,
        "worker or workflow (its own actor)",
        "CLAIM_KEY",
    ),
    Transition("renew", (_S.PROCESSING,), _S.PROCESSING, "holder", "RENEW_LEASE"),
    Transition("succeed", (_S.PROCESSING,), _S.SUCCEEDED, "holder", "SUCCEED"),
    Transition("retry", (_S.PROCESSING,), _S.FAILED_RETRYABLE, "holder", "SCHEDULE_RETRY"),
    Transition("defer", (_S.PROCESSING,), _S.FAILED_RETRYABLE, "holder (worker)", "DEFER"),
    Transition("hold", (_S.PROCESSING,), _S.PENDING, "holder (worker)", "DEFER"),
    Transition("fail", (_S.PROCESSING,), _S.FAILED_FINAL, "holder", "FAIL_FINAL"),
    Transition("quarantine", (_S.PROCESSING,), _S.QUARANTINED, "worker", "FAIL_FINAL"),
    Transition(
        "wait for the lane", (_S.PROCESSING,), _S.PENDING, "holder (lane step)", "lanes.ADMIT"
    ),
    Transition(
        "supersede",
        (_S.PROCESSING, _S.PENDING, _S.FAILED_FINAL, _S.QUARANTINED),
        _S.SUPERSEDED,
        "lane step (a newer version applied, waiting or running)",
        "lanes.ADMIT",
    ),
    Transition(
        "replay",
        (_S.FAILED_RETRYABLE, _S.FAILED_FINAL, _S.QUARANTINED, _S.PROCESSING),
        _S.PENDING,
        "operator (after a dry run)",
        "RESET_FOR_REPLAY",
    ),
)
"""Every status change there is. Re-drives by the sweeper change no status (they queue a new
delivery of a worker key); purging deletes finished keys."""

TERMINAL = frozenset({Status.SUCCEEDED, Status.FAILED_FINAL, Status.QUARANTINED, Status.SUPERSEDED})


def new_lease_token() -> str:
    """A holder's proof: 128 random bits, never derived from a host or a process id."""
    return secrets.token_hex(16)


CLAIM_NEW_KEY: TextClause = text(
    """
    -- A workflow's first claim of an unknown key: create it already held, as a workflow key,
    -- with its payload, its lane and version (the lane step runs next), in one statement. A
    -- concurrent first claim finds the row and goes on to CLAIM_KEY; a key an event created
    -- is never touched here. The rank is the version's; a key without one has none, so that
    -- it never holds its lane while it waits (a workflow told to wait may never come back).
    WITH reserved AS (
        INSERT INTO idempotency_keys (
            idempotency_key, actor, status, payload_hash, correlation_id, source, event_type,
            route, workflow_name, attempts, fence, lease_token, lease_owner, locked_until,
            expires_at, lane, lane_rank, in_flight_until
        )
        VALUES (
            :key, 'workflow', 'processing', :payload_hash, :correlation_id, 'claims', 'claim',
            '(claims)', :workflow, 1, 1, :token, :workflow,
            now() + make_interval(secs => :lease_seconds),
            now() + make_interval(secs => :ttl_seconds), :lane, CAST(:lane_rank AS numeric),
            now() + make_interval(secs => :lease_seconds + :in_flight_default)
        )
        ON CONFLICT (idempotency_key) DO NOTHING
        RETURNING idempotency_key, correlation_id, locked_until, fence, lane
    ), stored AS (
        INSERT INTO events (idempotency_key, source, event_type, external_id, version, payload)
        SELECT idempotency_key, 'claims', 'claim', :key, :version, CAST(:payload AS jsonb)
          FROM reserved
    ), logged AS (
        INSERT INTO attempts (idempotency_key, attempt, fence, started_at, outcome, worker)
        SELECT idempotency_key, 1, 1, now(), 'claimed', CAST(:workflow AS text) FROM reserved
    )
    SELECT idempotency_key, correlation_id, locked_until, fence, lane,
           CAST(:version AS text) AS version
      FROM reserved
    """
).bindparams(bindparam("in_flight_default", 0.0, type_=Float))


CLAIM_KEY: TextClause = text(
    f"""
    -- Take a key of this actor that nobody holds: pending, a due retry, or processing with an
    -- expired lease (a reclaim: the last holder may have acted, so the key becomes uncertain).
    -- The attempt is counted here, so a holder that dies still spends its budget. The lease
    -- comes from the database clock; the fence goes up and a fresh token is stored, so every
    -- earlier holder's writes are rejected from now on. :payload_hash NULL matches any, and
    -- so do :lane and :lane_rank (a claim naming a lane or version must name the key's own).
    -- The attempt log gets the previous holder's end on a reclaim, and a workflow's claim. A
    -- delivery reads its event's payload (event_key).
    WITH claimed AS (
        UPDATE idempotency_keys k
           SET {claiming.taken(":token")}
          FROM (SELECT status AS previous_status, lease_owner AS previous_owner,
                       updated_at AS previous_updated_at
                  FROM idempotency_keys
                 WHERE idempotency_key = :key
                   FOR UPDATE) previous
         WHERE k.idempotency_key = :key
           AND k.actor = :actor
           AND (CAST(:payload_hash AS text) IS NULL OR k.payload_hash = :payload_hash)
           AND (CAST(:lane AS text) IS NULL OR k.lane = :lane)
           AND (CAST(:lane_rank AS numeric) IS NULL OR k.lane_rank = :lane_rank)
           AND {claiming.CLAIMABLE}
        {claiming.RETURNED}
    ), {attempts.CLAIMED}
    {claiming.WITH_EVENT}
    """
).bindparams(*claiming.any_lane(), *claiming.window_binds())

KEY_STATE: TextClause = claiming.KEY_STATE

RENEW_LEASE: TextClause = text(
    """
    -- Extend the lease only while this holder still holds it (same fence and token); the time
    -- its requests may still land moves with it.
    UPDATE idempotency_keys
       SET locked_until = now() + make_interval(secs => :lease_seconds),
           in_flight_until = in_flight_until
               + (now() + make_interval(secs => :lease_seconds) - locked_until)
     WHERE idempotency_key = :key AND fence = :fence AND lease_token = :token
       AND status = 'processing'
    RETURNING locked_until
    """
)

# After a failed attempt: until when its last request may land (nothing after an answer).
_IN_FLIGHT_AFTER = """CASE WHEN :in_flight_seconds > 0
                          THEN now() + make_interval(secs => :in_flight_seconds) END"""

# A workflow's key keeps the token that finished it, so that the same call repeated (its answer
# was lost) is confirmed by `FINISHED_BY` instead of refused; the next claim replaces it, and a
# finished key's token can renew nothing (every lease step requires 'processing').
_KEPT_BY_WORKFLOW = "CASE WHEN actor = 'workflow' THEN lease_token END"

FINISHED_BY: TextClause = text(
    """
    -- What this token recorded when it finished the key, if the key has not moved on since
    -- (no claim, replay or purge after it): a repeated complete or fail is answered with it.
    SELECT status, external_ref FROM idempotency_keys
     WHERE idempotency_key = :key AND fence = :fence AND lease_token = :token
       AND actor = 'workflow' AND status <> 'processing'
    """
)

SUCCEED: TextClause = text(
    f"""
    -- The effect happened: store the result under the fence, and the attempt in the log; the
    -- key is no longer uncertain.
    WITH done AS (
        UPDATE idempotency_keys
           SET status = 'succeeded', result = CAST(:result AS jsonb),
               external_ref = :external_ref, error_code = NULL, error_detail = NULL,
               uncertain = false, lease_token = {_KEPT_BY_WORKFLOW}, lease_owner = NULL,
               locked_until = NULL, in_flight_until = NULL, updated_at = now()
         WHERE idempotency_key = :key AND fence = :fence AND lease_token = :token
           AND status = 'processing'
        RETURNING idempotency_key, attempts, correlation_id
    ), {attempts.logged("done")}
    SELECT attempts, correlation_id FROM done
    """
)

SCHEDULE_RETRY: TextClause = text(
    f"""
    -- A transient failure, under the fence. Uncertainty is kept unless this attempt's
    -- reconcile found no effect, and added when this outcome is itself uncertain. A worker key
    -- gets the outbox row that brings it back when due, in the same statement (the retry waits
    -- in the database, not in the broker); a workflow key is claimable again at once. The
    -- attempt goes to the log in the same statement. A request of this attempt that got no
    -- answer may land for :in_flight_seconds more: nobody takes the key before that.
    WITH failed AS (
        UPDATE idempotency_keys
           SET status = 'failed_retryable', error_code = :error_code,
               error_detail = :error_detail,
               uncertain = (uncertain AND NOT :reconciled_absent) OR :uncertain,
               lease_token = {_KEPT_BY_WORKFLOW}, lease_owner = NULL, locked_until = NULL,
               first_failed_at = COALESCE(first_failed_at, now()),
               in_flight_until = {_IN_FLIGHT_AFTER},
               next_attempt_at = now() + make_interval(
                   secs => GREATEST(:delay_seconds, :in_flight_seconds)),
               updated_at = now()
         WHERE idempotency_key = :key AND fence = :fence AND lease_token = :token
           AND status = 'processing'
        RETURNING idempotency_key, actor, correlation_id, next_attempt_at, attempts
    ), queued AS (
        INSERT INTO outbox (idempotency_key, task_name, correlation_id, available_at)
        SELECT idempotency_key, :task_name, correlation_id, next_attempt_at
          FROM failed WHERE actor = 'worker'
    ), {attempts.logged("failed")}
    SELECT correlation_id, next_attempt_at FROM failed
    """
).bindparams(bindparam("in_flight_seconds", 0.0, type_=Float))

FAIL_FINAL: TextClause = text(
    f"""
    -- A permanent failure, a spent budget or a broken contract (:final_status failed_final or
    -- quarantined): the fenced status change and the dead letter an operator will see are one
    -- statement, with the attempt's row in the log. Uncertainty follows the same rule as a
    -- retry; a replay reads it, and is due no earlier than this attempt's last request may
    -- land (:in_flight_seconds).
    WITH failed AS (
        UPDATE idempotency_keys
           SET status = :final_status, error_code = :error_code, error_detail = :error_detail,
               uncertain = (uncertain AND NOT :reconciled_absent) OR :uncertain,
               lease_token = {_KEPT_BY_WORKFLOW}, lease_owner = NULL, locked_until = NULL,
               next_attempt_at = NULL, first_failed_at = COALESCE(first_failed_at, now()),
               in_flight_until = {_IN_FLIGHT_AFTER}, updated_at = now()
         WHERE idempotency_key = :key AND fence = :fence AND lease_token = :token
           AND status = 'processing'
        RETURNING idempotency_key, attempts, first_failed_at, correlation_id
    ), dead AS (
        INSERT INTO dead_letters (idempotency_key, kind, error_code, error_detail, attempts,
                                  first_failed_at, last_failed_at)
        SELECT idempotency_key, :kind, :error_code, :error_detail, attempts, first_failed_at,
               now()
          FROM failed
    ), {attempts.logged("failed")}
    SELECT correlation_id FROM failed
    """
).bindparams(bindparam("in_flight_seconds", 0.0, type_=Float))

# A paused route's key is logged as deferred by the pause, whatever reason the worker gave.
_DEFER_LOGGED = attempts.logged(
    "deferred",
    outcome="CASE WHEN status = 'pending' THEN 'deferred_pause' ELSE CAST(:outcome AS text) END",
    error_code="CASE WHEN status = 'pending' THEN 'route_paused'"
    " ELSE CAST(:log_error_code AS text) END",
)

DEFER: TextClause = text(
    f"""
    -- Give a claim back unspent, under the fence: its route cannot take it now (paused, circuit
    -- open, over its rate or in-flight limit, or a probe the downstream refused). The attempt
    -- the claim counted is returned. A paused route's key waits as pending with no delivery
    -- (resuming queues it); any other waits as failed_retryable with its outbox row due after
    -- :delay_seconds. The route row is read FOR SHARE, so a concurrent resume either finds this
    -- key pending or this statement finds the route resumed: no key is left without a way on.
    -- A wait the downstream asked for (:starts_budget: "in progress, ask again") starts the
    -- key's retry deadline like a failure would, so such waits end within the deadline. The
    -- log gets the attempt as deferred by the pause, or by the reason given.
    WITH route AS (
        SELECT paused FROM route_state WHERE route = :route FOR SHARE
    ), held AS (
        SELECT COALESCE((SELECT paused FROM route), false) AS paused
    ), deferred AS (
        UPDATE idempotency_keys k
           SET status = CASE WHEN held.paused THEN 'pending' ELSE 'failed_retryable' END,
               attempts = GREATEST(k.attempts - 1, 0),
               error_code = CASE WHEN held.paused THEN 'route_paused' ELSE :error_code END,
               error_detail = CASE WHEN held.paused THEN 'the route is paused'
                                   ELSE :error_detail END,
               lease_token = NULL, lease_owner = NULL, locked_until = NULL,
               in_flight_until = NULL,
               next_attempt_at = CASE WHEN held.paused THEN NULL
                                      ELSE now() + make_interval(secs => :delay_seconds) END,
               first_failed_at = CASE WHEN :starts_budget THEN COALESCE(k.first_failed_at, now())
                                      ELSE k.first_failed_at END,
               updated_at = now()
          FROM held
         WHERE k.idempotency_key = :key AND k.fence = :fence AND k.lease_token = :token
           AND k.status = 'processing'
        RETURNING k.idempotency_key, k.actor, k.correlation_id, k.status, k.next_attempt_at,
                  k.attempts
    ), queued AS (
        INSERT INTO outbox (idempotency_key, task_name, correlation_id, available_at)
        SELECT idempotency_key, :task_name, correlation_id, next_attempt_at
          FROM deferred WHERE actor = 'worker' AND status = 'failed_retryable'
    ), {_DEFER_LOGGED}
    SELECT status, next_attempt_at FROM deferred
    """
)

RESET_FOR_REPLAY: TextClause = text(
    """
    -- Back to pending with a fresh attempt budget, checked and done in this one statement
    -- under the row lock: only a key still failed or quarantined, or processing with an
    -- expired lease, in one of :statuses, and (with :as_of, a dry run's time) unchanged since
    -- then. A key a worker took again, finished or changed meanwhile is left alone. The fence
    -- goes up and the token is cleared, so the holder of an expired lease can no longer
    -- write; a key replayed out of processing becomes uncertain (its holder may have acted),
    -- and uncertainty is kept, so the next claim reconciles first.
    UPDATE idempotency_keys
       SET status = 'pending', attempts = 0, fence = fence + 1, lease_token = NULL,
           lease_owner = NULL, locked_until = NULL, next_attempt_at = NULL,
           first_failed_at = NULL, uncertain = uncertain OR status = 'processing',
           updated_at = now()
     WHERE idempotency_key = ANY(:keys)
       AND status = ANY(:statuses)
       AND status IN ('failed_retryable', 'failed_final', 'quarantined', 'processing')
       AND (status <> 'processing' OR locked_until < now())
       AND (CAST(:as_of AS timestamptz) IS NULL
            OR (updated_at <= :as_of
                AND (status <> 'processing' OR locked_until < :as_of)))
    RETURNING idempotency_key, correlation_id, event_type, route
    """
)

ENQUEUE_REPLAYED: TextClause = text(
    """
    -- Only worker keys get a delivery: a workflow key replayed is claimable, and its
    -- workflow claims it. The delivery is due once the last request of the key can no longer
    -- land (the in-flight rule), so its lookup comes after it.
    INSERT INTO outbox (idempotency_key, task_name, correlation_id, available_at)
    SELECT idempotency_key, :task_name, correlation_id, GREATEST(now(), in_flight_until)
      FROM idempotency_keys WHERE idempotency_key = ANY(:keys) AND actor = 'worker'
    """
)
