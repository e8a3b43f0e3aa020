"""The sweeper re-sends lost messages without flooding a queue that is merely slow."""

from __future__ import annotations

import time

from tests.support import Stack, envelope, query, wait_until


def test_a_slow_queue_gets_few_copies_not_one_per_pass(private_stack: Stack) -> None:
    """With messages waiting and no worker for 5 s (grace 1 s, a pass every 0.25 s), each key
    is re-sent at 1, 3, 7 s … (doubling), so it has at most three rows, not twenty."""
    stack = private_stack
    # The stack's timing halved: the same twenty passes and three rows in half the time.
    stack.extra_env.update(SWEEP_GRACE_SECONDS="1", SWEEP_INTERVAL_SECONDS="0.25")
    stack.start_receiver()
    stack.start_relay()
    stack.start_sweeper()
    with stack.client() as client:
        for i in range(20):
            assert client.post("/v1/events", json=envelope(f"slow-{i}")).status_code == 202
    wait_until(
        lambda: (
            query(stack.database_url, "SELECT count(*) FROM outbox WHERE published_at IS NULL")
            == [(0,)]
        )
    )
    time.sleep(5)  # the time a busy queue keeps messages waiting; what is measured is rows
    per_key = query(
        stack.database_url,
        "SELECT max(n), min(n) FROM (SELECT count(*) AS n FROM outbox "
        "GROUP BY idempotency_key) rows",
    )
    assert per_key[0][0] <= 3, per_key
    assert per_key[0][1] >= 2, "a key waiting past the grace period is re-sent at least once"
    stack.start_worker(concurrency=2)
    wait_until(
        lambda: (
            query(
                stack.database_url,
                "SELECT count(*) FROM idempotency_keys WHERE status = 'succeeded'",
            )
            == [(20,)]
        ),
        timeout=60,
    )
