"""A backlog's keys packed into shared messages (`RELAY_KEYS_PER_MESSAGE`), on real relay and
worker processes, counted at the fake downstream: each key still gets its own attempt, its own
outcome and one effect, through a flaky downstream (a 503, a lost answer, a refusal) and through
a worker killed with a packed message in flight; a threads worker's attempts in flight stay
within its concurrency, a key that hangs holds only its own slot, and a prefork worker runs a
packed message's keys in turn."""

from __future__ import annotations

import json
import signal

from tests.support import Downstream, Reply, Stack, all_in, query, seed_pending_key, wait_until

# What the seeded keys' route allows (tests/support.py write_routes: crm).
PACK = 8


def _backlog(stack: Stack, count: int, prefix: str) -> list[str]:
    """`count` pending keys with their events, and their outbox rows committed at once: the
    relay's next pass takes them all, as after an outage or a burst."""
    keys = [seed_pending_key(stack.database_url, f"{prefix}-{n:02d}") for n in range(count)]
    query(
        stack.database_url,
        "INSERT INTO outbox (idempotency_key, task_name, correlation_id)"
        " SELECT idempotency_key, 'idem.process', correlation_id FROM idempotency_keys"
        " WHERE idempotency_key = ANY(%(keys)s)",
        {"keys": keys},
    )
    return keys


def _statuses(stack: Stack, keys: list[str]) -> dict[str, str]:
    rows = query(
        stack.database_url,
        "SELECT idempotency_key, status FROM idempotency_keys WHERE idempotency_key = ANY(%s)",
        (keys,),
    )
    return dict(rows)


def _final(stack: Stack, keys: list[str]) -> bool:
    return all_in(stack.database_url, keys, "succeeded", "failed_final")


def _messages(stack: Stack) -> list[int]:
    """How many keys each message the worker claimed from carried (its task id names its
    outbox rows: `outbox-<id>+<id>…`)."""
    ids = set()
    for line in stack.logs("worker").splitlines():
        if line.startswith("{") and '"attempt.claimed"' in line:
            ids.add(json.loads(line)["task_id"])
    return sorted((len(task_id.split("+")) for task_id in ids), reverse=True)


def test_packed_keys_each_make_one_effect_through_a_flaky_downstream(
    private_stack: Stack, downstream: Downstream
) -> None:
    """48 keys due at once travel in messages of 8; of each six, one is answered 503 once
    (a retry), one loses its answer past the read timeout (reconciled, not repeated), one is
    refused for good (a dead letter, no effect) and three succeed: every key ends as alone.
    (A third of the calls fail transiently, under the breaker's rate: the circuit stays
    closed and the test short.)"""
    stack = private_stack
    stack.extra_env["RELAY_KEYS_PER_MESSAGE"] = str(PACK)
    keys = _backlog(stack, 48, "packed")
    kinds = {key: n % 6 for n, key in enumerate(keys)}

    def behaviour(key: str, number: int) -> Reply:
        kind = kinds.get(key, 5)
        if kind == 0 and number == 1:
            return Reply(503)
        if kind == 1 and number == 1:
            return Reply(201, delay=1.6)  # committed; the answer comes after the 1 s timeout
        if kind == 2:
            return Reply(409)
        return Reply(201)

    downstream.behaviour = behaviour
    stack.start_worker()
    stack.start_relay()

    wait_until(lambda: _final(stack, keys), timeout=60)

    statuses = _statuses(stack, keys)
    assert {key for key, s in statuses.items() if s == "failed_final"} == {
        key for key, kind in kinds.items() if kind == 2
    }
    with downstream.lock:
        effects = {key: downstream.effects[key] for key in keys}
        posts = {key: sum(1 for r in downstream.requests if r["key"] == key) for key in keys}
        looked_up = set(downstream.lookups)
    assert effects == {key: 0 if kind == 2 else 1 for key, kind in kinds.items()}
    # The 503 was sent again; the lost answer was looked up, never sent twice.
    assert {key for key, n in posts.items() if n == 2} == {k for k, v in kinds.items() if v == 0}
    assert {k for k, v in kinds.items() if v == 1} <= looked_up
    # The first pass took all 48: six messages of eight (retries may travel in smaller ones).
    assert _messages(stack)[:6] == [PACK] * 6


def test_a_worker_killed_with_a_packed_message_in_flight_makes_no_second_effect(
    private_stack: Stack, downstream: Downstream
) -> None:
    """A worker is SIGKILLed while the eight keys of one message are at the downstream (each
    effect committed, no answer yet). Once their leases end, the sweeper re-drives them and a
    new worker looks each one up: eight keys, eight effects, all succeeded."""
    stack = private_stack
    stack.extra_env["RELAY_KEYS_PER_MESSAGE"] = str(PACK)
    keys = _backlog(stack, PACK, "killed")

    def behaviour(key: str, number: int) -> Reply:
        # Committed at once; the answer comes after the test has killed the worker.
        return Reply(201, delay=0.9 if number == 1 else 0.0)

    downstream.behaviour = behaviour
    stack.start_worker()
    stack.start_relay()
    stack.start_sweeper()
    wait_until(lambda: sum(downstream.effects[key] for key in keys) == PACK, interval=0.02)
    stack.stop("worker", signal.SIGKILL)
    assert set(_statuses(stack, keys).values()) == {"processing"}

    stack.start_worker("worker-2")
    wait_until(lambda: set(_statuses(stack, keys).values()) == {"succeeded"}, timeout=60)

    with downstream.lock:
        assert {key: downstream.effects[key] for key in keys} == dict.fromkeys(keys, 1)
        assert set(downstream.lookups) >= set(keys)
    assert _messages(stack) == [PACK]


def _run_slow_backlog(
    stack: Stack, downstream: Downstream, count: int, prefix: str, concurrency: int
) -> tuple[list[str], int]:
    """`count` keys due at once, packed, answered after 0.1 s each by a worker of
    `concurrency`; returns the keys once all succeeded, and the most requests at once."""
    stack.extra_env["RELAY_KEYS_PER_MESSAGE"] = str(PACK)
    keys = _backlog(stack, count, prefix)
    downstream.behaviour = lambda key, number: Reply(201, delay=0.1)
    stack.start_worker(concurrency=concurrency)
    stack.start_relay()
    wait_until(lambda: set(_statuses(stack, keys).values()) == {"succeeded"}, timeout=60)
    with downstream.lock:
        assert {key: downstream.effects[key] for key in keys} == dict.fromkeys(keys, 1)
        return keys, downstream.peak_in_flight


def test_a_prefork_worker_runs_a_packed_message_one_key_at_a_time_in_order(
    private_stack: Stack, downstream: Downstream
) -> None:
    """The prefork pool promises one attempt at a time per process: a packed message of six
    unrelated keys runs them one after another in its order, each claimed at its turn, one
    request at the downstream at a time; each key one effect."""
    private_stack.extra_env["WORKER_POOL"] = "prefork"

    keys, peak = _run_slow_backlog(private_stack, downstream, 6, "prefork", concurrency=1)

    assert [r["key"] for r in downstream.requests] == keys
    assert peak == 1
    assert _messages(private_stack) == [6]


def test_a_threads_worker_keeps_its_attempts_in_flight_within_its_concurrency(
    private_stack: Stack, downstream: Downstream
) -> None:
    """Sixteen keys due at once travel in two messages of eight to a worker of concurrency 4:
    at most four requests reach the downstream at once (a message waits for free slots before
    it claims, and one of more keys than slots runs in parts), each key one effect."""
    _, peak = _run_slow_backlog(private_stack, downstream, 16, "slots", concurrency=4)

    assert peak == 4
    assert _messages(private_stack) == [PACK, PACK]


def _seed_slow_key(stack: Stack, name: str, seconds: float) -> str:
    """A pending key of the `slow` route (a python action that works `seconds`), no outbox."""
    key = f"webform:slow.job:{name}"
    query(
        stack.database_url,
        "INSERT INTO idempotency_keys (idempotency_key, payload_hash, correlation_id, source,"
        " event_type, route, expires_at)"
        " VALUES (%s, 'h', %s, 'webform', 'slow.job', 'slow', now() + interval '1 day')",
        (key, f"corr-{name}"),
    )
    query(
        stack.database_url,
        "INSERT INTO events (idempotency_key, source, event_type, external_id, payload)"
        " VALUES (%s, 'webform', 'slow.job', %s, %s)",
        (key, name, json.dumps({"seconds": seconds})),
    )
    return key


def test_a_key_that_hangs_holds_only_its_own_slot(
    private_stack: Stack, downstream: Downstream
) -> None:
    """A message of four keys (one works 6 s, three answer at once) on a worker of
    concurrency 4: the three give their slots back as they end, so a later message of two
    keys runs while the slow one still works, instead of waiting for its whole message."""
    stack = private_stack
    stack.extra_env["RELAY_KEYS_PER_MESSAGE"] = "4"
    slow = _seed_slow_key(stack, "hangs", 6.0)
    first = [seed_pending_key(stack.database_url, f"mate-{n}") for n in range(3)]
    query(
        stack.database_url,
        "INSERT INTO outbox (idempotency_key, task_name, correlation_id)"
        " SELECT idempotency_key, 'idem.process', correlation_id FROM idempotency_keys"
        " WHERE idempotency_key = ANY(%(keys)s) ORDER BY idempotency_key = %(slow)s DESC",
        {"keys": [slow, *first], "slow": slow},
    )
    stack.start_worker(concurrency=4)
    stack.start_relay()
    wait_until(lambda: set(_statuses(stack, first).values()) == {"succeeded"}, timeout=30)

    later = _backlog(stack, 2, "later")
    wait_until(lambda: set(_statuses(stack, later).values()) == {"succeeded"}, timeout=30)

    assert _statuses(stack, [slow]) == {slow: "processing"}
    assert sorted(_messages(stack)) == [2, 4]
    with downstream.lock:
        assert {key: downstream.effects[key] for key in first + later} == dict.fromkeys(
            first + later, 1
        )
