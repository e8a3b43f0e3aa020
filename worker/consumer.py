"""The worker's Celery consumer: Celery's own, less the native delayed delivery, with a
remote-control step that survives its control queue held by a lost connection
(`worker.control`).

Celery 5.5+ adds a bootstep to a worker that consumes a quorum queue (RabbitMQ): it declares
28 quorum queues and 29 exchanges (`celery_delayed_*`) through which ETA and countdown tasks
wait. The gateway never sends such a task (retries wait in the outbox, invariant 6;
tests/unit/test_boundaries.py keeps Celery's own retry timing out of the code), so those queues
would be idle Raft groups on every node of the cluster. The step list is Celery's, filtered by
name: a renamed step fails `tests/integration/test_rabbitmq.py`, which looks for the queues.
"""

from __future__ import annotations

from celery.worker.consumer import Consumer as CeleryConsumer

from worker.control import CONTROL_STEP

DELAYED_DELIVERY_STEP = "celery.worker.consumer.delayed_delivery:DelayedDelivery"
# Celery's remote-control step, replaced (a renamed step fails the control queue tests of
# tests/integration/test_rabbitmq.py).
STEPS = {CONTROL_STEP: "worker.control:Control"}


class Consumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's consumer without the delayed-delivery step, with this worker's control step."""

    class Blueprint(CeleryConsumer.Blueprint):  # type: ignore[misc]
        default_steps = tuple(
            STEPS.get(step, step)
            for step in CeleryConsumer.Blueprint.default_steps
            if step != DELAYED_DELIVERY_STEP
        )
