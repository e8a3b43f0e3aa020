"""The worker's kombu Redis channel keeps one client (worker/redis_client.py): messages are
recorded as unacknowledged and acknowledged through it as before, a channel whose pool was
dropped builds a new one, and a channel that lost its connection still fails as
worker/broker.py makes it fail."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.message import Message

from worker import broker as worker_broker
from worker import redis_client

QUEUE = Queue("redis-client-test", Exchange("redis-client-test"), "redis-client-test")


@pytest.fixture
def connection(redis_url: str) -> Iterator[Connection]:
    worker_broker.install()
    redis_client.install()
    conn = Connection(redis_url)
    try:
        yield conn
    finally:
        conn.release()


def test_a_channel_hands_out_one_client_until_its_pool_is_dropped(
    connection: Connection,
) -> None:
    channel: Any = connection.default_channel
    first = channel._create_client()
    assert channel._create_client() is first
    with channel.conn_or_acquire() as acquired:
        assert acquired is first
    channel._disconnect_pools()
    rebuilt = channel._create_client()
    assert rebuilt is not first
    assert rebuilt.connection_pool is channel._pool
    assert rebuilt.ping()


def test_messages_are_recorded_and_acknowledged_through_the_kept_client(
    connection: Connection, broker: redis.Redis[Any]
) -> None:
    channel: Any = connection.default_channel
    producer = Producer(channel, exchange=QUEUE.exchange, routing_key=QUEUE.routing_key)
    for number in range(5):
        producer.publish({"n": number}, declare=[QUEUE])
    received: list[Message] = []
    consumer = Consumer(channel, [QUEUE], callbacks=[lambda _, m: received.append(m)])
    with consumer:
        while len(received) < 5:
            connection.drain_events(timeout=5)
    unacked = channel.unacked_key
    # Each message delivered is in the unacknowledged hash until it is acknowledged.
    assert broker.hlen(unacked) == 5
    for message in received:
        message.ack()
    assert broker.hlen(unacked) == 0
    assert broker.zcard(channel.unacked_index_key) == 0
    assert broker.llen(QUEUE.name) == 0


def test_a_channel_that_lost_its_connection_still_fails_as_a_lost_connection(
    connection: Connection,
) -> None:
    channel: Any = connection.default_channel
    kept = channel._create_client()
    connection.close()
    with pytest.raises(worker_broker.ChannelWithoutConnection):
        channel._create_client()
    assert kept is not None
