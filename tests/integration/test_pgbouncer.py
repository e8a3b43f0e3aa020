"""The gateway through PgBouncer in transaction mode (DATABASE_POOL_MODE=transaction): the
receiver, the relay and the worker reach PostgreSQL through a PgBouncer of the test's own that
gives each transaction any of three server connections, the sweeper through
DATABASE_DIRECT_URL. Effects are counted at the fake downstream. Skipped, with the reason,
where no pgbouncer binary is installed (`make pgbouncer`). `TEST_POOLER=pgbouncer` runs every
stack of the suite through such a pool (tests/pooler.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.pooler import pgbouncer
from tests.support import (
    OPERATOR_TOKEN,
    Downstream,
    Reply,
    Stack,
    claim,
    claim_call,
    envelope,
    query,
    wait_until,
)


@dataclass
class Pooled:
    stack: Stack
    # The database itself: the test's own queries and the sweeper go around the pool.
    direct: str


@pytest.fixture
def pooled(private_stack: Stack) -> Iterator[Pooled]:
    """The private stack's processes set to reach its database through a PgBouncer in
    transaction mode that sets a 3 s statement timeout on each server connection."""
    stack = private_stack
    direct = stack.database_url
    with pgbouncer(direct, "SET statement_timeout = 3000") as bouncer:
        # The processes get DATABASE_URL from this field (Stack.env).
        stack.database_url = bouncer.url
        stack.extra_env.update(DATABASE_POOL_MODE="transaction")
        try:
            yield Pooled(stack, direct)
        finally:
            stack.stop_all()  # before the pool goes away under them
            stack.database_url = direct


def _lost(key: str) -> bool:
    """One key in five has its first answer lost (the same ones on every run)."""
    return zlib.crc32(key.encode()) % 5 == 0


def test_events_duplicates_lost_answers_and_claims_act_once_through_a_transaction_pool(
    pooled: Pooled, downstream: Downstream
) -> None:
    """60 events posted three times each from 12 threads (one in five of whose first answers
    is lost past the read timeout) and 10 workflow claims completed, all through three server
    connections: every key has exactly one effect, each lost answer was found by the lookup,
    the claims ended succeeded; the relay, without a direct URL, polls; no log has a prepared
    statement error or a traceback."""
    stack, direct = pooled.stack, pooled.direct
    downstream.behaviour = lambda key, n: Reply(delay=2.5) if n == 1 and _lost(key) else Reply()
    stack.start_receiver()
    stack.start_relay()
    stack.start_worker(concurrency=8)
    stack.extra_env["DATABASE_DIRECT_URL"] = direct
    stack.start_sweeper()

    keys: set[str] = set()
    refused: list[int] = []
    lock = threading.Lock()

    def send(numbers: range) -> None:
        with stack.client() as client:
            for number in numbers:
                for _ in range(3):
                    answer = client.post("/v1/events", json=envelope(f"pooled-{number}"))
                    with lock:
                        if answer.status_code in (200, 202):
                            keys.add(answer.json()["key"])
                        else:
                            refused.append(answer.status_code)

    threads = [threading.Thread(target=send, args=(range(i, 60, 12),)) for i in range(12)]
    for thread in threads:
        thread.start()
    for n in range(10):
        taken = claim(stack, f"pooled-claim-{n}", payload={"n": n})
        assert taken.status_code == 201, taken.text
        token = taken.json()["lease_token"]
        done = claim_call(stack, f"pooled-claim-{n}", "complete", {"lease_token": token})
        assert done.status_code == 200, done.text
    for thread in threads:
        thread.join(60)
    assert not refused and len(keys) == 60

    pending = "SELECT count(*) FROM idempotency_keys WHERE status <> 'succeeded'"
    wait_until(lambda: query(direct, pending) == [(0,)], timeout=60, interval=0.5)
    assert query(direct, "SELECT count(*) FROM idempotency_keys") == [(70,)]
    assert downstream.effects == dict.fromkeys(keys, 1)
    lost = {key for key in keys if _lost(key)}
    assert lost and lost <= set(downstream.lookups)
    # An operator's replay dry run reads in REPEATABLE READ through the pool too.
    with stack.client() as client:
        dry_run = client.post(
            "/v1/replays",
            json={"statuses": ["failed_final"]},
            headers={"Authorization": f"Bearer {OPERATOR_TOKEN}", "X-Operator": "ops"},
        )
    assert dry_run.status_code == 200, dry_run.text
    assert dry_run.json()["to_replay"] == 0
    logs = "".join(stack.logs(name) for name in ("receiver", "relay", "worker", "sweeper"))
    assert "prepared statement" not in logs and "Traceback" not in logs
    assert '"listens": false' in stack.logs("relay")


def test_a_pool_without_a_statement_timeout_is_refused_loudly(private_stack: Stack) -> None:
    """Through a transaction pool that sets no statement timeout, the receiver answers 503
    and says why in its log, rather than let a statement wait without a bound."""
    stack = private_stack
    direct = stack.database_url
    with pgbouncer(direct, None) as bouncer:
        stack.database_url = bouncer.url
        stack.extra_env.update(DATABASE_POOL_MODE="transaction")
        try:
            stack.start_receiver()
            with stack.client() as client:
                answer = client.post("/v1/events", json=envelope("no-timeout"))
            assert answer.status_code == 503
            wait_until(lambda: "statements have no timeout" in stack.logs("receiver"))
        finally:
            stack.stop_all()
            stack.database_url = direct


@pytest.mark.parametrize("command", ["sweep", "migrate"])
def test_the_sweeper_and_migrations_need_a_session_of_their_own(
    private_stack: Stack, tmp_path: Path, command: str
) -> None:
    """With DATABASE_POOL_MODE=transaction and no DATABASE_DIRECT_URL, `idem sweep` and
    `idem migrate` refuse to start and say what to set."""
    env = {**private_stack.env(), "DATABASE_POOL_MODE": "transaction", "DATABASE_DIRECT_URL": ""}
    done = subprocess.run(
        [sys.executable, "-m", "outbox.cli", command],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "DATABASE_DIRECT_URL" in done.stderr
