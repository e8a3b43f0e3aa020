"""Which broker carries the messages, and what the relay and the worker declare on it.

Two brokers are supported, chosen by the scheme of BROKER_URL (else REDIS_URL):

- Redis (`redis://`, `rediss://`): the simplest. An unacknowledged message goes back to the
  queue only after `visibility_timeout` (`outbox.core.timeouts` checks it against the lease),
  and a queue lives in one server's memory.
- RabbitMQ (`amqp://`, `amqps://`): the task queue is a durable quorum queue (replicated over
  the cluster's nodes by Raft), the relay counts a row as published only once the broker has
  confirmed it (publisher confirms), and a message a worker took comes back the moment that
  worker's connection ends (consumer acknowledgements): no visibility timeout to tune.

Anything else is refused at start-up (`check_broker`), naming the variable and the schemes.
The queue's declaration is wire format like its name (`outbox.core.wire`): RabbitMQ refuses a
declaration whose arguments differ from the existing queue's, so the relay and the worker take
it from here.
"""

from __future__ import annotations

from typing import Any, Literal

from kombu.entity import Exchange, Queue

from outbox.core.settings import Settings
from outbox.core.wire import TASK_QUEUE

BrokerKind = Literal["redis", "amqp"]

SCHEMES: dict[str, BrokerKind] = {
    "redis": "redis",
    "rediss": "redis",
    "amqp": "amqp",
    "amqps": "amqp",
}


class BrokerError(Exception):
    """The broker's URL names no supported broker; the message says which schemes are."""


def broker_kind(url: str, name: str = "BROKER_URL") -> BrokerKind:
    """The broker a URL names, by its scheme; BrokerError naming `name` for any other."""
    scheme, separator, _ = url.partition("://")
    kind = SCHEMES.get(scheme.lower()) if separator else None
    if kind is None:
        shown = f"the scheme {scheme!r}" if separator else "no scheme"
        raise BrokerError(
            f"{name} has {shown}: a broker URL starts with "
            + ", ".join(f"{s}://" for s in SCHEMES)
            + " (redis: Redis, amqp: RabbitMQ)"
        )
    return kind


def check_broker(settings: Settings) -> None:
    """The start-up check of every process that talks to the broker: BROKER_URL names Redis
    or RabbitMQ, and REDIS_URL (the setting of before BROKER_URL, still read when BROKER_URL
    is unset) names a Redis."""
    if settings.broker_url:
        broker_kind(settings.broker_url)
    if settings.redis_url and broker_kind(settings.redis_url, "REDIS_URL") != "redis":
        raise BrokerError("REDIS_URL names a RabbitMQ: set BROKER_URL to an amqp:// URL instead")


def has_visibility_timeout(url: str) -> bool:
    """Whether the broker redelivers an unacknowledged message after a timeout (Redis; also an
    unset URL, which `idem dev` fills with an embedded Redis) rather than when the holder's
    connection ends (RabbitMQ)."""
    return SCHEMES.get(url.partition("://")[0].lower()) != "amqp"


def task_queue(kind: BrokerKind) -> Queue:
    """The queue workers consume, as both the relay and the worker declare it.

    On RabbitMQ a durable quorum queue: it survives a broker restart with every confirmed
    message, and it is replicated when the broker is a cluster. On Redis a list of that name
    (durability is the server's AOF). The exchange is Celery's default for a queue of this
    name (direct, routing key = name); the relay publishes through the default exchange, which
    routes by queue name, so both paths reach the same queue.
    """
    arguments = {"x-queue-type": "quorum"} if kind == "amqp" else None
    # kombu's signatures carry no types.
    return Queue(  # type: ignore[no-untyped-call]
        TASK_QUEUE,
        Exchange(TASK_QUEUE, type="direct"),  # type: ignore[no-untyped-call]
        routing_key=TASK_QUEUE,
        durable=True,
        queue_arguments=arguments,
    )


def worker_transport_options(settings: Settings) -> dict[str, Any]:
    """The worker's kombu transport options: Redis's redelivery delay; nothing for RabbitMQ,
    which redelivers a message when the connection of the worker that held it ends."""
    if broker_kind(settings.broker()) == "redis":
        return {"visibility_timeout": settings.visibility_timeout}
    return {}


def publisher_transport_options(settings: Settings) -> dict[str, Any]:
    """The relay's kombu transport options: every socket operation bounded by
    BROKER_TIMEOUT_SECONDS (a broker that accepts the connection and then stops answering
    must not hang the relay). Publisher confirms on RabbitMQ are the relay's own, per batch
    (`outbox.relay.publisher`), not kombu's per-message `confirm_publish`."""
    timeout = settings.broker_timeout_seconds
    if broker_kind(settings.broker()) == "redis":
        return {
            "visibility_timeout": settings.visibility_timeout,
            "socket_connect_timeout": timeout,
            "socket_timeout": timeout,
        }
    return {"read_timeout": timeout, "write_timeout": timeout}
