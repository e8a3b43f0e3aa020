"""The worker's remote control on RabbitMQ: a control queue still held by the worker's own lost
connection no longer stops it, and a second worker of a running one's name is still refused.

Celery's remote control (`celery inspect`, Flower, compose's healthcheck ping) reaches a worker
through its control queue, `<node name>.celery.pidbox`, bound to the fanout exchange
`celery.pidbox`. On RabbitMQ that queue is exclusive (Celery's `control_queue_exclusive`, its
default; RabbitMQ 4.3 refuses a transient queue that is not): it belongs to the connection that
declared it, and goes with that connection.

A connection can end at the worker's end only: the node it used went silent (partitioned
away), or the worker's own network did. The worker reconnects at once, to the next node of a
cluster's failover list or to the same one, while the broker still holds the old connection
until its heartbeat timeout, or, across a cluster, until the silent node comes back or the
others see it gone. Declaring the queue again then meets `RESOURCE_LOCKED` (405), a channel
error Celery's consumer does not recover from: "Unrecoverable error", and the worker exited
(70) with its task consumer working.

This module's `Control` step (Celery's, with the `Pidbox` below) answers the refusal by when
it comes:

- On a later connection of the process, the holder is most likely the process's own old
  connection. The worker goes on consuming tasks (they come on another channel), without
  remote control (`worker.control_queue_held`), and declares its queue again every
  `RETAKE_SECONDS` until the broker has let the old connection go
  (`worker.control_queue_retaken`).
- On the process's first connection, another connection holds the name: a second worker
  started with a running one's `WORKER_NAME`, or one stopped without closing its connection
  (its host lost) that the broker has not yet let go. The worker stops before running
  anything: `worker.name_in_use`, exit status `EXIT_NAME_IN_USE`.

A worker whose name another worker took while it was away (started meanwhile) does not get its
queue back: it runs without remote control and says so every `WARN_EVERY_SECONDS`.

Not chosen: a stand-in control queue of another name meanwhile. A new queue is a write to the
cluster's metadata, which RabbitMQ 3.10 holds until every node answers: during a partition its
declaration waited for the silent node to come back, and the worker's consumer with it, where
the refusal of a held queue comes at once. Nor a non-exclusive control queue: RabbitMQ 4.3
refuses transient ones, and a second worker of the same name would share it silently.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from celery.exceptions import WorkerShutdown
from celery.worker.consumer.control import Control as CeleryControl
from celery.worker.pidbox import Pidbox as CeleryPidbox
from kombu.common import ignore_errors

from outbox.core.logs import get_logger

CONTROL_STEP = "celery.worker.consumer.control:Control"
# AMQP 0-9-1's reply code for a queue another connection holds exclusively.
RESOURCE_LOCKED = 405
# The exit status of a worker refused its name (EX_TEMPFAIL, sysexits.h): the name may be free
# later, once the broker lets a lost holder's connection go.
EXIT_NAME_IN_USE = 75
# How often a worker without its control queue declares it again: one round trip that the
# broker refuses at once while the queue is held, and the old connection goes within
# RabbitMQ's heartbeat timeout (a minute or two) or as soon as a silent node is back.
RETAKE_SECONDS = 5.0
# How often a worker still without its control queue says so.
WARN_EVERY_SECONDS = 60.0

log = get_logger(__name__)
# Set when this process was refused its name: Celery's exit code does not reach the caller of
# `app.start` (it returns None whatever stopped the worker), so `python -m worker` reads this.
name_refused = threading.Event()


class Pidbox(CeleryPidbox):  # type: ignore[misc]
    """Celery's worker mailbox, which meets a control queue held by another connection with
    retries (later connections) or a refusal (the first)."""

    def __init__(self, c: Any) -> None:
        super().__init__(c)
        self.held = False  # this process has consumed its control queue
        self.lost_since = 0.0
        self.warned = 0.0
        self.retake: Any = None  # the timer entry of the next attempt

    def start(self, c: Any) -> None:
        if self._take(c):
            return
        if not self.held:
            name_refused.set()
            log.error(
                "worker.name_in_use",
                name=self.hostname,
                exit_status=EXIT_NAME_IN_USE,
                reason="another connection holds this worker name's control queue: a worker"
                " running with the same WORKER_NAME, or one stopped without closing its"
                " connection that the broker has not yet let go",
            )
            raise WorkerShutdown(EXIT_NAME_IN_USE)
        self.lost_since = self.warned = time.monotonic()
        log.warning(
            "worker.control_queue_held",
            name=self.hostname,
            retake_every_seconds=RETAKE_SECONDS,
            reason="another connection, most likely this worker's previous one, still holds"
            " its control queue: tasks go on, remote control is off until it is taken back",
        )
        self._schedule(c)

    def stop(self, c: Any) -> None:
        self._cancel_retake()
        super().stop(c)

    def shutdown(self, c: Any) -> None:
        self._cancel_retake()
        super().shutdown(c)

    def _take(self, c: Any) -> bool:
        """Consume this worker's control queue on a new channel; False when another
        connection holds it."""
        channel = c.connection.channel()
        try:
            consumer = self.node.listen(channel=channel, callback=self.on_message)
        except c.connection.channel_errors as error:
            if getattr(error, "code", None) != RESOURCE_LOCKED:
                raise
            # py-amqp reopens a channel the broker closed: close it, or every attempt would
            # leave one open.
            ignore_errors(c, channel.close)  # type: ignore[no-untyped-call]
            return False
        consumer.on_decode_error = c.on_decode_error
        # The node replies on its channel; Celery's stop closes it with the consumer.
        self.node.channel, self.consumer, self.held = channel, consumer, True
        return True

    def _schedule(self, c: Any) -> None:
        # The event loop's timer runs the attempt in the consumer's thread, which owns the
        # connection. Without an event loop the next connection tries again instead.
        if c.hub is not None:
            self.retake = c.timer.call_after(RETAKE_SECONDS, self._retake, (c,))

    def _retake(self, c: Any) -> None:
        """One more attempt at the worker's control queue (a lost connection raises through
        the event loop, which reconnects and starts the step again)."""
        self.retake = None
        try:
            taken = self._take(c)
        except c.connection.channel_errors as error:
            log.warning("worker.control_queue_retake_failed", name=self.hostname, error=repr(error))
            taken = False
        without_seconds = round(time.monotonic() - self.lost_since, 1)
        if taken:
            log.info(
                "worker.control_queue_retaken", name=self.hostname, without_seconds=without_seconds
            )
            return
        if time.monotonic() - self.warned >= WARN_EVERY_SECONDS:
            self.warned = time.monotonic()
            log.warning(
                "worker.control_queue_held", name=self.hostname, without_seconds=without_seconds
            )
        self._schedule(c)

    def _cancel_retake(self) -> None:
        if self.retake is not None:
            self.retake.cancel()
            self.retake = None


class Control(CeleryControl):  # type: ignore[misc]
    """Celery's remote-control step with the Pidbox above (Celery's own under a green pool,
    which this worker does not offer)."""

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        if not self.is_green:
            self.box = Pidbox(c)
            self.start, self.stop, self.shutdown = self.box.start, self.box.stop, self.box.shutdown
