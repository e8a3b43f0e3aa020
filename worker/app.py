"""The Celery worker: at-least-once transport, made harmless by the claim.

Settings follow the known traps of Celery on Redis: JSON only; acks after the task
(`task_acks_late`) and a rejected message when a pool process dies
(`task_reject_on_worker_lost`), so a crash redelivers instead of losing; prefetch 1 so a dying
process holds at most one message; task events only when asked for (`WORKER_TASK_EVENTS`, or
Flower's enable_events while Flower runs); Celery's root-logger hijack off so our structlog
setup stays in charge. Retries never use countdown/ETA: they wait in the outbox. On RabbitMQ the
queue is a quorum queue and a lost worker's messages come back when its connection ends
(`outbox.core.broker`).

A task ends as its attempt did (`worker.task_state`): SUCCESS, RETRY for a retry scheduled in
the outbox, FAILURE for a dead letter, with the error code for Flower. Celery acknowledges all
three (`task_acks_on_failure_or_timeout`) and re-publishes none.

A Redis restart is a connection loss the worker recovers from: kombu's Redis channel is
patched so that a channel left without its connection fails like one (`worker.broker`).

`idem.process` carries one key; `idem.process_keys` several (an event's deliveries, or keys that
fell due together), each run as `idem.process` would run it, at once (`worker.deliveries`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from celery import Celery, signals
from sqlalchemy import Engine

from outbox.core import inflight, tracing
from outbox.core.broker import broker_kind, task_queue, worker_transport_options
from outbox.core.logs import configure_logging
from outbox.core.routes import RouteTable, load_routes
from outbox.core.settings import Settings
from outbox.core.timeouts import check_timing
from outbox.core.wire import PROCESS_KEYS_TASK, PROCESS_TASK, TASK_QUEUE
from outbox.store.connections import worker_process_connections
from outbox.store.engines import create_sync_engine
from worker import broker, metrics, redis_client
from worker.attempt import run_attempt
from worker.deliveries import report_all, run_each, run_in_parts, run_in_turn
from worker.grouped import GroupedStore
from worker.guard import RouteGuard
from worker.lease import holder
from worker.siblings import claim_together
from worker.slots import Slots, Taken
from worker.store import InFlight, KeyStore
from worker.task_state import DeadLettered, Finished, report


@dataclass
class Runtime:
    """Per-process state: built lazily after the fork, never shared between processes."""

    settings: Settings
    routes: RouteTable
    _store: KeyStore | None = None
    _guard: RouteGuard | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def store(self) -> KeyStore:
        store = self._store
        if store is None:
            with self._lock:  # the threads pool's first tasks arrive together
                if self._store is None:
                    lease = self.settings.lease_seconds
                    acting = self.routes.acting()
                    self._store = GroupedStore(
                        self._engine(),
                        lease,
                        InFlight(inflight.windows(acting, lease), inflight.largest(acting, lease)),
                    )
                    self._guard = RouteGuard(self._store)
                store = self._store
        return store

    def guard(self) -> RouteGuard:
        """The routes' shared state, through this process's store."""
        self.store()
        assert self._guard is not None
        return self._guard

    def _engine(self) -> Engine:
        """A bounded pool, whatever the concurrency: attempts in flight and the lease keeper
        share WORKER_DB_POOL_SIZE + 1 connections for their millisecond statements; an
        attempt that waits too long for one is still bounded by its own view of the lease.
        All are kept once opened: a connection closed when it came back (an overflow) was
        opened again at the next peak, several times a second under ordered traffic, and
        each is a new server process that plans the lane functions' statements afresh.
        No pre-ping: the store retries a statement once on a connection found dead instead."""
        return create_sync_engine(
            self.settings,
            pool_size=worker_process_connections(self.settings.worker_db_pool_size),
            max_overflow=0,
            pre_ping=False,
            autocommit=True,
        )

    def reset_after_fork(self) -> None:
        if self._store is not None:
            # Connections inherited from the parent belong to it; forget them without closing.
            self._store.engine.dispose(close=False)
            self._store = None
            self._guard = None


def create_worker_app(settings: Settings) -> Celery:
    """The worker's Celery app with the `idem.process` and `idem.process_keys` tasks."""
    # The worker verifies no signature: it reads the routes, not the sources and their secrets.
    routes = load_routes(settings.routes_file, sources=False)
    check_timing(settings, routes)
    runtime = Runtime(settings=settings, routes=routes)
    # A threads worker's attempts in flight, whatever its messages carry (worker/slots.py). A
    # prefork process runs one message at a time, unrelated keys in turn.
    slots = Slots(settings.concurrency() if settings.worker_pool == "threads" else None)
    # Before any fork: a prefork child inherits the provider (its span processor restarts its
    # thread in the child).
    tracing.setup("idem-worker")
    # A Redis restart must not stop the worker (kombu's channel bug, worker/broker.py).
    broker.install()
    # A Redis client per broker channel, not one per acknowledgement (worker/redis_client.py).
    redis_client.install()
    app = Celery("idem", broker=settings.broker(), set_as_current=True)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_acks_late=True,
        # Celery's default, pinned: a task that ends FAILURE (a dead letter) is acknowledged,
        # never requeued; only a lost process is (task_reject_on_worker_lost).
        task_acks_on_failure_or_timeout=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_send_task_events=settings.worker_task_events,
        task_default_queue=TASK_QUEUE,
        # Declared as the relay declares it (a quorum queue on RabbitMQ: outbox/core/broker.py).
        task_queues=[task_queue(broker_kind(settings.broker()))],
        # Celery's consumer less the delayed delivery nothing here uses (worker/consumer.py).
        worker_consumer="worker.consumer:Consumer",
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        broker_transport_options=worker_transport_options(settings),
    )

    def attempt(
        headers: Any,
        message_id: str,
        key: str,
        correlation_id: str | None,
        store: KeyStore | None = None,
    ) -> Finished:
        """Claim the key, run its route's action, record the outcome under the fence (in the
        attempt's span when tracing is on, a child of the message's send span); through
        `store` when the key shares its statements with its siblings (`worker.siblings`)."""
        structlog.contextvars.clear_contextvars()
        # The message's id (`outbox-<ids>`, what Flower lists) on each of the attempt's lines:
        # Celery's own per-task lines are not written (outbox.core.logs).
        structlog.contextvars.bind_contextvars(task_id=message_id)
        if correlation_id:
            structlog.contextvars.bind_contextvars(correlation_id=correlation_id)
        try:
            return tracing.traced_attempt(
                headers,
                TASK_QUEUE,
                message_id,
                lambda: run_attempt(
                    store or runtime.store(),
                    runtime.routes,
                    key,
                    lease_seconds=settings.lease_seconds,
                    guard=runtime.guard(),
                ),
            )
        finally:
            structlog.contextvars.clear_contextvars()

    # A dead letter is an expected FAILURE: one INFO line from Celery, no traceback.
    @app.task(  # type: ignore[untyped-decorator]
        name=PROCESS_TASK, ignore_result=True, bind=True, throws=(DeadLettered,)
    )
    def process(task: Any, key: str, correlation_id: str | None = None) -> str:
        """One key's attempt; the task ends in the state that tells its outcome."""
        held = slots.take(1)
        try:
            return report(attempt(task.request.get, task.request.id or "", key, correlation_id))
        finally:
            held.give_rest()

    @app.task(  # type: ignore[untyped-decorator]
        name=PROCESS_KEYS_TASK, ignore_result=True, bind=True, throws=(DeadLettered,)
    )
    def process_keys(task: Any, keys: list[str], correlation_id: str | None = None) -> str:
        """Several keys, claimed together (`worker.siblings`): each key's own attempt, all
        at once (`worker.deliveries`); the task ends when all have. `correlation_id` is the
        keys' shared one, None when they are unrelated (each attempt logs its own key's)."""
        # The request is the task thread's own (thread-local): read it here for every thread.
        request = task.request
        headers, message_id = request.get, request.id or ""
        if settings.worker_pool == "prefork" and correlation_id is None:
            # Unrelated keys (no shared correlation id) in a process of the prefork pool,
            # which promises one attempt at a time: each key in turn, claimed alone.
            return report_all(
                run_in_turn(keys, lambda key: [attempt(headers, message_id, key, correlation_id)])
            )

        def run_part(part: Sequence[str], held: Taken) -> list[Finished]:
            """Claim `part` together and run its attempts at once, a slot each, each slot
            given back as its attempt ends."""
            try:
                together = claim_together(runtime.store(), part, holder(), settings.lease_seconds)

                def each(key: str) -> Finished:
                    try:
                        return attempt(headers, message_id, key, correlation_id, together)
                    finally:
                        together.finished(key)
                        held.give_one()

                return run_each(part, each)
            finally:
                held.give_rest()

        # The keys start as slots come free, each part claimed only when it starts.
        return report_all(run_in_parts(keys, slots.take, run_part))

    @signals.worker_process_init.connect(weak=False)  # type: ignore[untyped-decorator]
    def _after_fork(**_: Any) -> None:
        runtime.reset_after_fork()

    @signals.worker_process_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
    def _process_gone(pid: int | None = None, **_: Any) -> None:
        # A prefork child ends without the interpreter's exit handlers: send its spans now.
        tracing.flush()
        if pid:
            metrics.mark_process_dead(pid)

    @signals.worker_shutdown.connect(weak=False)  # type: ignore[untyped-decorator]
    def _stopped(**_: Any) -> None:
        tracing.shutdown()

    @signals.setup_logging.connect(weak=False)  # type: ignore[untyped-decorator]
    def _logging(**_: Any) -> None:
        configure_logging(settings.log_format, settings.log_level)

    return app
