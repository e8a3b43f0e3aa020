"""RabbitMQ as the broker, where it differs from Redis: a quorum queue that keeps confirmed
messages across a restart, and no queues beyond the task queue.

The broker stopped here is a node of the test's own (tests/brokers.py `RabbitNode`: its own
name, ports, data and cookie); the machine's RabbitMQ is never stopped. The pipeline's own tests
run on RabbitMQ too (the tests marked `brokers`, tests/conftest.py).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import kombu.exceptions
import pytest

from outbox.core.settings import Settings
from outbox.relay.publisher import OutboxMessage, create_publisher, publish
from tests.brokers import RabbitNode, queue_exists, queue_type, queued, rabbitmq_vhost
from tests.support import (
    Downstream,
    Reply,
    Stack,
    TcpProxy,
    envelope,
    free_port,
    post_event,
    query,
    wait_until,
)
from worker.control import EXIT_NAME_IN_USE


def _count(database_url: str, where: str) -> int:
    return int(query(database_url, f"SELECT count(*) FROM {where}")[0][0])


def _post(client: httpx.Client, external_id: str) -> httpx.Response:
    """An event of the route whose downstream may take up to 3 s to answer."""
    return client.post("/v1/events", json=envelope(external_id, "wait.job"))


def _ready(stack: Stack) -> int:
    with stack.client() as client:
        return client.get("/readyz").status_code


@pytest.fixture
def node(tmp_path: Path) -> Iterator[RabbitNode]:
    """A started RabbitMQ node of the test's own, stopped at the end."""
    if RabbitNode.script() is None:
        pytest.skip(
            "no rabbitmq-server script to start a node of the test's own "
            "(the machine's RabbitMQ is never restarted)"
        )
    node = RabbitNode(tmp_path / "rabbitmq").start()
    yield node
    node.stop()


@pytest.fixture
def on_node(
    node: RabbitNode,
    own_database: str,
    routes_file: Path,
    downstream: Downstream,
    tmp_path: Path,
) -> Iterator[Stack]:
    """An unstarted stack on its own database and the test's own node (a relay polling every
    0.2 s), stopped at the end."""
    downstream.reset()
    # One key a message, so that the queue's message count is the events' count.
    stack = Stack(
        own_database,
        node.url,
        routes_file,
        tmp_path,
        extra_env={"RELAY_POLL_SECONDS": "0.2", "RELAY_KEYS_PER_MESSAGE": "1"},
    )
    yield stack
    stack.stop_all()


# Two boots of a node: 10 to 20 s each on 2 busy cores, more under heavy load.
@pytest.mark.timeout(300)
def test_a_restarted_rabbitmq_keeps_what_it_confirmed_and_nothing_is_lost_or_doubled(
    node: RabbitNode, on_node: Stack, downstream: Downstream
) -> None:
    """Events published (and confirmed) into the quorum queue with no worker running are
    delivered after the node restarts; while it is down the receiver keeps answering 202,
    /readyz says not ready and the relay keeps the rows; once it is back a worker finishes
    every event with exactly one effect at the downstream."""
    stack, db = on_node, on_node.database_url
    stack.start_receiver()
    stack.start_relay()
    with stack.client() as client:
        before = [client.post("/v1/events", json=envelope(f"kept-{i}")) for i in range(10)]
        assert {a.status_code for a in before} == {202}
        wait_until(lambda: _count(db, "outbox WHERE published_at IS NULL") == 0, timeout=30)
        assert queued(node.url) == 10
        assert queue_type(node.url) == "quorum"

        node.stop()
        wait_until(lambda: _ready(stack) == 503, timeout=15)
        during = [client.post("/v1/events", json=envelope(f"down-{i}")) for i in range(10)]
        assert {a.status_code for a in during} == {202}
        wait_until(lambda: "relay.publish_failed" in stack.logs("relay"), timeout=30)
        assert _count(db, "outbox WHERE published_at IS NULL") == 10

        node.start()
        stack.start_worker()
        wait_until(
            lambda: _count(db, "idempotency_keys WHERE status = 'succeeded'") == 20, timeout=60
        )
        wait_until(lambda: _ready(stack) == 200, timeout=15)
    keys = {a.json()["key"] for a in before + during}
    assert len(keys) == 20
    assert downstream.effects == dict.fromkeys(keys, 1)
    # One outbox row per event (no sweeper runs to add any): the first ten reached the worker
    # from the broker's disk, where they were confirmed before the restart. An attempt that
    # scheduled its next adds one (on a loaded machine a reply can come later than the route's
    # 1 s read timeout: the retry finds the effect, still one above).
    rescheduled = _count(db, "attempts WHERE outcome IN ('transient', 'uncertain')")
    assert _count(db, "outbox") == 20 + rescheduled
    # Celery's native delayed delivery (queues for ETA tasks) is left out (worker/consumer.py).
    assert not queue_exists(node.url, "celery_delayed_0")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_with_attempts_in_flight_rides_out_a_rabbitmq_restart(
    node: RabbitNode, on_node: Stack, downstream: Downstream
) -> None:
    """RabbitMQ restarts while a worker runs ten attempts (each effect made, its answer held):
    the attempts record their outcomes meanwhile, the messages they could not acknowledge come
    back and are refused by the claim, and the same worker process reconnects and takes new
    events; one effect and one request per event."""
    stack, db = on_node, on_node.database_url
    answers = threading.Event()
    downstream.behaviour = lambda key, n: Reply(201, hold=answers)
    stack.start_all()
    with stack.client() as client:
        held = [_post(client, f"held-{i}") for i in range(10)]
        wait_until(lambda: len(downstream.requests) == 10, timeout=30)
        # The answers go out once the worker has lost the broker, well within the route's 3 s
        # read timeout (a node's clean stop can take longer than that).
        stopping = threading.Thread(target=node.stop)
        stopping.start()
        wait_until(lambda: "Connection to broker lost" in stack.logs("worker"), timeout=30)
        answers.set()
        stopping.join()
        wait_until(lambda: _count(db, "idempotency_keys WHERE status = 'succeeded'") == 10)
        node.start()
        after = [_post(client, f"after-{i}") for i in range(10)]
        wait_until(
            lambda: _count(db, "idempotency_keys WHERE status = 'succeeded'") == 20, timeout=90
        )
    assert stack.processes["worker"].poll() is None, stack.logs("worker")[-2000:]
    assert stack.logs("worker").count('"delivery.blocked"') == 10
    keys = {a.json()["key"] for a in held + after}
    assert downstream.effects == dict.fromkeys(keys, 1)
    assert all(len(downstream.request_times(k)) == 1 for k in keys)


@pytest.mark.slow
def test_a_message_the_broker_cannot_route_is_not_counted_as_published() -> None:
    """The task queue deleted under a running relay: its next batch is returned by the broker
    (`mandatory`), no row of it counts as sent, and the batch after it declares the queue again
    and is confirmed whole."""
    rows = [OutboxMessage(i, f"k-{i}", "idem.process", f"c-{i}") for i in range(1, 6)]
    with rabbitmq_vhost() as url:
        app = create_publisher(Settings(broker_url=url, broker_timeout_seconds=5))
        first: list[int] = []
        publish(app, rows[:2], first)
        assert first == [1, 2] and queued(url) == 2
        with app.connection_for_write() as connection:
            connection.channel().queue_delete("idem")
        returned: list[int] = []
        with pytest.raises(Exception, match="NO_ROUTE"):
            publish(app, rows[2:4], returned)
        assert returned == []
        again: list[int] = []
        publish(app, rows[2:], again)
        assert again == [3, 4, 5] and queued(url) == 3


def test_the_relay_publishes_through_the_next_node_of_a_failover_list() -> None:
    """BROKER_URL names a cluster's nodes (`amqp://a//;amqp://b//`) and the first one is down:
    the batch sent to it fails and stays due; the next batch goes to the next node and is
    confirmed whole (the relay does not wait for the lost node to come back)."""
    rows = [OutboxMessage(i, f"k-{i}", "idem.process", f"c-{i}") for i in range(1, 4)]
    with rabbitmq_vhost() as url:
        dead = f"amqp://guest:guest@127.0.0.1:{free_port()}//"
        app = create_publisher(Settings(broker_url=f"{dead};{url}", broker_timeout_seconds=2))
        refused: list[int] = []
        with pytest.raises(kombu.exceptions.OperationalError, match="Connection refused"):
            publish(app, rows, refused)
        assert refused == []
        sent: list[int] = []
        publish(app, rows, sent)
        assert sent == [1, 2, 3] and queued(url) == 3


def _pinged(broker_url: str, name: str) -> bool:
    """Whether the worker of that node name answers `celery inspect ping` (compose's worker
    healthcheck) within 5 s."""
    command = ["inspect", "ping", "--destination", name, "--timeout", "5"]
    ping = subprocess.run(
        [sys.executable, "-m", "celery", "--broker", broker_url, *command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return ping.returncode == 0 and name in ping.stdout


def _succeeded(database_url: str) -> int:
    return _count(database_url, "idempotency_keys WHERE status = 'succeeded'")


@pytest.mark.timeout(300)
def test_a_worker_whose_old_connection_still_holds_its_control_queue_goes_on(
    node: RabbitNode, on_node: Stack, downstream: Downstream
) -> None:
    """The worker's connection ends at its end only (its network went silent) and it reconnects
    while the broker still holds the old connection and, with it, the worker's exclusive
    control queue (RabbitMQ refuses the queue to the new connection: RESOURCE_LOCKED): the
    worker keeps consuming, and takes its queue back, answering pings again, once the broker
    has let the old connection go."""
    stack, db, name = on_node, on_node.database_url, "control@test"
    proxy = TcpProxy(node.port).start()
    try:
        stack.start_receiver()
        stack.start_relay()
        stack.extra_env.update(
            BROKER_URL=f"amqp://guest:guest@127.0.0.1:{proxy.port}/", WORKER_NAME=name
        )
        stack.start_worker()
        post_event(stack, envelope("before"))
        wait_until(lambda: _succeeded(db) == 1, timeout=30)
        assert _pinged(node.url, name)

        proxy.orphan()
        wait_until(
            lambda: (
                stack.processes["worker"].poll() is not None
                or '"worker.control_queue_held"' in stack.logs("worker")
            ),
            timeout=60,
        )
        assert stack.processes["worker"].poll() is None, stack.logs("worker")[-3000:]
        # The broker shares the task queue's messages between the new consumer and the old
        # one, whose deliveries wait in the old connection until the broker lets it go.
        for i in range(6):
            post_event(stack, envelope(f"while-held-{i}"))
        wait_until(lambda: _succeeded(db) > 1, timeout=30)
        assert "worker.control_queue_retaken" not in stack.logs("worker")

        proxy.release()
        wait_until(lambda: '"worker.control_queue_retaken"' in stack.logs("worker"), timeout=60)
        assert _pinged(node.url, name)
        post_event(stack, envelope("after"))
        wait_until(lambda: _succeeded(db) == 8, timeout=60)
        assert stack.processes["worker"].poll() is None, stack.logs("worker")[-3000:]
    finally:
        proxy.stop()
    assert list(downstream.effects.values()) == [1] * 8


@pytest.mark.timeout(300)
def test_a_second_worker_of_a_running_workers_name_is_refused(
    node: RabbitNode, on_node: Stack
) -> None:
    """A second worker started with the WORKER_NAME of a running one stops at once with its own
    exit status and a line that names the clash; the first goes on and still answers a ping."""
    stack, name = on_node, "twin@test"
    stack.extra_env["WORKER_NAME"] = name
    stack.start_worker("first")
    stack.start_worker("second", wait=False)
    second = stack.processes["second"]
    second.wait(timeout=120)
    assert second.returncode == EXIT_NAME_IN_USE, stack.logs("second")[-3000:]
    assert '"worker.name_in_use"' in stack.logs("second")
    assert stack.processes["first"].poll() is None
    assert _pinged(node.url, name)
