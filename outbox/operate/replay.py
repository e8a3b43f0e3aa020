"""Replays: put failed keys back on the path, only after a dry run of exactly what will move.

The safe path is the only path. A filter must name a status, an event type, a time window or a
list of keys; a limit bounds it. The dry run reports what matches, what would be replayed, what
is skipped and why, and returns a `confirm` token that binds the filter to that set as of the
dry run's time. The token is an HMAC under a server-side secret (`confirm_secret`), so only a
dry run can issue it: nobody can skip the report by hashing a filter and its keys themselves.

Executing needs the token. Every key is reset by `lifecycle.RESET_FOR_REPLAY`, which checks,
under the key's row lock and in the same statement, that the key is still failed, quarantined
or processing with an expired lease: a key a worker took again, or that succeeded meanwhile, is
never reset under its holder. Then:

- a set of at most `REPLAY_BATCH` keys is reset in one transaction, and the token is checked
  against the set the reset actually locked: if it differs from the dry run's (a key was taken,
  finished or added meanwhile), the transaction is rolled back, nothing happens and a fresh
  report comes back;
- a larger set (up to `MAX_REPLAY_KEYS`) is reset a batch per transaction, so no statement grows
  with the set and each stays well inside the statement timeout. The token binds the filter,
  the dry run's time, its count and its last key; a key that changed since the dry run (its
  `updated_at` is later) is skipped and counted, never reset, and a key that began to match
  later is not touched. An interrupted run is run again with the same token: the keys it
  already replayed changed (they are pending), so each key is replayed once.

Execution resets the keys to `pending` with a fresh attempt budget (their dead letters stay,
marked `replayed`), queues their outbox rows and writes (or, batch by batch, grows) an audit
row. A succeeded key is never replayed, so replaying the same set twice acts once.
"""

from __future__ import annotations

import hmac
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import Connection, Engine, RowMapping

from outbox.core import keys
from outbox.core.redaction import url_host
from outbox.core.routes import RouteTable
from outbox.core.timewindow import glob_to_like, parse_instant
from outbox.core.wire import PROCESS_TASK
from outbox.operate.confirm import Token, confirm_token, read_token
from outbox.operate.confirm import confirm_secret as confirm_secret
from outbox.store import lifecycle
from outbox.store import operate as q

ReplayableStatus = Literal["failed_retryable", "failed_final", "quarantined", "processing"]
REPLAYABLE: tuple[ReplayableStatus, ...] = (
    "failed_retryable",
    "failed_final",
    "quarantined",
    "processing",
)
# Keys per statement and per transaction: a page of the dry run, a batch of the execution.
# 500 keys take milliseconds to read or reset even among a million keys, far inside the
# statement timeout (DB_TIMEOUT_SECONDS, 3 s by default), and hold their row locks briefly.
REPLAY_BATCH = 500
# The most one replay may select: a large outage's dead letters, in one deliberate step.
MAX_REPLAY_KEYS = 100_000
# Progress of a batched execution: (keys replayed so far, keys of the dry run).
Progress = Callable[[int, int], None]


class ReplayRequest(BaseModel):
    """What to replay. `processing` keys qualify only once their lease has expired."""

    model_config = ConfigDict(extra="forbid")

    statuses: list[ReplayableStatus] | None = None
    event_type: str | None = Field(default=None, min_length=1, description="a glob")
    source: str | None = Field(default=None, min_length=1)
    # A fan-out route's destination: only its deliveries, never the event's other ones.
    destination: str | None = Field(default=None, min_length=1)
    since: str | None = Field(default=None, description="ISO-8601 or relative, e.g. 2h")
    until: str | None = None
    keys: list[str] | None = Field(default=None, min_length=1, max_length=1000)
    limit: int = Field(default=100, ge=1, le=MAX_REPLAY_KEYS)
    dry_run: bool = True
    confirm: str | None = None

    @model_validator(mode="after")
    def _narrow_enough(self) -> ReplayRequest:
        named = (self.statuses, self.event_type, self.destination, self.since, self.until)
        if not any(named) and not self.keys:
            raise ValueError(
                "a replay filter must name statuses, an event_type, a destination, a since/until"
                " window or keys"
            )
        for bound in (self.since, self.until):
            if bound is not None:
                parse_instant(bound)
        if not self.dry_run and not self.confirm:
            raise ValueError("executing a replay needs the confirm token of its dry run")
        return self

    def filter_document(self) -> dict[str, Any]:
        """The filter alone (what the token and the audit row record)."""
        return self.model_dump(exclude={"dry_run", "confirm"}, exclude_none=True)

    def bindings(self) -> dict[str, Any]:
        """The filter as the named binds of `REPLAY_CANDIDATES`."""
        return {
            "keys": self.keys,
            "statuses": self.statuses,
            "event_type_like": glob_to_like(self.event_type) if self.event_type else None,
            "source": self.source,
            "destination": self.destination,
            "since": parse_instant(self.since) if self.since else None,
            "until": parse_instant(self.until) if self.until else None,
        }


@dataclass(frozen=True)
class ReplayReport:
    matched: int
    to_replay: list[str]
    skipped: list[dict[str, str]]
    by_event_type: dict[str, int]
    by_target: dict[str, int]
    confirm: str
    # Executed in batches: keys of the dry run that changed since and were left alone.
    changed_since_dry_run: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "matched": self.matched,
            "to_replay": len(self.to_replay),
            "keys": [keys.mask_key(k) for k in self.to_replay],
            "skipped": self.skipped,
            "by_event_type": self.by_event_type,
            "by_target": self.by_target,
            "changed_since_dry_run": self.changed_since_dry_run,
            "confirm": self.confirm,
        }


@dataclass(frozen=True)
class Executed:
    replay_id: int
    report: ReplayReport


@dataclass(frozen=True)
class Stale:
    """The set changed since the dry run: nothing was done; here is the fresh report."""

    report: ReplayReport


def plan(
    conn: Connection, request: ReplayRequest, routes: RouteTable, *, secret: bytes
) -> ReplayReport:
    """What `request` would do right now, with a token signed under `secret`."""
    as_of = conn.execute(q.REPLAY_AS_OF).scalar_one()
    rows = _matching(conn, request, through=None)
    to_replay = [r["idempotency_key"] for r in rows if _replayable(r)]
    token = Token(as_of, len(to_replay), to_replay[-1] if to_replay else None)
    # A set executed at once is bound key by key; a larger one by its time, count and end.
    bound = to_replay if len(to_replay) <= REPLAY_BATCH else None
    return _report(
        rows, to_replay, routes, confirm_token(secret, request.filter_document(), token, bound)
    )


def dry_run(
    engine: Engine, request: ReplayRequest, routes: RouteTable, *, secret: bytes
) -> ReplayReport:
    """The report and its token; its pages read one snapshot (repeatable read)."""
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        return plan(conn, request, routes, secret=secret)


def execute(
    engine: Engine,
    request: ReplayRequest,
    routes: RouteTable,
    by: str,
    *,
    secret: bytes,
    progress: Progress | None = None,
) -> Executed | Stale:
    """Replay the set the dry run showed, or nothing when the token does not hold."""
    token = read_token(request.confirm or "")
    if token is None:
        return Stale(dry_run(engine, request, routes, secret=secret))
    if token.count <= REPLAY_BATCH:
        return _execute_at_once(engine, request, routes, by, token, secret=secret)
    # Constant time: the token is a MAC, and a timing leak would let it be guessed.
    if not hmac.compare_digest(
        confirm_token(secret, request.filter_document(), token, None), request.confirm or ""
    ):
        return Stale(dry_run(engine, request, routes, secret=secret))
    return _execute_in_batches(engine, request, routes, by, token, progress)


def _execute_at_once(
    engine: Engine,
    request: ReplayRequest,
    routes: RouteTable,
    by: str,
    token: Token,
    *,
    secret: bytes,
) -> Executed | Stale:
    """One transaction: reset what is replayable now, and keep it only if the locked set is
    the dry run's set."""
    with engine.connect() as conn, conn.begin() as transaction:
        # The whole filter, as the dry run read it: a key added since makes the set differ.
        rows = _matching(conn, request, through=None)
        wanted = [r["idempotency_key"] for r in rows if _replayable(r)]
        reset = _reset(conn, request, wanted, as_of=None)
        done = sorted(r["idempotency_key"] for r in reset)
        if not hmac.compare_digest(
            confirm_token(secret, request.filter_document(), token, done), request.confirm or ""
        ):
            transaction.rollback()
            stale = True
        else:
            stale = False
            _requeue(conn, done, by)
            replay_id = _record(conn, request, by, done)
            report = _report(rows, done, routes, request.confirm or "")
    if stale:
        return Stale(dry_run(engine, request, routes, secret=secret))
    return Executed(replay_id, report)


def _execute_in_batches(
    engine: Engine,
    request: ReplayRequest,
    routes: RouteTable,
    by: str,
    token: Token,
    progress: Progress | None,
) -> Executed:
    """A transaction per batch: each resets the keys of one page that are unchanged since the
    dry run; safe to interrupt and run again."""
    replay_id: int | None = None
    done: list[str] = []
    by_event_type: Counter[str] = Counter()
    by_target: Counter[str] = Counter()
    after = ""
    while True:
        with engine.begin() as conn:
            page = _page(conn, request, after=after, through=token.through, limit=REPLAY_BATCH)
            if not page:
                break
            reset = _reset(conn, request, [r["idempotency_key"] for r in page], token.as_of)
            batch = [r["idempotency_key"] for r in reset]
            _requeue(conn, batch, by)
            if replay_id is None:
                replay_id = _record(conn, request, by, batch)
            elif batch:
                conn.execute(q.ADD_TO_REPLAY, {"id": replay_id, "count": len(batch), "keys": batch})
        done += batch
        for row in reset:
            by_event_type[row["event_type"]] += 1
            by_target[_target(routes, row["route"])] += 1
        after = page[-1]["idempotency_key"]
        if progress is not None:
            progress(len(done), token.count)
        if len(page) < REPLAY_BATCH:
            break
    if replay_id is None:
        with engine.begin() as conn:
            replay_id = _record(conn, request, by, [])
    report = ReplayReport(
        matched=token.count,
        to_replay=done,
        skipped=[],
        by_event_type=dict(by_event_type),
        by_target=dict(by_target),
        confirm=request.confirm or "",
        changed_since_dry_run=max(token.count - len(done), 0),
    )
    return Executed(replay_id, report)


def _page(
    conn: Connection, request: ReplayRequest, *, after: str, through: str | None, limit: int
) -> Sequence[RowMapping]:
    return (
        conn.execute(
            q.REPLAY_CANDIDATES,
            {**request.bindings(), "after": after, "through": through, "limit": limit},
        )
        .mappings()
        .all()
    )


def _matching(conn: Connection, request: ReplayRequest, *, through: str | None) -> list[RowMapping]:
    """The filter's first `limit` keys (up to `through`), a page per statement."""
    rows: list[RowMapping] = []
    after = ""
    while len(rows) < request.limit:
        size = min(REPLAY_BATCH, request.limit - len(rows))
        page = _page(conn, request, after=after, through=through, limit=size)
        rows += page
        if len(page) < size:
            break
        after = page[-1]["idempotency_key"]
    return rows


def _reset(
    conn: Connection, request: ReplayRequest, wanted: list[str], as_of: datetime | None
) -> Sequence[RowMapping]:
    """The fenced reset: only the keys still replayable (and unchanged since `as_of`)."""
    if not wanted:
        return []
    statuses = list(request.statuses or REPLAYABLE)
    return (
        conn.execute(
            lifecycle.RESET_FOR_REPLAY, {"keys": wanted, "statuses": statuses, "as_of": as_of}
        )
        .mappings()
        .all()
    )


def _requeue(conn: Connection, replayed: list[str], by: str) -> None:
    if replayed:
        conn.execute(lifecycle.ENQUEUE_REPLAYED, {"keys": replayed, "task_name": PROCESS_TASK})
        conn.execute(q.MARK_DEAD_LETTERS_REPLAYED, {"keys": replayed, "by": by})


def _record(conn: Connection, request: ReplayRequest, by: str, replayed: list[str]) -> int:
    replay_id: int = conn.execute(
        q.RECORD_REPLAY,
        {
            "by": by,
            "filter": json.dumps(request.filter_document()),
            "count": len(replayed),
            "keys": replayed,
        },
    ).scalar_one()
    return replay_id


def _report(
    rows: Sequence[RowMapping], to_replay: list[str], routes: RouteTable, confirm: str
) -> ReplayReport:
    chosen = set(to_replay)
    skipped: list[dict[str, str]] = []
    by_event_type: Counter[str] = Counter()
    by_target: Counter[str] = Counter()
    for row in rows:
        if row["idempotency_key"] not in chosen:
            reason = _skip_reason(row["status"], row["lease_live"]) or "taken meanwhile"
            skipped.append({"key": keys.mask_key(row["idempotency_key"]), "reason": reason})
            continue
        by_event_type[row["event_type"]] += 1
        by_target[_target(routes, row["route"])] += 1
    return ReplayReport(
        matched=len(rows),
        to_replay=[r["idempotency_key"] for r in rows if r["idempotency_key"] in chosen],
        skipped=skipped,
        by_event_type=dict(by_event_type),
        by_target=dict(by_target),
        confirm=confirm,
    )


def _replayable(row: RowMapping) -> bool:
    return _skip_reason(row["status"], row["lease_live"]) is None


def _skip_reason(status: str, lease_live: bool) -> str | None:
    match status:
        case "succeeded":
            return "already succeeded"
        case "pending":
            return "in flight (pending)"
        case "processing" if lease_live:
            return "in flight (lease live)"
        case "processing" | "failed_retryable" | "failed_final" | "quarantined":
            return None
        case "fanned_out":
            return "a fan-out event runs nothing itself: replay its deliveries"
        case _:
            return f"status {status} is not replayable"


def _target(routes: RouteTable, label: str) -> str:
    route = routes.by_label(label)
    if route is None:
        return f"{label} (route gone)"
    if route.action == "http" and route.url:
        return f"http {url_host(route.url)}"
    if route.action == "python":
        return f"python {route.function}"
    return route.action
