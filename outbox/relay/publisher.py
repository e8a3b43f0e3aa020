"""Publishing outbox rows as Celery messages, by task name (the relay never imports `worker`)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from celery import Celery
from kombu.common import maybe_declare

from outbox.core import tracing
from outbox.core.broker import broker_kind, publisher_transport_options, task_queue
from outbox.core.keys import mask_key
from outbox.core.logs import get_logger
from outbox.core.settings import Settings
from outbox.core.wire import PROCESS_KEYS_TASK, PROCESS_TASK, TASK_QUEUE

log = get_logger(__name__)


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
    def correlation_id(self) -> str | None:
        """The rows' correlation id when they share one; None for unrelated keys (each
        attempt logs its own key's, read at its claim)."""
        ids = {row.correlation_id for row in self.rows}
        return self.first.correlation_id if len(ids) == 1 else None

    @property
    def task_id(self) -> str:
        return "outbox-" + "+".join(str(row.outbox_id) for row in self.rows)


def envelopes(messages: list[OutboxMessage], keys_per_message: int = 1) -> list[Envelope]:
    """The batch's messages, in order.

    The first rows of one event's deliveries (same event and correlation id, `PROCESS_TASK`)
    travel together, where the first of them was. Then consecutive `PROCESS_TASK` groups are
    packed into messages of up to `keys_per_message` keys, so that a backlog's keys share what
    each message costs the worker (its fetch, its ack, one claim statement); an event's
    deliveries are never split. A row whose event is traced travels only with its siblings,
    so that each trace holds only its own event's attempts."""
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
    packed: list[list[OutboxMessage]] = []
    for group in order:
        last = packed[-1] if packed else None
        if last is not None and _packs(last, group, keys_per_message):
            last.extend(group)
        else:
            packed.append(list(group))
    return [Envelope(tuple(group)) for group in packed]


def _packs(rows: list[OutboxMessage], group: list[OutboxMessage], most: int) -> bool:
    """Whether `group` joins `rows` in one message: untraced deliveries of distinct keys."""
    joined = rows + group
    return (
        len(joined) <= most
        and all(row.task_name == PROCESS_TASK and row.trace_context is None for row in joined)
        and len({row.key for row in joined}) == len(joined)
    )


def create_publisher(settings: Settings) -> Celery:
    """A Celery app used only to send: JSON messages to the workers' queue, no retries inside
    the send (the relay decides when to try again, and keeps the rows meanwhile); every socket
    operation bounded, publisher confirms on RabbitMQ (`outbox.core.broker`)."""
    app = Celery("idem-relay", broker=settings.broker(), set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=TASK_QUEUE,
        task_queues=[task_queue(broker_kind(settings.broker()))],
        broker_connection_timeout=settings.broker_timeout_seconds,
        broker_connection_retry_on_startup=True,
        broker_transport_options=publisher_transport_options(settings),
        task_publish_retry=False,
    )
    return app


def publish(
    app: Celery, messages: list[OutboxMessage], sent: list[int], keys_per_message: int = 1
) -> None:
    """Send a batch as standard Celery messages; `sent` names each row once the broker has it.

    Each message is built by Celery (`as_task_v2`), so workers consume it like any
    `send_task`. On Redis the whole batch goes in ONE command (`_push`); on RabbitMQ it is
    published, then confirmed by the broker (`_publish_confirmed`). With tracing on, each
    message is a `send` span in its event's trace, its context in the message's headers
    (`traceparent`).

    An event's deliveries taken in one batch go as ONE `PROCESS_KEYS_TASK` message (`keys`, a
    list; `envelopes`), and so do up to `keys_per_message` consecutive deliveries, so they
    share the worker's per-message cost (the fetch, the ack, the claim's statement); the
    worker still runs each key's own attempt.
    """
    if not messages:
        return
    sends = tracing.batch_sends()
    try:
        built = _build(app, messages, sends, keys_per_message)
        if broker_kind(app.conf.broker_url) == "amqp":
            _publish_confirmed(app, built, sent)
        else:
            with app.producer_or_acquire() as producer:
                _push(producer, built, sent)
    except BaseException as error:
        if sends is not None:
            sends.end(error)
        raise
    if sends is not None:
        sends.end()


@dataclass(frozen=True)
class _Message:
    """One Celery message, built: its rows, body, headers and properties."""

    rows: tuple[OutboxMessage, ...]
    body: Any
    headers: dict[str, Any]
    properties: dict[str, Any]


def _build(
    app: Celery, messages: list[OutboxMessage], sends: tracing.Sends | None, keys_per_message: int
) -> list[_Message]:
    built = []
    for envelope in envelopes(messages, keys_per_message):
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
        correlation_id = envelope.correlation_id
        kwargsrepr = repr({"correlation_id": correlation_id})
        task = app.amqp.as_task_v2(
            task_id,
            task_name,
            args=args,
            kwargs={"correlation_id": correlation_id},
            # What Flower and Celery's logs show: the masked key, never anything else.
            argsrepr=argsrepr,
            kwargsrepr=kwargsrepr,
        )
        headers = task.headers
        if sends is not None:
            traced = sends.start(message.trace_context, TASK_QUEUE, task_id)
            headers = {**headers, **traced}
        built.append(_Message(envelope.rows, task.body, headers, task.properties))
    return built


def _frame(channel: Any, message: _Message, extra: dict[str, Any] | None = None) -> Any:
    """The message as the channel's transport frames it: JSON, persistent (delivery mode 2)."""
    properties = {**message.properties, "delivery_mode": 2, **(extra or {})}
    return channel.prepare_message(
        json.dumps(message.body), 0, "application/json", "utf-8", message.headers, properties
    )


def _push(producer: Any, built: list[_Message], sent: list[int]) -> None:
    """Redis: the batch in ONE LPUSH, framed by kombu's own Redis channel. Per-message round
    trips bounded the relay at about 2 300 messages/s; LPUSH is atomic, so the batch is in
    the queue or not, and `sent` names the rows only once it is. Flower sees these tasks from
    "received" on (no "sent" event is emitted for them)."""
    channel = producer.channel
    frames = []
    for message in built:
        shown = {name: message.headers[name] for name in ("argsrepr", "kwargsrepr")}
        frame = _frame(channel, message, shown)
        # kombu's own framing for the anonymous exchange: the routing key is the queue.
        channel._inplace_augment_message(frame, "", TASK_QUEUE)
        frames.append(json.dumps(frame))
    channel.client.lpush(TASK_QUEUE, *frames)
    sent.extend(row.outbox_id for message in built for row in message.rows)


class Confirms:
    """The broker's answers to one channel's publishes, numbered from 1 in publish order
    (RabbitMQ's delivery tags in confirm mode). An ack or nack may settle every tag up to its
    own at once (`multiple`)."""

    def __init__(self) -> None:
        self.acked: set[int] = set()
        self.nacked: set[int] = set()
        self._settled_to = 0

    def ack(self, tag: int, multiple: bool) -> None:
        self._settle(self.acked, tag, multiple)

    def nack(self, tag: int, multiple: bool) -> None:
        self._settle(self.nacked, tag, multiple)

    def _settle(self, into: set[int], tag: int, multiple: bool) -> None:
        tags = range(self._settled_to + 1, tag + 1) if multiple else (tag,)
        into.update(t for t in tags if t not in self.acked and t not in self.nacked)
        while self._settled_to + 1 in self.acked or self._settled_to + 1 in self.nacked:
            self._settled_to += 1

    def all_settled(self, count: int) -> bool:
        return self._settled_to >= count


class PublishRefused(Exception):
    """The broker refused some messages of a batch (nacked them); their rows stay due."""


def _publish_confirmed(app: Celery, built: list[_Message], sent: list[int]) -> None:
    """RabbitMQ: the batch published on a channel in confirm mode, then ONE wait for the
    broker's confirms of all of it (publisher confirms: an ack means the message is in the
    quorum queue, written on a majority of its nodes); a row is in `sent` only once its
    message was acked.

    Confirming each message in turn (kombu's `confirm_publish` transport option) waits a round
    trip and a Raft commit per message: 280 to 760 messages/s against 1 200 to 1 400 batched
    (2 000 messages in batches of 500, on a busy 2-core machine).

    Messages are persistent and `mandatory`: one the broker cannot route (the queue deleted
    under the relay) is returned, not dropped, and the return raises. A nack, a return, a lost
    connection or no answer within BROKER_TIMEOUT_SECONDS raises: the rows acked so far count,
    the rest stay due, and the connection is dropped, so no later batch reads this one's late
    answers."""
    timeout = app.conf.broker_connection_timeout
    with app.pool.acquire(block=True) as connection:
        try:
            _confirm_batch(connection, built, sent, timeout)
        except BaseException as error:
            failed_on = connection.host
            connection.collect()
            # A cluster named as a failover list (`amqp://a//;amqp://b//`): the next batch
            # tries the next node, as a worker's consumer does, instead of the one that failed
            # (a node lost would otherwise stop the relay until that very node came back).
            connection.maybe_switch_next()
            # Which node failed and which is next (host and port: no credentials), so a stall
            # across a cluster's nodes can be read from the log.
            log.warning(
                "relay.broker_node_failed",
                node=failed_on,
                next_node=connection.host,
                error=type(error).__name__,
            )
            raise


def _confirm_batch(connection: Any, built: list[_Message], sent: list[int], timeout: float) -> None:
    connection.ensure_connection(max_retries=0)
    channel = connection.channel()
    # Declared once per connection (kombu remembers it), as the worker declares it. kombu's
    # signatures carry no types.
    maybe_declare(task_queue("amqp"), channel)  # type: ignore[no-untyped-call]
    confirms = Confirms()
    channel.events["basic_ack"].add(confirms.ack)
    channel.events["basic_nack"].add(confirms.nack)
    channel.confirm_select()
    try:
        for message in built:
            frame = _frame(channel, message)
            channel.basic_publish(frame, exchange="", routing_key=TASK_QUEUE, mandatory=True)
        deadline = time.monotonic() + timeout
        while not confirms.all_settled(len(built)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no confirm from the broker within {timeout:g} s")
            connection.drain_events(timeout=remaining)
    finally:
        for tag, message in enumerate(built, start=1):
            if tag in confirms.acked:
                sent.extend(row.outbox_id for row in message.rows)
    channel.close()
    if confirms.nacked:
        raise PublishRefused(f"the broker refused {len(confirms.nacked)} of {len(built)} messages")
