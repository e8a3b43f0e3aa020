"""Faults on the event path: the broker away, the database away, two relays racing.

Each server stopped here is one the test started itself, on its own port.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis as redis_client

from outbox.store.embedded import start_redis
from outbox.store.ports import free_port
from tests.support import (
    AUTH,
    Downstream,
    Stack,
    envelope,
    proxied_database,
    query,
    queued_keys,
    seed_due_outbox,
    wait_until,
)


def _succeeded(database_url: str) -> int:
    rows = query(database_url, "SELECT count(*) FROM idempotency_keys WHERE status = 'succeeded'")
    return int(rows[0][0])


def test_redis_down_while_events_arrive_loses_and_doubles_nothing(
    own_database: str, routes_file: Path, downstream: Downstream, tmp_path: Path
) -> None:
    """With the broker stopped, the receiver keeps answering 202; once it is back every event
    completes, and the downstream sees exactly one effect per event."""
    db = own_database
    downstream.reset()
    port = free_port()
    redis_dir = tmp_path / "redis"
    redis, redis_url = start_redis(redis_dir, port)
    stack = Stack(db, redis_url, routes_file, tmp_path, extra_env={"RELAY_POLL_SECONDS": "0.2"})
    stack.start_all()
    try:
        with stack.client() as client:
            before = [client.post("/v1/events", json=envelope(f"pre-{i}")) for i in range(10)]
            assert {a.status_code for a in before} == {202}
            wait_until(lambda: _succeeded(db) == 10, timeout=60)
            # The worker acknowledges each message after its task returns; an ack that finds
            # Redis stopped is dropped and its message handed out again later (a worker under
            # Redis restarts: tests/integration/worker/test_broker_restart.py). This test is
            # about the event path while the broker is away, so the broker stops with nothing
            # unacknowledged.
            broker = redis_client.Redis.from_url(redis_url)
            wait_until(lambda: broker.hlen("unacked") == 0, timeout=30)
            broker.close()

            redis.terminate()
            redis.wait(timeout=10)
            during = [client.post("/v1/events", json=envelope(f"down-{i}")) for i in range(10)]
            assert {a.status_code for a in during} == {202}
            wait_until(lambda: "relay.publish_failed" in stack.logs("relay"), timeout=30)
            unpublished = query(db, "SELECT count(*) FROM outbox WHERE published_at IS NULL")
            assert unpublished == [(10,)]

            redis, _ = start_redis(redis_dir, port)
            wait_until(lambda: _succeeded(db) == 20, timeout=90)
        keys = {a.json()["key"] for a in before + during}
        assert len(keys) == 20
        assert downstream.effects == dict.fromkeys(keys, 1)
        assert query(db, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == [(0,)]
    finally:
        stack.stop_all()
        redis.terminate()
        redis.wait(timeout=10)


def test_two_relays_publish_each_row_once(
    own_database: str, routes_file: Path, tmp_path: Path
) -> None:
    """Two relays draining one backlog send every outbox row exactly once."""
    db = own_database
    rows = 3000
    seed_due_outbox(db, rows)
    # A broker of our own, with no worker: the messages stay there to be counted.
    redis, redis_url = start_redis(tmp_path / "redis", appendonly=False)
    broker = redis_client.Redis.from_url(redis_url)
    # Small batches so both relays take part while the backlog drains; with the lead off, as
    # two holders for a moment (one paused past its lease) would be.
    stack = Stack(
        db,
        redis_url,
        routes_file,
        tmp_path,
        extra_env={"RELAY_BATCH_SIZE": "25", "RELAY_LEAD_SECONDS": "0"},
    )
    stack.start_relay("relay-a")
    stack.start_relay("relay-b")
    try:
        wait_until(
            lambda: query(db, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == [(0,)],
            timeout=120,
        )
        messages = [json.loads(m) for m in broker.lrange("idem", 0, -1)]
        keys = queued_keys(broker)
    finally:
        stack.stop_all()
        broker.close()
        redis.terminate()
        redis.wait(timeout=10)
    task_ids = Counter(m["headers"]["id"] for m in messages)
    assert max(task_ids.values()) == 1
    # Messages carry up to RELAY_KEYS_PER_MESSAGE keys: every row's key exactly once.
    assert Counter(keys) == Counter(f"k-{n}" for n in range(1, rows + 1))
    assert query(db, "SELECT max(publish_attempts), min(publish_attempts) FROM outbox") == [(1, 1)]


def _receiver_connections(database_url: str) -> int:
    return int(
        query(
            database_url,
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE application_name = 'idem-receiver' AND datname = current_database()",
        )[0][0]
    )


def _posted(stack: Stack, name: str) -> int:
    with stack.client() as client:
        return client.post("/v1/events", json=envelope(name)).status_code


def test_a_receiver_connection_the_server_ended_is_dropped_from_the_pool(
    own_database: str, redis_url: str, routes_file: Path, tmp_path: Path
) -> None:
    """The connections the server ended under an idle receiver (a restart, an idle cut) cost
    at most the one request that finds one dead, a 503 that stored nothing, however many the
    pool held: the pool drops them all then, not one per request."""
    stack = Stack(own_database, redis_url, routes_file, tmp_path)
    stack.start_receiver()
    accepted = []
    try:
        with stack.client() as client:
            for cut in range(3):
                # Requests at once until the pool holds several connections to be ended.
                for burst in range(20):
                    with ThreadPoolExecutor(8) as pool:
                        names = [f"before-{cut}-{burst}-{n}" for n in range(16)]
                        codes = list(pool.map(lambda name: _posted(stack, name), names))
                    assert codes == [202] * len(names)
                    accepted.extend(names)
                    if _receiver_connections(own_database) >= 2:
                        break
                assert _receiver_connections(own_database) >= 2
                ended = query(
                    own_database,
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = 'idem-receiver' AND datname = current_database()",
                )
                assert ended[0][0] >= 2
                first = client.post("/v1/events", json=envelope(f"found-dead-{cut}"))
                assert first.status_code in (202, 503), first.text
                if first.status_code == 202:
                    accepted.append(f"found-dead-{cut}")
                else:
                    assert first.json()["error"] == "database_unavailable"
                for n in range(5):
                    answer = client.post("/v1/events", json=envelope(f"after-{cut}-{n}"))
                    assert answer.status_code == 202, answer.text
                    accepted.append(f"after-{cut}-{n}")
    finally:
        stack.stop_all()
    stored = {r[0] for r in query(own_database, "SELECT external_id FROM events")}
    assert stored == set(accepted)


def test_database_unreachable_gives_503_with_retry_after_then_recovers(
    own_database: str, redis_url: str, routes_file: Path, tmp_path: Path
) -> None:
    """With the database cut off, the receiver answers 503 + Retry-After quickly and stores
    nothing; when the database is reachable again it accepts without a restart."""
    proxy, proxied_url = proxied_database(own_database)
    stack = Stack(proxied_url, redis_url, routes_file, tmp_path)
    stack.start_receiver()
    try:
        with stack.client() as client:
            assert client.post("/v1/events", json=envelope("before")).status_code == 202
            proxy.cut()
            for i in range(3):
                started = time.monotonic()
                answer = client.post("/v1/events", json=envelope(f"during-{i}"))
                elapsed = time.monotonic() - started
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"] == "database_unavailable"
                assert int(answer.headers["retry-after"]) >= 1
                # Not a speed target: a hang would leave the caller's own timeout to fire.
                assert elapsed < 10, elapsed
            # The operator endpoints say the same, not 500.
            stats = client.get("/v1/stats", headers=AUTH)
            assert stats.status_code == 503, stats.text
            assert stats.json()["error"] == "database_unavailable"
            assert "retry-after" in stats.headers
            proxy.start()

            def accepted() -> bool:
                try:
                    return client.post("/v1/events", json=envelope("after")).status_code in (
                        200,
                        202,
                    )
                except httpx.HTTPError:
                    return False

            wait_until(accepted, timeout=30, interval=0.5)
    finally:
        stack.stop_all()
        proxy.stop()
    stored = {r[0] for r in query(own_database, "SELECT e.external_id FROM events e")}
    assert stored == {"before", "after"}
