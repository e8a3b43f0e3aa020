"""Unit tests for outbox.core.broker: which broker a URL names, the start-up refusal of any
other, and what the relay and the worker declare and set on each broker."""

from __future__ import annotations

import pytest

from outbox.core.broker import (
    BrokerError,
    broker_kind,
    check_broker,
    has_visibility_timeout,
    publisher_transport_options,
    task_queue,
    worker_transport_options,
)
from outbox.core.settings import Settings
from outbox.core.wire import TASK_QUEUE


@pytest.fixture(autouse=True)
def _no_broker_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings fill unset fields from the environment; these tests name every URL."""
    for name in ("BROKER_URL", "REDIS_URL", "VISIBILITY_TIMEOUT", "BROKER_TIMEOUT_SECONDS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("redis://127.0.0.1:6379/0", "redis"),
        ("rediss://:secret@redis.example:6380/1", "redis"),
        ("REDIS://host/0", "redis"),
        ("amqp://guest:guest@127.0.0.1:5672/", "amqp"),
        ("amqps://idem:secret@rabbit.example:5671/idem", "amqp"),
    ],
)
def test_each_supported_scheme_names_its_broker(url: str, kind: str) -> None:
    """redis:// and rediss:// name Redis, amqp:// and amqps:// RabbitMQ (any letter case)."""
    assert broker_kind(url) == kind


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("kafka://broker:9092", "the scheme 'kafka'"),
        ("sqs://queue", "the scheme 'sqs'"),
        ("pyamqp://guest@localhost//", "the scheme 'pyamqp'"),
        ("127.0.0.1:6379", "no scheme"),
    ],
)
def test_any_other_broker_url_is_refused_naming_the_schemes(url: str, shown: str) -> None:
    """A BROKER_URL of another scheme (or none) stops the start with the variable, what it
    has and the four schemes that work."""
    with pytest.raises(BrokerError) as refused:
        check_broker(Settings(broker_url=url))
    message = str(refused.value)
    assert message.startswith(f"BROKER_URL has {shown}:")
    for scheme in ("redis://", "rediss://", "amqp://", "amqps://"):
        assert scheme in message


def test_a_rabbitmq_in_redis_url_is_refused_pointing_at_broker_url() -> None:
    """REDIS_URL names a Redis; an amqp URL there is refused with where it belongs."""
    with pytest.raises(BrokerError, match="REDIS_URL names a RabbitMQ: set BROKER_URL"):
        check_broker(Settings(redis_url="amqp://guest:guest@127.0.0.1:5672/"))


def test_broker_url_wins_over_redis_url_and_unset_is_left_to_idem_dev() -> None:
    """BROKER_URL is the broker when both are set, REDIS_URL when alone; neither set passes
    the check (`idem dev` starts an embedded Redis, the other commands say it is missing)."""
    both = Settings(broker_url="amqp://h/", redis_url="redis://h/0")
    check_broker(both)
    assert both.broker() == "amqp://h/"
    assert Settings(redis_url="redis://h/0").broker() == "redis://h/0"
    check_broker(Settings())
    assert Settings().broker() == ""


def test_only_redis_redelivers_after_a_visibility_timeout() -> None:
    """Redis (and an unset URL, an embedded Redis) has a visibility timeout; RabbitMQ does not."""
    assert has_visibility_timeout("redis://h/0")
    assert has_visibility_timeout("")
    assert not has_visibility_timeout("amqp://h/")
    assert not has_visibility_timeout("AMQPS://h/")


def test_the_task_queue_is_a_durable_quorum_queue_on_rabbitmq_only() -> None:
    """RabbitMQ's task queue is durable and of type quorum; Redis's has no arguments. Both
    are bound to the direct exchange of the queue's name under the queue's name."""
    amqp, redis = task_queue("amqp"), task_queue("redis")
    assert amqp.name == redis.name == TASK_QUEUE
    assert amqp.durable and amqp.queue_arguments == {"x-queue-type": "quorum"}
    assert not redis.queue_arguments
    for queue in (amqp, redis):
        assert queue.exchange.name == TASK_QUEUE and queue.exchange.type == "direct"
        assert queue.routing_key == TASK_QUEUE


def test_transport_options_by_broker() -> None:
    """Redis gets its visibility timeout (worker and relay) and socket timeouts (relay);
    RabbitMQ gets no visibility timeout, bounded socket reads and writes on the relay, and no
    per-message confirm (the relay confirms per batch)."""
    redis = Settings(broker_url="redis://h/0", visibility_timeout=900, broker_timeout_seconds=4)
    amqp = Settings(broker_url="amqp://h/", visibility_timeout=900, broker_timeout_seconds=4)
    assert worker_transport_options(redis) == {"visibility_timeout": 900}
    assert worker_transport_options(amqp) == {}
    assert publisher_transport_options(redis) == {
        "visibility_timeout": 900,
        "socket_connect_timeout": 4,
        "socket_timeout": 4,
    }
    assert publisher_transport_options(amqp) == {"read_timeout": 4, "write_timeout": 4}
