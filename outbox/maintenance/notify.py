"""The notifier: tells the routes file's `[[notify]]` targets what a person must act on.

It runs inside the sweeper's pass, under a lock of its own (`NOTIFY_LOCK_ID`), so one notifier
acts cluster-wide; the notices table's unique `dedupe_key` would refuse a second copy anyway.
Each pass has two steps:

- **collect**: read the history written since each cursor (dead letters, route changes: a
  bounded batch each, see `outbox.store.notify` for why nothing committed late is skipped) and
  the state-based conditions (stuck keys, blocked lanes: told when they start and when they
  end), and write the notices in the transaction that moves the cursors;
- **send**: post the due notices, each with short timeouts, inside a time budget per pass. A
  failure is retried later (exponential backoff with full jitter through `due_at` and
  `tries`), and a target that failed is left alone for the rest of the pass.

No transaction is open during an HTTP call, and nothing here touches a key: a target that is
down delays its notices, never the pipeline or the sweeper's other work. A notice whose 2xx
was lost (the process died before recording it) is sent again: its `webhook-id` is the same,
so a receiver can drop the repeat.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import Connection, Engine, Row, TextClause

from outbox.core import standard_webhooks
from outbox.core.keys import mask_key
from outbox.core.logs import get_logger
from outbox.core.notify import Condition, NotifyTarget, summary
from outbox.store import notify as q
from outbox.store import operate

log = get_logger(__name__)

# Any constant shared by every notifier of this database; "ntfy" in ASCII.
NOTIFY_LOCK_ID = 0x6E746679
# History rows read per source per pass: a burst of thousands of dead letters is a few passes.
READ_BATCH = 1000
# Notices sent per pass at most, and the time the sends may take: the sweeper's pass stays
# short whatever the targets do.
SEND_BATCH = 50
SEND_BUDGET_SECONDS = 5.0
# One call: two seconds to connect, three to answer (Slack answers in well under a second).
CONNECT_TIMEOUT_SECONDS = 2.0
READ_TIMEOUT_SECONDS = 3.0
# Retries: full jitter up to 5 s doubling to a cap of 15 minutes; a day-long outage is a
# hundred tries or so.
RETRY_BASE_SECONDS = 5.0
RETRY_CAP_SECONDS = 900.0
# A transaction open longer than this stops holding the read horizon back.
MAX_LAG_SECONDS = 60.0
# A source's cursor, made on its first pass, starts an hour back: turning notifications on
# tells what just happened, never months of history.
STARTS_BACK_SECONDS = 3600.0
# Keys (masked) and lanes a message shows; the counts cover all of them.
FIRST_KEYS = 5


@dataclass(frozen=True)
class NotifyReport:
    written: int
    sent: int
    failed: int


def retry_delay(tries: int, rng: random.Random) -> float:
    """Seconds before the next try after `tries` failed ones (1-based): full jitter."""
    ceiling = min(RETRY_CAP_SECONDS, RETRY_BASE_SECONDS * 2 ** min(max(0, tries - 1), 32))
    return rng.uniform(0, ceiling)


def notify_once(
    engine: Engine,
    targets: list[NotifyTarget],
    *,
    rng: random.Random | None = None,
    budget_seconds: float = SEND_BUDGET_SECONDS,
) -> NotifyReport | None:
    """One pass; None when there is no target or another notifier holds the lock."""
    if not targets:
        return None
    with engine.connect() as conn:
        if not conn.execute(q.TRY_NOTIFY_LOCK, {"lock_id": NOTIFY_LOCK_ID}).scalar():
            conn.rollback()
            return None
        conn.commit()
        try:
            written = _collect(conn, targets)
            sent, failed = _send(conn, targets, rng or random.Random(), budget_seconds)
        finally:
            conn.rollback()
            conn.execute(q.NOTIFY_UNLOCK, {"lock_id": NOTIFY_LOCK_ID})
            conn.commit()
    return NotifyReport(written, sent, failed)


def _collect(conn: Connection, targets: list[NotifyTarget]) -> int:
    horizon = conn.execute(q.HORIZON, {"max_lag": MAX_LAG_SECONDS}).scalar_one()
    conn.commit()
    written = 0
    if any(t.wants("dead_letters") for t in targets):
        written += _dead_letters(conn, targets, horizon)
    if any(t.wants("circuit") or t.wants("pause") for t in targets):
        written += _route_changes(conn, targets, horizon)
    for target in targets:
        if target.wants("stuck"):
            written += _stuck(conn, target)
        if target.wants("blocked_lanes"):
            written += _blocked_lanes(conn, target)
    return written


def _cursor(conn: Connection, name: str) -> tuple[datetime, int]:
    row = conn.execute(q.READ_CURSOR, {"name": name, "back": STARTS_BACK_SECONDS}).first()
    assert row is not None
    return row.position_at, int(row.position)


def _insert(
    conn: Connection,
    target: NotifyTarget,
    kind: str,
    dedupe: str,
    payload: dict[str, Any],
    due_at: datetime | None = None,
) -> int:
    params = {
        "target": target.name,
        "kind": kind,
        "dedupe_key": f"{target.name}:{dedupe}",
        "payload": json.dumps(payload),
        "due_at": due_at,
    }
    return 1 if conn.execute(q.INSERT_NOTICE, params).first() is not None else 0


def _read_since(
    conn: Connection, name: str, statement: TextClause, horizon: datetime
) -> Sequence[Row[Any]]:
    """A source's next rows after its cursor and before the horizon (a bounded batch)."""
    at, position = _cursor(conn, name)
    params = {"at": at, "position": position, "horizon": horizon, "batch": READ_BATCH}
    return conn.execute(statement, params).all()


def _move(conn: Connection, name: str, rows: Sequence[Row[Any]]) -> None:
    """The cursor past `rows`, committed with the notices written for them."""
    if rows:
        last = rows[-1]
        conn.execute(q.MOVE_CURSOR, {"name": name, "at": last.created_at, "position": last.id})
    conn.commit()


def _dead_letters(conn: Connection, targets: list[NotifyTarget], horizon: datetime) -> int:
    """Each target's open batch takes the new dead letters; a new batch is due a window after
    the target's last one was sent, so a target hears at most once a window."""
    rows = _read_since(conn, "dead_letters", q.NEW_DEAD_LETTERS, horizon)
    if not rows:
        conn.commit()  # the cursor's row, if this pass made it
        return 0
    written = 0
    for target in (t for t in targets if t.wants("dead_letters")):
        state = conn.execute(q.OPEN_BATCH, {"target": target.name}).one()
        facts = _merged(state.open_payload, rows)
        if state.open_id is not None:
            conn.execute(q.GROW_NOTICE, {"id": state.open_id, "payload": json.dumps(facts)})
            continue
        due = None
        if state.last_sent_at is not None:
            due = state.last_sent_at + timedelta(seconds=target.window_seconds)
        written += _insert(conn, target, "dead_letters", f"dead_letters:{rows[0].id}", facts, due)
    _move(conn, "dead_letters", rows)
    return written


def _merged(payload: dict[str, Any] | None, rows: Sequence[Any]) -> dict[str, Any]:
    """A batch's facts with `rows` added: the total, counts by route and error code, the first
    few keys (masked) and the time span."""
    facts = payload or {"total": 0, "counts": [], "keys": [], "first_at": None, "last_at": None}
    counts = {(c["route"], c["error_code"]): c["count"] for c in facts["counts"]}
    for row in rows:
        counts[(row.route, row.error_code)] = counts.get((row.route, row.error_code), 0) + 1
        if len(facts["keys"]) < FIRST_KEYS:
            facts["keys"].append(mask_key(row.idempotency_key))
    facts["total"] += len(rows)
    facts["counts"] = [
        {"route": route, "error_code": code, "count": n}
        for (route, code), n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    ]
    facts["first_at"] = facts["first_at"] or rows[0].created_at.isoformat()
    facts["last_at"] = rows[-1].created_at.isoformat()
    return facts


def _route_changes(conn: Connection, targets: list[NotifyTarget], horizon: datetime) -> int:
    rows = _read_since(conn, "route_changes", q.NEW_ROUTE_CHANGES, horizon)
    if not rows:
        conn.commit()  # the cursor's row, if this pass made it
        return 0
    written = 0
    for row in rows:
        condition: Condition = "circuit" if row.action.startswith("circuit") else "pause"
        facts = {
            "route": row.route,
            "reason": row.reason,
            "by": row.requested_by,
            "at": row.created_at.isoformat(),
        }
        for target in (t for t in targets if t.wants(condition)):
            written += _insert(conn, target, row.action, f"route_change:{row.id}", facts)
    _move(conn, "route_changes", rows)
    return written


def _stuck(conn: Connection, target: NotifyTarget) -> int:
    """Told when the target's threshold is first reached and when it is no longer."""
    params = {"older_than_seconds": target.stuck_after_seconds, "limit": target.stuck_threshold}
    rows = conn.execute(operate.STUCK_KEYS, params).all()
    facts = {
        "raised": len(rows) >= target.stuck_threshold,
        "count": len(rows),
        "older_than_seconds": target.stuck_after_seconds,
        "keys": [mask_key(r.idempotency_key) for r in rows[:FIRST_KEYS]],
    }
    return _edge(conn, target, "stuck", facts)


def _blocked_lanes(conn: Connection, target: NotifyTarget) -> int:
    params = {"older_than_seconds": target.stuck_after_seconds, "limit": FIRST_KEYS}
    rows = conn.execute(operate.BLOCKED_LANES, params).all()
    facts = {
        "raised": bool(rows),
        "count": len(rows),
        "lanes": [
            {"route": r.route, "lane": mask_key(str(r.lane)), "head_key": mask_key(r.head_key)}
            for r in rows
        ],
    }
    return _edge(conn, target, "blocked_lanes", facts)


def _edge(conn: Connection, target: NotifyTarget, kind: str, facts: dict[str, Any]) -> int:
    """A notice when a condition starts or ends. The cursor counts the changes (odd: the
    condition holds), so each start and each end has a dedupe key of its own."""
    name = f"{kind}:{target.name}"
    at, changes = _cursor(conn, name)
    if facts["raised"] == (changes % 2 == 1):
        conn.rollback()
        return 0
    written = _insert(conn, target, kind, f"{kind}:{changes + 1}", facts)
    conn.execute(q.MOVE_CURSOR, {"name": name, "at": at, "position": changes + 1})
    conn.commit()
    return written


def _send(
    conn: Connection, targets: list[NotifyTarget], rng: random.Random, budget: float
) -> tuple[int, int]:
    by_name = {t.name: t for t in targets}
    due = conn.execute(q.DUE_NOTICES, {"batch": SEND_BATCH}).all()
    conn.commit()
    deadline = time.monotonic() + budget
    sent = failed = 0
    down: set[str] = set()
    with httpx.Client(follow_redirects=False) as client:
        for notice in due:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            target = by_name.get(notice.target)
            if target is None or target.name in down:
                continue
            error = _post(client, target, notice, left)
            if error is None:
                conn.execute(q.MARK_SENT, {"id": notice.id})
                sent += 1
            else:
                delay = retry_delay(notice.tries + 1, rng)
                conn.execute(q.MARK_FAILED, {"id": notice.id, "error": error, "delay": delay})
                down.add(target.name)
                failed += 1
                log.warning(
                    "notify.send_failed",
                    target=target.name,
                    notice=notice.id,
                    error=error,
                    tries=notice.tries + 1,
                    retry_in=round(delay, 1),
                )
            conn.commit()
    return sent, failed


def _post(client: httpx.Client, target: NotifyTarget, notice: Any, left: float) -> str | None:
    """Post one notice; None on a 2xx, else a short error code (never the URL or a body)."""
    text = summary(notice.kind, notice.payload, slack=target.format == "slack")
    message_id = f"notice_{notice.id}"
    if target.format == "slack":
        body = {
            "text": text,
            "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": text}}],
        }
    else:
        body = {
            "id": message_id,
            "type": notice.kind,
            "target": target.name,
            "created_at": notice.created_at.isoformat(),
            "text": text,
            "data": notice.payload,
        }
    content = json.dumps(body, separators=(",", ":")).encode()
    headers = {"content-type": "application/json"}
    if target.format == "json":
        timestamp = int(time.time())
        headers.update({"webhook-id": message_id, "webhook-timestamp": str(timestamp)})
        key = target.signing_key
        if key is not None:
            headers["webhook-signature"] = standard_webhooks.signature_header(
                [key], message_id, timestamp, content
            )
    timeout = httpx.Timeout(
        min(READ_TIMEOUT_SECONDS, left), connect=min(CONNECT_TIMEOUT_SECONDS, left)
    )
    try:
        response = client.post(
            target.url.get_secret_value(), content=content, headers=headers, timeout=timeout
        )
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError as error:
        return type(error).__name__
    if 200 <= response.status_code < 300:
        return None
    return f"http_{response.status_code}"
