"""Lease renewal on real processes: a long action keeps its key; a lost lease cancels it."""

from __future__ import annotations

from tests.support import Downstream, Stack, query, wait_until


def _post_slow(stack: Stack, seconds: float) -> str:
    with stack.client() as client:
        answer = client.post(
            "/v1/events",
            json={
                "source": "test",
                "event_type": "slow.job",
                "external_id": f"slow-{seconds}",
                "payload": {"seconds": seconds},
            },
        )
    key: str = answer.json()["key"]
    return key


def test_an_action_longer_than_the_lease_keeps_it_by_heartbeat(
    private_stack: Stack, downstream: Downstream
) -> None:
    """An action running 7 s under a 5 s lease is renewed every third of the lease: with the
    sweeper running, nobody reclaims it and it succeeds on the first attempt."""
    stack = private_stack
    stack.start_all()
    stack.start_sweeper()
    key = _post_slow(stack, 7)
    wait_until(
        lambda: (
            query(stack.database_url, "SELECT status FROM idempotency_keys") == [("succeeded",)]
        ),
        timeout=40,
    )
    row = query(
        stack.database_url,
        "SELECT attempts, reclaimed_count, result->>'cancelled', fence "
        "FROM idempotency_keys WHERE idempotency_key = %s",
        (key,),
    )
    assert row == [(1, 0, "false", 1)]


def test_a_lost_lease_cancels_the_action_and_its_late_write_is_fenced_out(
    private_stack: Stack,
) -> None:
    """When another holder takes the key (a newer fence), the heartbeat finds the lease lost,
    the action's cancel flag is set, and its late success is rejected and logged lease_lost."""
    stack = private_stack
    stack.start_all()
    key = _post_slow(stack, 6)
    wait_until(
        lambda: (
            query(stack.database_url, "SELECT status FROM idempotency_keys") == [("processing",)]
        ),
        timeout=20,
    )
    # Another holder takes over: what a reclaim after an expiry does to the row.
    query(
        stack.database_url,
        "UPDATE idempotency_keys SET fence = fence + 1, lease_owner = 'someone-else', "
        "locked_until = now() + interval '1 minute' WHERE idempotency_key = %s",
        (key,),
    )
    wait_until(lambda: '"lease_lost"' in stack.logs("worker"), timeout=20)
    logs = stack.logs("worker")
    assert '"lease.lost"' in logs
    assert query(
        stack.database_url, "SELECT status, lease_owner, result FROM idempotency_keys"
    ) == [("processing", "someone-else", None)]
