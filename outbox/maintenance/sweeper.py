"""The sweeper: recovers keys whose delivery was lost, from the database alone.

The broker can lose a message (Redis restarted without persistence, flushed, a SIGKILLed worker
whose unacked message waits for the visibility timeout). The database still knows which keys
wait. Each pass, under an advisory lock so only one sweeper acts at a time:

- keys in `processing` whose lease expired get a new outbox row (`leases_reclaimed`); the next
  claim takes over with a newer fence and reconciles before acting;
- keys `pending` or due for a retry that nothing has touched for the grace period, and whose
  last message was published before it, get a new outbox row (`redriven`);
- one bounded batch of expired keys (TTL) and old published outbox rows is purged;
- the notifier (`outbox.maintenance.notify`, under a lock of its own) tells the routes file's
  `[[notify]]` targets what happened since its last pass, in a bounded time.

A redundant delivery is harmless (the claim refuses it); a missing one would lose the event.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from sqlalchemy import Engine, text

from outbox.core.heartbeat import Heartbeat
from outbox.core.logs import get_logger
from outbox.core.notify import NotifyTarget
from outbox.core.settings import Settings
from outbox.core.wire import PROCESS_TASK
from outbox.maintenance.notify import NotifyReport, notify_once
from outbox.maintenance.pace import BatchPace
from outbox.maintenance.purge import purge
from outbox.store import lanes
from outbox.store import maintenance as sql

log = get_logger(__name__)

# Any constant shared by every sweeper of this database; "idem" in ASCII.
SWEEPER_LOCK_ID = 0x6964656D


@dataclass(frozen=True)
class SweepReport:
    leases_reclaimed: int
    redriven: int
    purged_keys: int = 0
    # Lanes handed on to a parked key after nothing else did (see WAKE_IDLE_LANES).
    lanes_woken: int = 0
    pruned_outbox_rows: int = 0


def sweep_once(
    engine: Engine,
    settings: Settings,
    notify: list[NotifyTarget] | None = None,
    pace: BatchPace | None = None,
) -> SweepReport | None:
    """One pass; None when another sweeper holds the lock (the notifier runs either way,
    under its own lock). `pace` carries the purge's batch size from pass to pass."""
    _notify(engine, notify or [])
    params = {
        "limit": settings.sweep_batch_size,
        "grace_seconds": settings.sweep_grace_seconds,
        "task_name": PROCESS_TASK,
    }
    with engine.begin() as conn:
        if not conn.execute(sql.TRY_SWEEPER_LOCK, {"lock_id": SWEEPER_LOCK_ID}).scalar():
            return None
        reclaimed = conn.execute(sql.REDRIVE_EXPIRED_LEASES, params).all()
        redriven = conn.execute(sql.REDRIVE_STALLED_KEYS, params).all()
        woken = conn.execute(lanes.WAKE_IDLE_LANES, params).scalar_one()
    # One bounded batch of TTL purging per pass, outside the lock's transaction: it never
    # touches a processing key or one with an open dead letter.
    purged = purge(
        engine,
        dry_run=False,
        retention_seconds=settings.outbox_retention_seconds,
        batch=settings.sweep_batch_size,
        max_batches=1,
        pace=pace,
    )
    return SweepReport(
        leases_reclaimed=len(reclaimed),
        redriven=len(redriven),
        lanes_woken=int(woken),
        purged_keys=purged.expired_keys,
        pruned_outbox_rows=purged.published_outbox_rows,
    )


def _notify(engine: Engine, targets: list[NotifyTarget]) -> NotifyReport | None:
    """The notifier's turn: its failure is logged and never stops the sweep."""
    try:
        report = notify_once(engine, targets)
    except Exception as error:
        log.warning("notify.failed", error=type(error).__name__, detail=str(error)[:200])
        return None
    if report is not None and (report.written or report.sent or report.failed):
        log.info("notify.pass", written=report.written, sent=report.sent, failed=report.failed)
    return report


AUTOVACUUM_OFF_HINT = (
    "every event updates the keys and outbox tables; without autovacuum their dead rows pile "
    "up and nothing analyses them, so a statement the gateway prepared while they were small "
    "keeps reading them whole: turn autovacuum on (PostgreSQL's default), or VACUUM ANALYZE "
    "idempotency_keys, events, outbox and attempts on a schedule"
)


def _warn_without_autovacuum(engine: Engine) -> bool:
    """Say so, once at start, when the server runs no autovacuum: the gateway's statements
    stay fast only while something keeps the tables' statistics current (a claim planned on a
    nearly empty table read the whole table for every key once it had 20 000:
    docs/explanation/architecture.md). True when it warned. A server it cannot ask (down, or
    refused by a connect-time check) is the sweep's business, logged by each pass: this check never
    stops the sweeper from starting."""
    try:
        with engine.connect() as conn:
            setting = conn.execute(text("SHOW autovacuum")).scalar()
    except Exception:
        return False
    if setting != "off":
        return False
    log.warning("sweeper.autovacuum_off", hint=AUTOVACUUM_OFF_HINT)
    return True


def run_sweeper(
    settings: Settings,
    engine: Engine,
    stop: threading.Event,
    notify: list[NotifyTarget] | None = None,
) -> None:
    """Sweep every `sweep_interval_seconds` until `stop` is set."""
    log.info(
        "sweeper.started",
        interval_seconds=settings.sweep_interval_seconds,
        grace_seconds=settings.sweep_grace_seconds,
    )
    _warn_without_autovacuum(engine)
    heartbeat = Heartbeat(settings.heartbeat_file)
    pace = BatchPace(settings.sweep_batch_size)
    while not stop.is_set():
        heartbeat.beat()
        try:
            report = sweep_once(engine, settings, notify, pace)
        except Exception as error:
            log.warning("sweeper.failed", error=type(error).__name__, detail=str(error)[:200])
        else:
            if report is not None and (
                report.leases_reclaimed or report.redriven or report.lanes_woken
            ):
                log.info(
                    "sweeper.redrove",
                    leases_reclaimed=report.leases_reclaimed,
                    redriven=report.redriven,
                    lanes_woken=report.lanes_woken,
                )
            if report is not None and (report.purged_keys or report.pruned_outbox_rows):
                log.info(
                    "sweeper.purged",
                    expired_keys=report.purged_keys,
                    outbox_rows=report.pruned_outbox_rows,
                )
        stop.wait(settings.sweep_interval_seconds)
    log.info("sweeper.stopped")
