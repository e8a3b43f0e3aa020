"""Publishing outbox rows as Celery messages, by task name (the relay never imports `worker`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from celery import Celery

from outbox.core import tracing
from outbox.core.keys import mask_key
from outbox.core.settings import Settings
from outbox.core.wire import PROCESS_KEYS_TASK, PROCESS_TASK, TASK_QUEUE


@dataclass(frozen=True)
class OutboxMessage:
    outbox_id: int
    key: str
    task_name: str
    correlation_id: str
    # The event's stored W3C context (outbox/core/tracing.py); read only with tracing on.
    trace_context: str | None = None
    # A delivery's first row names its event (None for any other row): see `envelopes`.
    event_key: str | None = None


@dataclass(frozen=True)
class Envelope:
    """One Celery message: one outbox row's key, or several deliveries of one event."""

    rows: tuple[OutboxMessage, ...]

    @property
    def first(self) -> OutboxMessage:
        return self.rows[0]

    @property
    def task_id(self) -> str:
        return "outbox-" + "+".join(str(row.outbox_id) for row in self.rows)


def envelopes(messages: list[OutboxMessage]) -> list[Envelope]:
    """The batch's messages, in order: the first rows of one event's deliveries (same event
    and correlation id, `PROCESS_TASK`) travel together, where the first of them was; every
    other row (a retry, a re-drive, a replay, a lane wake, a key that is no delivery) alone."""
    groups: dict[tuple[str, str], list[OutboxMessage]] = {}
    order: list[list[OutboxMessage]] = []
    for message in messages:
        if message.event_key is None or message.task_name != PROCESS_TASK:
            order.append([message])
            continue
        group = groups.get((message.event_key, message.correlation_id))
        if group is None:
            group = groups[(message.event_key, message.correlation_id)] = []
            order.append(group)
        group.append(message)
    return [Envelope(tuple(group)) for group in order]


def create_publisher(settings: Settings) -> Celery:
    """A Celery app used only to send: JSON messages to the workers' queue, no retries inside
    the send (the relay decides when to try again, and keeps the rows meanwhile)."""
    app = Celery("idem-relay", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=TASK_QUEUE,
        broker_connection_timeout=settings.broker_timeout_seconds,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout,
            # A broker that accepts the connection and then stops answering must not hang
            # the relay: every socket read and write is bounded, and the relay backs off.
            "socket_connect_timeout": settings.broker_timeout_seconds,
            "socket_timeout": settings.broker_timeout_seconds,
        },
        task_publish_retry=False,
    )
    return app


def publish(app: Celery, messages: list[OutboxMessage], sent: list[int]) -> None:
    """Send a batch as standard Celery messages in ONE Redis command.

    Each message is built by Celery (`as_task_v2`) and framed by kombu's own Redis channel, so
    workers consume it like any `send_task`; what changes is the transport: one LPUSH carries
    the whole batch instead of a round trip per message (per-message round trips bounded the
    relay at about 2 300 messages/s). LPUSH is atomic: the batch is in the queue or not, and
    `sent` names the rows only once it is. Flower sees these tasks from "received" on (no
    "sent" event is emitted for them). With tracing on, each message is a `send` span in its
    event's trace, its context in the message's headers (`traceparent`).

    An event's deliveries taken in one batch go as ONE `PROCESS_KEYS_TASK` message (`keys`, a
    list; `envelopes`), so they share the worker's per-message cost (the fetch, the ack);
    the worker still runs each key's own attempt.
    """
    if not messages:
        return
    sends = tracing.batch_sends()
    try:
        _publish(app, messages, sends)
    except BaseException as error:
        if sends is not None:
            sends.end(error)
        raise
    if sends is not None:
        sends.end()
    sent.extend(m.outbox_id for m in messages)


def _publish(app: Celery, messages: list[OutboxMessage], sends: tracing.Sends | None) -> None:
    with app.producer_or_acquire() as producer:
        channel = producer.channel
        frames = []
        for envelope in envelopes(messages):
            message = envelope.first
            task_id = envelope.task_id
            args: list[Any]
            if len(envelope.rows) == 1:
                task_name, args = message.task_name, [message.key]
                argsrepr = repr([mask_key(message.key)])
            else:
                task_name = PROCESS_KEYS_TASK
                args = [[row.key for row in envelope.rows]]
                argsrepr = repr([[mask_key(row.key) for row in envelope.rows]])
            kwargsrepr = repr({"correlation_id": message.correlation_id})
            task = app.amqp.as_task_v2(
                task_id,
                task_name,
                args=args,
                kwargs={"correlation_id": message.correlation_id},
                # What Flower and Celery's logs show: the masked key, never anything else.
                argsrepr=argsrepr,
                kwargsrepr=kwargsrepr,
            )
            headers = task.headers
            if sends is not None:
                traced = sends.start(message.trace_context, TASK_QUEUE, task_id)
                headers = {**headers, **traced}
            properties = {
                **task.properties,
                "delivery_mode": 2,
                "argsrepr": argsrepr,
                "kwargsrepr": kwargsrepr,
            }
            frame = channel.prepare_message(
                json.dumps(task.body), 0, "application/json", "utf-8", headers, properties
            )
            # kombu's own framing for the anonymous exchange: the routing key is the queue.
            channel._inplace_augment_message(frame, "", TASK_QUEUE)
            frames.append(json.dumps(frame))
        channel.client.lpush(TASK_QUEUE, *frames)
