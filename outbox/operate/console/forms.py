"""What the console's forms and query strings say, checked and turned into store requests.

Nothing here trusts the browser: bad values become messages on the page, never a 500, and
the replay filter a dry-run page sends back in hidden fields is parsed exactly like the form
that made it, so the confirm token binds the same filter.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, cast
from urllib.parse import urlencode

from fastapi import Request
from pydantic import ValidationError
from starlette.datastructures import FormData

from outbox.core.timewindow import parse_instant
from outbox.operate import deadletters, replay

PAGE_SIZE = 50
DEAD_LETTER_KINDS = ("permanent", "retries_exhausted", "quarantined")
DEAD_LETTER_STATES = ("open", "replayed", "discarded", "superseded")
REPLAYABLE = ("failed_final", "failed_retryable", "quarantined", "processing")
DeadLetterKind = Literal["permanent", "retries_exhausted", "quarantined"]
DeadLetterState = Literal["open", "replayed", "discarded", "superseded"]


def digits(value: str | None) -> int | None:
    """A positive whole number written in ASCII digits (an id, a cursor, a limit), else None."""
    if value is None or not re.fullmatch(r"[0-9]{1,18}", value):
        return None
    number = int(value)
    return number if number > 0 else None


async def read_form(request: Request) -> FormData:
    """A posted form, bounded in field count, without file uploads; its size is bounded by
    MAX_BODY_BYTES like every body (outbox/core/limits.py)."""
    return await request.form(max_files=0, max_fields=1100)


def strings(form: FormData) -> Callable[[str], list[str]]:
    """A form's text values by name (uploads are refused before this)."""
    return lambda name: [v for v in form.getlist(name) if isinstance(v, str)]


def split_keys(values: list[str]) -> list[str]:
    """Keys from ticked rows and from a textarea (one per line), in order, without repeats."""
    seen: dict[str, None] = {}
    for value in values:
        for line in value.splitlines():
            line = line.strip()
            if line:
                seen.setdefault(line, None)
    return list(seen)


class ReplayForm:
    """The replay filter as typed, re-sent verbatim by the dry-run page's hidden fields."""

    def __init__(self, multi: Callable[[str], list[str]]) -> None:
        def one(name: str) -> str:
            values = multi(name)
            return values[0].strip() if values else ""

        self.statuses = [s for s in multi("statuses") if s]
        self.event_type = one("event_type")
        self.source = one("source")
        self.destination = one("destination")
        self.since = one("since")
        self.until = one("until")
        self.keys = split_keys(multi("keys"))
        self.limit = one("limit") or "100"

    def request(self, *, confirm: str | None = None) -> replay.ReplayRequest:
        """The store's request (a dry run unless `confirm`); raises ValidationError."""
        document: dict[str, Any] = {
            "statuses": self.statuses or None,
            "event_type": self.event_type or None,
            "source": self.source or None,
            "destination": self.destination or None,
            "since": self.since or None,
            "until": self.until or None,
            "keys": self.keys or None,
            "limit": self.limit,
            "dry_run": confirm is None,
            "confirm": confirm,
        }
        return replay.ReplayRequest.model_validate(document)


def validation_messages(error: ValidationError) -> list[str]:
    """Pydantic's complaints as sentences for the page."""
    messages = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"])
        text = item["msg"].removeprefix("Value error, ")
        messages.append(f"{where}: {text}" if where else text)
    return messages


@dataclass
class DeadLetterQuery:
    """The dead-letter list's query string: the filter as typed, and what it means."""

    form: dict[str, str]
    errors: list[str] = field(default_factory=list)
    where: deadletters.DeadLetterFilter | None = None
    limit: int = PAGE_SIZE
    cursor: int | None = None

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> DeadLetterQuery:
        names = ("event_type", "source", "destination", "kind", "status", "since", "until")
        form = {name: (params.get(name) or "").strip() for name in names}
        if "status" not in params:
            form["status"] = "open"  # what an operator looks for first
        query = cls(form)
        instants: dict[str, datetime | None] = {}
        for name in ("since", "until"):
            try:
                instants[name] = parse_instant(form[name]) if form[name] else None
            except ValueError as error:
                query.errors.append(f"{name}: {error}")
        kind = form["kind"] if form["kind"] in DEAD_LETTER_KINDS else None
        if form["kind"] and kind is None:
            query.errors.append(f"kind: {form['kind']!r} is not a dead-letter kind")
        state = form["status"] if form["status"] in DEAD_LETTER_STATES else None
        if form["status"] not in ("", "any", *DEAD_LETTER_STATES):
            states = ", ".join(DEAD_LETTER_STATES)
            query.errors.append(f"status: {form['status']!r} is not one of {states}")
        query.cursor = digits(params.get("cursor"))
        limit = digits(params.get("limit"))
        if limit is not None:
            query.limit = min(limit, deadletters.MAX_PAGE)
        if not query.errors:
            query.where = deadletters.DeadLetterFilter(
                event_type=form["event_type"] or None,
                source=form["source"] or None,
                destination=form["destination"] or None,
                kind=cast(DeadLetterKind | None, kind),
                status=cast(DeadLetterState | None, state),
                since=instants.get("since"),
                until=instants.get("until"),
            )
        return query

    def href(self, base: str, cursor: int | None = None) -> str:
        """This filter's list page (the first, or the one starting after `cursor`)."""
        kept: dict[str, Any] = {k: v for k, v in self.form.items() if v}
        if self.limit != PAGE_SIZE:
            kept["limit"] = self.limit
        if cursor is not None:
            kept["cursor"] = cursor
        return f"{base}/dead-letters?{urlencode(kept)}"

    def replay_href(self, base: str) -> str:
        """The replay form, prefilled with what this filter and a replay filter share."""
        names = ("event_type", "source", "destination", "since", "until")
        shared = [(k, self.form[k]) for k in names]
        kind = self.form["kind"]
        statuses = (
            ["quarantined"]
            if kind == "quarantined"
            else ["failed_final"]
            if kind in DEAD_LETTER_KINDS
            else ["failed_final", "quarantined"]
        )
        pairs = [(k, v) for k, v in shared if v] + [("statuses", s) for s in statuses]
        return f"{base}/replays?{urlencode(pairs)}"
