"""Many attempts in flight per worker process (the threads pool): every guarantee holds with 32
attempts waiting on a slow downstream at once, counted at the downstream."""

from __future__ import annotations

import json
import signal
import threading
from typing import Any

import pytest

from tests.support import Downstream, Reply, Stack, envelope, query, wait_until

IN_FLIGHT = 32


def _post_many(stack: Stack, prefix: str, count: int) -> list[str]:
    with stack.client() as client:
        answers = [
            client.post("/v1/events", json=envelope(f"{prefix}-{n}", "wait.job"))
            for n in range(count)
        ]
    assert all(a.status_code == 202 for a in answers)
    return [a.json()["key"] for a in answers]


def _json(line: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _statuses(stack: Stack) -> dict[str, str]:
    return dict(query(stack.database_url, "SELECT idempotency_key, status FROM idempotency_keys"))


@pytest.mark.brokers(slow=("rabbitmq",))
def test_a_worker_killed_with_32_attempts_in_flight_loses_and_doubles_nothing(
    private_stack: Stack, downstream: Downstream
) -> None:
    """SIGKILL a threads-pool worker while 32 http attempts wait on the downstream (each effect
    already made): a new worker and the sweeper finish every key, each with one effect and one
    POST (the reclaim looks the effect up first)."""
    stack = private_stack
    # Every effect is made, and no answer leaves the downstream until the worker is dead.
    answers = threading.Event()
    downstream.behaviour = lambda key, n: Reply(201, hold=answers)
    stack.start_all()
    stack.start_sweeper()
    keys = _post_many(stack, "killed", IN_FLIGHT)
    wait_until(lambda: len(downstream.requests) == IN_FLIGHT, timeout=30)
    stack.stop("worker", signal.SIGKILL)
    answers.set()
    assert "processing" in _statuses(stack).values()
    stack.start_worker("worker-2")
    wait_until(lambda: set(_statuses(stack).values()) == {"succeeded"}, timeout=90)
    assert {downstream.effects[k] for k in keys} == {1}
    assert all(len(downstream.request_times(k)) == 1 for k in keys)
    # Every key was taken again after the kill (by a reclaim of its dead lease, or, on a
    # loaded machine, a retry after the dead worker had already given the lease up) and
    # the second attempt found the effect instead of making it again.
    rows = query(
        stack.database_url,
        "SELECT attempts >= 2, result->>'reconciled' FROM idempotency_keys"
        " WHERE idempotency_key = ANY(%s)",
        (keys,),
    )
    assert rows == [(True, "true")] * IN_FLIGHT, rows


def test_two_worker_processes_racing_over_the_same_keys_act_once_each(
    private_stack: Stack, downstream: Downstream
) -> None:
    """Two threads-pool workers get every key's message twice (a duplicated delivery per
    key): one effect per key, the extra deliveries blocked."""
    stack = private_stack
    downstream.behaviour = lambda key, n: Reply(201, delay=0.3)
    stack.start_receiver()
    stack.start_relay()
    stack.start_worker("worker-a")
    stack.start_worker("worker-b")
    keys = _post_many(stack, "raced", 40)
    # One key per statement: its foreign-key check then locks one key, which cannot deadlock
    # with the workers updating the same keys (a multi-row INSERT ... SELECT locked them in
    # whatever order it read them, against the workers' key order, and died as a deadlock's
    # victim in its own set-up).
    for key in keys:
        query(
            stack.database_url,
            "INSERT INTO outbox (idempotency_key, task_name, correlation_id)"
            " SELECT idempotency_key, 'idem.process', correlation_id FROM idempotency_keys"
            " WHERE idempotency_key = %s",
            (key,),
        )
    wait_until(lambda: set(_statuses(stack).values()) == {"succeeded"}, timeout=60)
    wait_until(
        lambda: (
            query(stack.database_url, "SELECT sum(blocked_deliveries) FROM idempotency_keys")
            == [(40,)]
        ),
        timeout=30,
    )
    assert {downstream.effects[k] for k in keys} == {1}
    assert len(downstream.requests) == 40


def test_a_lost_lease_among_32_attempts_cancels_only_its_own(
    private_stack: Stack, downstream: Downstream
) -> None:
    """While 32 attempts run in one process, another holder takes one key over: that attempt
    records nothing (lease_lost), the other 31 succeed."""
    stack = private_stack
    # No answer leaves the downstream until the key is taken over: all 32 are in flight then.
    answers = threading.Event()
    downstream.behaviour = lambda key, n: Reply(201, hold=answers)
    stack.extra_env["LEASE_SECONDS"] = "6"
    stack.start_all()
    keys = _post_many(stack, "one-lost", IN_FLIGHT)
    wait_until(lambda: len(downstream.requests) == IN_FLIGHT, timeout=30)
    taken = keys[7]
    query(
        stack.database_url,
        "UPDATE idempotency_keys SET fence = fence + 1, lease_token = 'someone-else',"
        " lease_owner = 'someone-else', locked_until = now() + interval '1 minute'"
        " WHERE idempotency_key = %s",
        (taken,),
    )
    answers.set()
    wait_until(lambda: list(_statuses(stack).values()).count("succeeded") == IN_FLIGHT - 1)
    wait_until(lambda: '"lease_lost"' in stack.logs("worker"), timeout=20)
    assert _statuses(stack)[taken] == "processing"
    assert query(
        stack.database_url,
        "SELECT lease_owner, result FROM idempotency_keys WHERE idempotency_key = %s",
        (taken,),
    ) == [("someone-else", None)]
    finished = [
        line
        for line in map(_json, stack.logs("worker").splitlines())
        if line.get("event") == "attempt.finished"
    ]
    assert [line["outcome"] for line in finished].count("lease_lost") == 1


def test_a_worker_whose_pools_cannot_fit_refuses_to_start(private_stack: Stack) -> None:
    """40 prefork children of 5 connections each cannot fit under max_connections: the worker
    exits 2 naming the values, before it consumes anything."""
    stack = private_stack
    stack.extra_env.update(WORKER_POOL="prefork", WORKER_CONCURRENCY="40")
    process = stack._spawn("worker", ["-m", "worker"])
    assert process.wait(timeout=60) == 2
    message = stack.logs("worker")
    assert "needs up to 200 database connections" in message
    assert "max_connections=" in message and "WORKER_DB_POOL_SIZE=4" in message
