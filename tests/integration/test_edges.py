"""Exactly once at the edges: every path that creates or changes a key (events, claims, the
sweeper, replays, the worker's odd endings) checked against the others, from outside, counting
effects at the fake downstream."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from outbox.core.settings import Settings
from outbox.store.engines import create_sync_engine
from tests.support import (
    AUTH,
    CLAIMS_TOKEN,
    Downstream,
    Reply,
    Stack,
    claim,
    claim_call,
    envelope,
    finished,
    key_state,
    proxied_database,
    query,
    seed_pending_key,
    wait_until,
)
from worker.lease import Heartbeat
from worker.store import Claim, KeyStore


def _post(stack: Stack, external_id: str, event_type: str, **payload: Any) -> str:
    with stack.client() as client:
        answer = client.post("/v1/events", json=envelope(external_id, event_type, payload=payload))
    assert answer.status_code == 202, answer.text
    key: str = answer.json()["key"]
    return key


# --- 1. a workflow's key is never the worker's ------------------------------------------------


def test_an_expired_workflow_claim_is_left_to_its_workflow(private_stack: Stack) -> None:
    """A claims key whose lease expired is never re-driven, acted on or finished by the gateway
    (the sweeper re-drives a worker key beside it meanwhile); the next claim reclaims it with
    uncertain: true, and a replay makes it claimable again without queueing it for a worker."""
    stack = private_stack
    stack.start_all()
    stack.start_sweeper()
    claimed = claim(stack, "wf-expired", payload={"lead": 1}, lease_seconds=1)
    assert claimed.status_code == 201
    # The claim's lease has run out (by the database's clock) before the control key's does.
    wait_until(
        lambda: (
            query(
                stack.database_url,
                "SELECT locked_until < now() FROM idempotency_keys"
                " WHERE idempotency_key = 'wf-expired'",
            )
            == [(True,)]
        ),
        timeout=10,
    )
    control = seed_pending_key(stack.database_url, "control")
    query(
        stack.database_url,
        "UPDATE idempotency_keys SET status = 'processing', fence = 1, attempts = 1,"
        " locked_until = now() - interval '1 second',"
        " in_flight_until = NULL WHERE idempotency_key = %s",
        (control,),
    )
    # The sweeper's pass that re-drives the control key also saw the expired claim.
    wait_until(lambda: key_state(stack, control)["status"] == "succeeded", timeout=60)
    assert query(
        stack.database_url,
        "SELECT status, attempts, result FROM idempotency_keys"
        " WHERE idempotency_key = 'wf-expired'",
    ) == [("processing", 1, None)]
    assert query(
        stack.database_url, "SELECT count(*) FROM outbox WHERE idempotency_key = 'wf-expired'"
    ) == [(0,)]

    again = claim(stack, "wf-expired", payload={"lead": 1}, lease_seconds=1).json()
    assert (again["reclaimed"], again["uncertain"], again["attempt"]) == (True, True, 2)

    query(
        stack.database_url,
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 second',"
        " in_flight_until = NULL"
        " WHERE idempotency_key = 'wf-expired'",
    )
    with stack.client() as client:
        request = {"keys": ["wf-expired"], "statuses": ["processing"]}
        dry = client.post("/v1/replays", json={**request, "dry_run": True}, headers=AUTH).json()
        assert dry["to_replay"] == 1
        done = client.post(
            "/v1/replays",
            json={**request, "dry_run": False, "confirm": dry["confirm"]},
            headers=AUTH,
        )
        assert done.status_code == 200, done.text
    assert query(
        stack.database_url,
        "SELECT status, uncertain FROM idempotency_keys WHERE idempotency_key = 'wf-expired'",
    ) == [("pending", True)]
    assert query(
        stack.database_url, "SELECT count(*) FROM outbox WHERE idempotency_key = 'wf-expired'"
    ) == [(0,)]
    third = claim(stack, "wf-expired", payload={"lead": 1}).json()
    assert third["status"] == "claimed" and third["uncertain"] is True


def test_the_worker_refuses_a_workflow_key_delivered_to_it(stack: Stack) -> None:
    """A delivery of a claims key that reaches the worker anyway (a stray message) is blocked:
    the key stays with its workflow and nothing is acted on."""
    assert claim(stack, "wf-stray", payload={"x": 1}, lease_seconds=1).status_code == 201
    query(
        stack.database_url,
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 second',"
        " in_flight_until = NULL;"
        " INSERT INTO outbox (idempotency_key, task_name, correlation_id)"
        " VALUES ('wf-stray', 'idem.process', 'c')",
    )
    wait_until(
        lambda: (
            query(stack.database_url, "SELECT blocked_deliveries FROM idempotency_keys") == [(1,)]
        )
    )
    assert query(stack.database_url, "SELECT status, attempts FROM idempotency_keys") == [
        ("processing", 1)
    ]


# --- 2. an effect that happened ends the key ----------------------------------------------------


@pytest.mark.parametrize("kind", ["object", "nul", "huge"])
def test_a_result_that_cannot_be_stored_still_ends_the_key_succeeded(
    stack: Stack, downstream: Downstream, kind: str
) -> None:
    """A python action that acted and returned a value that is not JSON, holds NULs and
    infinities, or is 200 KB ends succeeded with what could be kept and a note: one effect."""
    key = _post(stack, f"odd-{kind}", "odd.result", url=f"{downstream.url}/tasks", kind=kind)
    state = finished(stack, key)
    assert state["status"] == "succeeded", state
    assert downstream.effects[key] == 1
    result = state["result"]
    if kind == "nul":
        assert result["value"] == {"note": "a\ufffdb", "ratio": None} and result["result_note"]
    else:
        assert "result_dropped" in result


@pytest.mark.parametrize("odd", ["\u0000", "\ud800"], ids=["nul", "lone-surrogate"])
def test_a_response_body_postgresql_cannot_hold_is_stored_once(
    stack: Stack, downstream: Downstream, odd: str
) -> None:
    """An http downstream whose answer holds U+0000 or the escape of a lone UTF-16 surrogate
    (valid JSON; jsonb refuses the first, and the second has no UTF-8 form): succeeded, one
    effect, the body kept with the character replaced."""
    downstream.behaviour = lambda key, n: Reply(201, extra={"note": f"x{odd}y"})
    key = _post(stack, f"odd-body-{ord(odd)}", "plain.lead", email="a@b.c")
    state = finished(stack, key)
    assert state["status"] == "succeeded", state
    assert downstream.effects[key] == 1
    assert state["result"]["value"]["body"]["note"] == "x\ufffdy"


# --- 3. uncertainty is a fact on the key ---------------------------------------------------------


def test_uncertainty_survives_a_lookup_that_fails(stack: Stack, downstream: Downstream) -> None:
    """The CRM creates the task but its answer is lost; the next attempt's lookup answers 503;
    the attempt after that still looks first (and finds the task): one effect, one POST."""
    downstream.behaviour = lambda key, n: Reply(201, delay=1.6) if n == 1 else Reply(201)
    downstream.lookup_failure = lambda key, n: 503 if n == 1 else None
    key = _post(stack, "lost-then-lookup-503", "crm.lead.created", email="a@b.c")
    state = finished(stack, key)
    assert state["status"] == "succeeded", state
    assert downstream.effects[key] == 1
    assert len(downstream.request_times(key)) == 1
    assert downstream.lookups.count(key) == 2
    assert state["external_ref"] == downstream.refs[key] and state["uncertain"] is False


def test_a_503_after_a_lost_answer_keeps_the_key_uncertain(
    stack: Stack, downstream: Downstream
) -> None:
    """The effect's answer is lost, then the CRM refuses with 503 + Retry-After (no effect):
    the key stays uncertain through the refusal, and the next attempt looks first."""
    downstream.behaviour = lambda key, n: (
        Reply(201, delay=1.6) if n == 1 else Reply(503, headers={"Retry-After": "1"})
    )
    downstream.lookup_failure = lambda key, n: 503 if n == 1 else None
    key = _post(stack, "lost-then-refused", "crm.lead.created", email="a@b.c")
    state = finished(stack, key)
    assert state["status"] == "succeeded", state
    assert downstream.effects[key] == 1


# --- 4. crash loops and hung actions are bounded -------------------------------------------------


def test_an_action_that_kills_its_worker_every_time_ends_in_a_dead_letter(
    private_stack: Stack, downstream: Downstream
) -> None:
    """An action that kills its process after acting: each claim counts an attempt, and the
    claim past the budget (max_attempts 2) dead-letters the key as a crash loop: 2 effects."""
    stack = private_stack
    # Process isolation: under the threads pool the action would take the whole worker down.
    stack.extra_env["WORKER_POOL"] = "prefork"
    stack.start_all()
    stack.start_sweeper()
    key = _post(stack, "crasher", "odd.crash", url=f"{downstream.url}/tasks")
    state = finished(stack, key, timeout=90)
    assert state["status"] == "failed_final"
    assert state["error_code"] == "crash_loop" and state["attempts"] == 3
    assert downstream.effects[key] == 2
    assert query(stack.database_url, "SELECT kind, error_code FROM dead_letters") == [
        ("retries_exhausted", "crash_loop")
    ]


def test_a_hung_action_is_cut_at_its_time_limit(stack: Stack, downstream: Downstream) -> None:
    """An action that never returns is given up at its route's timeout_seconds: the attempt is
    recorded as an uncertain action_timeout, retried within the budget, then dead-lettered."""
    key = _post(stack, "hanger", "odd.hang", url=f"{downstream.url}/tasks")
    state = finished(stack, key)
    assert state["status"] == "failed_final"
    assert (state["error_code"], state["attempts"], state["uncertain"]) == (
        "action_timeout",
        2,
        True,
    )
    assert downstream.effects[key] == 2
    assert query(stack.database_url, "SELECT kind FROM dead_letters") == [("retries_exhausted",)]


# --- 5. only the holder writes, only the token holder calls -------------------------------------


def test_a_worker_key_cannot_be_taken_or_finished_through_the_claims_api(
    stack: Stack,
) -> None:
    """While the worker acts on an event's key, a claim of it answers not_a_claim_key and a
    complete with the worker's owner string (with or without the fence) is lease_lost; the
    worker's own result lands."""
    key = _post(stack, "held-by-worker", "slow.job", seconds=3)
    wait_until(lambda: key_state(stack, key)["status"] == "processing")
    owner, fence = query(stack.database_url, "SELECT lease_owner, fence FROM idempotency_keys")[0]
    taken = claim(stack, key)
    assert taken.status_code == 409 and taken.json()["error"] == "not_a_claim_key"
    for token in (owner, f"{fence}.{owner}"):
        forged = claim_call(stack, key, "complete", {"lease_token": token, "result": {"forged": 1}})
        assert forged.status_code == 409 and forged.json()["status"] == "lease_lost"
    state = finished(stack, key)
    assert state["status"] == "succeeded" and state["result"] == {"cancelled": False}


def test_the_claims_api_and_event_reads_need_the_token(stack: Stack) -> None:
    """With CLAIMS_TOKEN set, a claim or an event read without it or with another token is
    401 and changes nothing; with it, it is served."""
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": CLAIMS_TOKEN}):
        with httpx.Client(base_url=stack.url, timeout=10, headers=headers) as client:
            refused = client.post("/v1/claims", json={"key": "guarded"})
            assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
            read = client.get("/v1/events/anything")
            assert read.status_code == 401
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]
    assert claim(stack, "guarded").status_code == 201
    with httpx.Client(base_url=stack.url, timeout=10, headers=AUTH) as operator:
        assert operator.get("/v1/events/guarded").status_code == 200


# --- 6. leases give up before they end ----------------------------------------------------------


def test_the_worker_gives_its_lease_up_before_the_database_lease_ends(
    own_database: str,
) -> None:
    """With the database cut off mid-lease, the keeper gives the attempt up while the lease
    is still live by the database's own clock: a late write could not race a new holder."""
    proxy, url = proxied_database(own_database)
    engine = create_sync_engine(
        Settings(database_url=url, redis_url="redis://x", db_timeout_seconds=1),
        autocommit=True,
        pre_ping=False,
    )
    store = KeyStore(engine)
    key = seed_pending_key(own_database, "cut-off")
    try:
        claim = store.claim(key, "w1", 6)
        assert isinstance(claim, Claim)
        cancelled, wake = threading.Event(), threading.Event()
        with Heartbeat(store, claim, 6, cancelled, wake):
            proxy.cut()
            assert wake.wait(30)
            still_live = query(
                own_database,
                "SELECT locked_until > clock_timestamp() FROM idempotency_keys",
            )
        assert cancelled.is_set() and still_live == [(True,)]
    finally:
        engine.dispose()
        proxy.stop()


def test_worker_and_relay_statements_have_a_timeout(database_url: str) -> None:
    """Every engine of a worker or relay bounds its statements (DB_TIMEOUT_SECONDS)."""
    engine = create_sync_engine(
        Settings(database_url=database_url, redis_url="redis://x", db_timeout_seconds=2),
        autocommit=True,
    )
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == "2s"
    finally:
        engine.dispose()


# --- 10. the claims path keeps the lost-answer story --------------------------------------------


def test_a_failed_claim_makes_the_next_claim_look_first(stack: Stack) -> None:
    """After /fail without `effect` (the CRM's answer was lost), the next claim answers
    uncertain: true although the lease was not reclaimed; after effect "none" it does not,
    and a completed key is no longer uncertain."""
    first = claim(stack, "lost-answer", payload={"lead": 1}).json()
    failed = claim_call(
        stack,
        "lost-answer",
        "fail",
        {"lease_token": first["lease_token"], "error_code": "socket_hang_up", "retryable": True},
    )
    assert failed.status_code == 200
    second = claim(stack, "lost-answer", payload={"lead": 1}).json()
    assert (second["reclaimed"], second["uncertain"]) == (False, True)
    claim_call(
        stack,
        "lost-answer",
        "complete",
        {"lease_token": second["lease_token"], "result": {"task": "found"}},
    )
    assert key_state(stack, "lost-answer")["uncertain"] is False

    clean = claim(stack, "refused", payload={"lead": 2}).json()
    claim_call(
        stack,
        "refused",
        "fail",
        {
            "lease_token": clean["lease_token"],
            "error_code": "http_429",
            "retryable": True,
            "effect": "none",
        },
    )
    assert claim(stack, "refused", payload={"lead": 2}).json()["uncertain"] is False
