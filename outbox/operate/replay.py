"""Replays: put failed keys back on the path, only after a dry run of exactly what will move.

The safe path is the only path. A filter must name a status, an event type, a time window or a
list of keys; a limit bounds it. The dry run reports what matches, what would be replayed, what
is skipped and why, and returns a `confirm` token that binds the filter to that exact set of
keys. The token is an HMAC under a server-side secret (`confirm_secret`), so only a dry run
can issue it: nobody can skip the report by hashing a filter and its keys themselves.
Executing needs the token; if the set changed in between (or the token was not issued under
this secret), nothing happens and a fresh report comes back. Execution resets the keys to
`pending` with a fresh attempt budget (their dead letters stay, marked `replayed`), queues
their outbox rows and writes an audit row, in one transaction. A succeeded key is never
replayed, so replaying the same set twice acts once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import Connection, Engine

from outbox.core import keys
from outbox.core.routes import RouteTable
from outbox.core.settings import Settings
from outbox.core.timewindow import glob_to_like, parse_instant
from outbox.core.wire import PROCESS_TASK
from outbox.store import lifecycle
from outbox.store import operate as q

ReplayableStatus = Literal["failed_retryable", "failed_final", "quarantined", "processing"]


class ReplayRequest(BaseModel):
    """What to replay. `processing` keys qualify only once their lease has expired."""

    model_config = ConfigDict(extra="forbid")

    statuses: list[ReplayableStatus] | None = None
    event_type: str | None = Field(default=None, min_length=1, description="a glob")
    source: str | None = Field(default=None, min_length=1)
    since: str | None = Field(default=None, description="ISO-8601 or relative, e.g. 2h")
    until: str | None = None
    keys: list[str] | None = Field(default=None, min_length=1, max_length=1000)
    limit: int = Field(default=100, ge=1, le=1000)
    dry_run: bool = True
    confirm: str | None = None

    @model_validator(mode="after")
    def _narrow_enough(self) -> ReplayRequest:
        if not (self.statuses or self.event_type or self.since or self.until or self.keys):
            raise ValueError(
                "a replay filter must name statuses, an event_type, a since/until window or keys"
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


@dataclass(frozen=True)
class ReplayReport:
    matched: int
    to_replay: list[str]
    skipped: list[dict[str, str]]
    by_event_type: dict[str, int]
    by_target: dict[str, int]
    confirm: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "matched": self.matched,
            "to_replay": len(self.to_replay),
            "keys": [keys.mask_key(k) for k in self.to_replay],
            "skipped": self.skipped,
            "by_event_type": self.by_event_type,
            "by_target": self.by_target,
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
    rows = (
        conn.execute(
            q.REPLAY_CANDIDATES,
            {
                "keys": request.keys,
                "statuses": request.statuses,
                "event_type_like": glob_to_like(request.event_type) if request.event_type else None,
                "source": request.source,
                "since": parse_instant(request.since) if request.since else None,
                "until": parse_instant(request.until) if request.until else None,
                "limit": request.limit,
            },
        )
        .mappings()
        .all()
    )
    to_replay: list[str] = []
    skipped: list[dict[str, str]] = []
    by_event_type: Counter[str] = Counter()
    by_target: Counter[str] = Counter()
    for row in rows:
        reason = _skip_reason(row["status"], row["lease_live"])
        if reason is not None:
            skipped.append({"key": keys.mask_key(row["idempotency_key"]), "reason": reason})
            continue
        to_replay.append(row["idempotency_key"])
        by_event_type[row["event_type"]] += 1
        by_target[_target(routes, row["route"])] += 1
    return ReplayReport(
        matched=len(rows),
        to_replay=to_replay,
        skipped=skipped,
        by_event_type=dict(by_event_type),
        by_target=dict(by_target),
        confirm=confirm_token(secret, request.filter_document(), to_replay),
    )


def dry_run(
    engine: Engine, request: ReplayRequest, routes: RouteTable, *, secret: bytes
) -> ReplayReport:
    with engine.connect() as conn:
        return plan(conn, request, routes, secret=secret)


def execute(
    engine: Engine, request: ReplayRequest, routes: RouteTable, by: str, *, secret: bytes
) -> Executed | Stale:
    """Replay the set the dry run showed, or nothing when it changed."""
    with engine.begin() as conn:
        candidate = plan(conn, request, routes, secret=secret)
        # Lock, then look again: the set is what it is while we hold the rows.
        conn.execute(q.LOCK_KEYS, {"keys": candidate.to_replay})
        report = plan(conn, request, routes, secret=secret)
        # Constant time: the token is a MAC now, and a timing leak would let it be guessed.
        if not hmac.compare_digest(report.confirm, request.confirm or ""):
            return Stale(report)
        if report.to_replay:
            conn.execute(lifecycle.RESET_FOR_REPLAY, {"keys": report.to_replay})
            conn.execute(
                lifecycle.ENQUEUE_REPLAYED, {"keys": report.to_replay, "task_name": PROCESS_TASK}
            )
            conn.execute(q.MARK_DEAD_LETTERS_REPLAYED, {"keys": report.to_replay, "by": by})
        replay_id = conn.execute(
            q.RECORD_REPLAY,
            {
                "by": by,
                "filter": json.dumps(request.filter_document()),
                "count": len(report.to_replay),
                "keys": report.to_replay,
            },
        ).scalar_one()
    return Executed(replay_id, report)


def confirm_secret(settings: Settings) -> bytes:
    """The key confirm tokens are signed with: from REPLAY_SECRET, else from OPERATOR_TOKEN.

    It must be the same in every process that may take either step: a dry run on one receiver
    replica is often confirmed through another, and `idem replay` runs the dry run and the
    execution as two processes. So it comes from configuration, never from a per-process
    random (which would refuse every such confirmation as stale). OPERATOR_TOKEN is there
    wherever the HTTP paths are enabled; REPLAY_SECRET, when set, keeps tokens unforgeable even
    by holders of the operator token. With neither, only the CLI can replay, and whoever runs
    it holds the database URL. Derived under its own label, so the key is neither the token
    itself nor the console's session key.
    """
    secret = settings.replay_secret or settings.operator_token
    return hmac.new(secret.encode(), b"replay-confirm", hashlib.sha256).digest()


def confirm_token(secret: bytes, filter_document: dict[str, Any], to_replay: list[str]) -> str:
    """Binds a filter to the exact set of keys it selected, under the server's secret."""
    material = json.dumps(
        {"filter": filter_document, "keys": sorted(to_replay)},
        sort_keys=True,
        separators=(",", ":"),
    )
    return "rp2_" + hmac.new(secret, material.encode(), hashlib.sha256).hexdigest()[:40]


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
        case _:
            return f"status {status} is not replayable"


def _target(routes: RouteTable, label: str) -> str:
    route = routes.by_label(label)
    if route is None:
        return f"{label} (route gone)"
    if route.action == "http" and route.url:
        return f"http {urlsplit(route.url).netloc}"
    if route.action == "python":
        return f"python {route.function}"
    return route.action
