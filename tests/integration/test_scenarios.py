"""The six scenarios every idempotency layer must survive, on real processes.

Each asserts the number of side effects at the fake downstream, the final status and the
attempts. Servers a test stops or kills are ones it started itself.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.support import Downstream, Reply, Stack, envelope, query, wait_until


def _state(stack: Stack, key: str) -> dict[str, Any]:
    with stack.client() as client:
        body: dict[str, Any] = client.get(f"/v1/events/{key}").json()
    return body


def _finished(stack: Stack, key: str) -> dict[str, Any] | None:
    state = _state(stack, key)
    return state if state["status"] in ("succeeded", "failed_final") else None


def _post(stack: Stack, body: dict[str, Any]) -> str:
    with stack.client() as client:
        answer = client.post("/v1/events", json=body)
    assert answer.status_code in (200, 202), answer.text
    key: str = answer.json()["key"]
    return key


def test_1_same_payload_twice_in_sequence(stack: Stack, downstream: Downstream) -> None:
    """The second delivery of a finished event is answered from the store: one effect."""
    key = _post(stack, envelope("s1"))
    first = wait_until(lambda: _finished(stack, key))
    with stack.client() as client:
        again = client.post("/v1/events", json=envelope("s1"))
    assert again.status_code == 200 and again.json()["duplicate"] is True
    assert again.json()["external_ref"] == first["external_ref"]
    assert first["status"] == "succeeded" and first["attempts"] == 1
    assert downstream.effects == {key: 1}
    assert len(downstream.requests) == 1


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@pytest.mark.brokers
def test_2_two_workers_racing_for_one_key(private_stack: Stack, downstream: Downstream) -> None:
    """Two deliveries of one key reach two workers at once: one claims and acts, the other is
    refused by the claim; one effect. Both workers, on one host, are still running at the end
    (on RabbitMQ a second worker of the same node name used to stop at once)."""
    stack = private_stack
    stack.start_receiver()
    stack.start_worker("worker-a", concurrency=1)
    stack.start_worker("worker-b", concurrency=1)
    # Slow enough that both deliveries are in flight together, within the 1 s read timeout.
    downstream.behaviour = lambda key, n: Reply(201, delay=0.7)
    key = _post(stack, envelope("s2"))
    # A second outbox row for the same key: the broker will carry two messages.
    query(
        stack.database_url,
        "INSERT INTO outbox (idempotency_key, task_name, correlation_id)"
        " SELECT idempotency_key, task_name, correlation_id FROM outbox",
    )
    stack.start_relay()
    wait_until(lambda: _finished(stack, key), timeout=30)
    wait_until(
        lambda: (
            query(stack.database_url, "SELECT blocked_deliveries FROM idempotency_keys") == [(1,)]
        ),
        timeout=30,
    )
    state = _state(stack, key)
    assert state["status"] == "succeeded" and state["attempts"] == 1
    assert downstream.effects == {key: 1}
    assert len(downstream.requests) == 1
    both = stack.logs("worker-a") + stack.logs("worker-b")
    assert both.count('"delivery.blocked"') == 1
    assert [stack.processes[name].poll() for name in ("worker-a", "worker-b")] == [None, None]


@pytest.mark.brokers(slow=("rabbitmq",))
@pytest.mark.parametrize(
    "lost_answer",
    [Reply(201, delay=2.5), Reply(201, commit=True, drop=True)],
    ids=["answer-after-client-timeout", "connection-dropped-after-write"],
)
def test_3_timeout_after_the_downstream_wrote_is_reconciled(
    stack: Stack, downstream: Downstream, lost_answer: Reply
) -> None:
    """The downstream commits but the answer is lost; the retry asks first, finds the effect and
    records it without a second call."""
    downstream.behaviour = lambda key, n: lost_answer if n == 1 else Reply()
    key = _post(stack, envelope("s3"))
    state = wait_until(lambda: _finished(stack, key), timeout=30)
    assert state["status"] == "succeeded"
    assert state["attempts"] == 2
    assert state["external_ref"] == downstream.refs[key]
    assert state["result"]["reconciled"] is True
    assert downstream.effects == {key: 1}
    assert len(downstream.requests) == 1
    assert downstream.lookups == [key]


@pytest.mark.brokers(slow=("rabbitmq",))
def test_4_failure_before_the_write_retries_after_retry_after(
    stack: Stack, downstream: Downstream
) -> None:
    """A 503 with Retry-After: 1 is retried no sooner than 1 s later (the route's backoff
    alone would come back within 0.2 s); one effect. Retry-After stays within the route's
    backoff cap, so the route's circuit is not opened by it."""
    downstream.behaviour = lambda key, n: Reply(503, {"Retry-After": "1"}) if n == 1 else Reply()
    key = _post(stack, envelope("s4", event_type="plain.lead"))
    state = wait_until(lambda: _finished(stack, key), timeout=30)
    assert state["status"] == "succeeded" and state["attempts"] == 2
    first, second = downstream.request_times(key)
    assert second - first >= 1.0
    assert downstream.effects == {key: 1}
    retries = query(
        stack.database_url, "SELECT count(*) FROM outbox WHERE available_at > created_at"
    )
    assert retries == [(1,)], "the retry waited in the outbox"


@pytest.mark.brokers
def test_5_worker_killed_mid_action_is_reclaimed_and_reconciled(
    private_stack: Stack, downstream: Downstream
) -> None:
    """A worker SIGKILLed after the downstream wrote but before it recorded: the lease expires,
    the sweeper re-drives the key, the new holder reconciles and finishes; one effect."""
    stack = private_stack
    stack.start_all()
    stack.start_sweeper()
    # The first call commits, then hangs until the worker is gone.
    downstream.behaviour = lambda key, n: Reply(201, delay=30) if n == 1 else Reply()
    key = _post(stack, envelope("s5"))
    wait_until(lambda: downstream.effects.get(key) == 1, timeout=30)
    worker = stack.processes["worker"]
    for pid in [*_children(worker.pid), worker.pid]:
        os.kill(pid, signal.SIGKILL)
    worker.wait(timeout=10)
    assert _state(stack, key)["status"] == "processing"
    stack.start_worker("worker-2", concurrency=1)
    state = wait_until(lambda: _finished(stack, key), timeout=60)
    assert state["status"] == "succeeded"
    assert state["attempts"] == 2
    assert state["external_ref"] == downstream.refs[key]
    assert downstream.effects == {key: 1}
    assert len(downstream.requests) == 1
    assert query(stack.database_url, "SELECT reclaimed_count FROM idempotency_keys") == [(1,)]
    assert "sweeper.redrove" in stack.logs("sweeper")


def test_6_same_key_different_payload_is_refused(stack: Stack, downstream: Downstream) -> None:
    """A reused key with another payload is refused with 422; the stored event, its status and
    its attempts stay as they were."""
    key = _post(stack, envelope("s6"))
    before = wait_until(lambda: _finished(stack, key))
    changed = envelope("s6")
    changed["payload"]["email"] = "someone-else@example.com"
    with stack.client() as client:
        answer = client.post("/v1/events", json=changed)
    assert answer.status_code == 422
    assert answer.json()["error"] == "idempotency_key_reused"
    after = _state(stack, key)
    assert (after["status"], after["attempts"], after["external_ref"]) == (
        before["status"],
        before["attempts"],
        before["external_ref"],
    )
    assert query(stack.database_url, "SELECT payload->>'email' FROM events") == [
        ("s6@example.com",)
    ]
    assert downstream.effects == {key: 1}
