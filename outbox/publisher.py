"""Publishing outbox rows as Celery messages, by task name (the relay never imports `worker`)."""

from __future__ import annotations

from dataclasses import dataclass

from celery import Celery

from outbox.keys import mask_key
from outbox.settings import Settings

TASK_QUEUE = "idem"
"""The one queue workers consume; the relay and the worker both name it."""


@dataclass(frozen=True)
class OutboxMessage:
    outbox_id: int
    key: str
    task_name: str
    correlation_id: str


def create_publisher(settings: Settings) -> Celery:
    """A Celery app used only to send: JSON messages to the workers' queue, no retries inside
    the send (the relay decides when to try again, and keeps the rows meanwhile)."""
    app = Celery("idem-relay", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=TASK_QUEUE,
        broker_connection_timeout=3,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout},
        task_publish_retry=False,
        # Lets Flower show a task from the moment it was sent.
        task_send_sent_event=True,
    )
    return app


def publish(app: Celery, messages: list[OutboxMessage], sent: list[int]) -> None:
    """Send each message over one pooled connection, appending each sent row's id to `sent`.

    On a broker error the exception propagates with `sent` naming what did go out, so the
    caller marks exactly those rows and keeps the rest for the next round.
    """
    with app.producer_or_acquire() as producer:
        for message in messages:
            app.send_task(
                message.task_name,
                args=[message.key],
                kwargs={"correlation_id": message.correlation_id},
                queue=TASK_QUEUE,
                # One id per outbox row: a re-publish after a crash is recognisable in Flower.
                task_id=f"outbox-{message.outbox_id}",
                # What Flower and Celery's logs show: the masked key, never anything else.
                argsrepr=repr([mask_key(message.key)]),
                kwargsrepr=repr({"correlation_id": message.correlation_id}),
                producer=producer,
                retry=False,
            )
            sent.append(message.outbox_id)
