"""An action that returns at once (`worker.actions.INSTANT`: noop) runs in the attempt's own
thread; every other action, and any action behind a reconcile lookup, in a thread of its own
(`worker.spare`), where the attempt can hold it to the route's time limit."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from outbox.core.routes import Route
from tests.unit.worker.claims import action_context
from worker import attempt, spare
from worker.actions import ActionContext


def _context(uncertain: bool = False) -> ActionContext:
    return action_context(uncertain=uncertain)


def _run() -> Any:
    return attempt._Run(done=threading.Event(), wake=threading.Event())


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the work handed to a thread of its own (not run)."""
    names: list[str] = []

    def record(_work: Callable[[], None], name: str) -> None:
        names.append(name)

    monkeypatch.setattr(spare, "run", record)
    return names


def test_a_noop_action_runs_in_the_attempts_thread(handed: list[str]) -> None:
    run = _run()
    attempt._start(run, Route(match="crm.*", action="noop"), _context(), claim=None)  # type: ignore[arg-type]
    assert handed == []
    assert run.done.is_set() and run.wake.is_set()
    assert run.result is not None and run.result.result["action"] == "noop"


def test_a_noop_action_checks_the_lease_first(handed: list[str]) -> None:
    run = _run()
    ctx = _context()
    ctx.cancelled.set()
    attempt._start(run, Route(match="crm.*", action="noop"), ctx, claim=None)  # type: ignore[arg-type]
    assert handed == []
    assert run.result is None and run.error is not None
    assert run.done.is_set()


def test_an_http_action_runs_in_a_thread_of_its_own(handed: list[str]) -> None:
    run = _run()
    route = Route(match="crm.*", action="http", url="http://crm.test/tasks")
    attempt._start(run, route, _context(), claim=None)  # type: ignore[arg-type]
    assert handed == ["action"]
    assert not run.done.is_set()
