"""Actions: the side effects keys protect. Each takes a route and a context, returns a result.

An action raises `TransientError` / `PermanentError` (or lets its HTTP client's errors through)
and the classifier decides what happens next; it never retries by itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outbox.core.actions import ActionSettings


@dataclass(frozen=True)
class ActionResult:
    """What the worker stores and every later duplicate is answered with."""

    result: Any = None
    external_ref: str | None = None


@dataclass
class ActionContext:
    """What an action knows about the attempt it runs in."""

    key: str
    correlation_id: str
    attempt: int
    source: str
    event_type: str
    external_id: str
    version: str | None
    payload: dict[str, Any]
    # The previous attempt may have had its effect (it timed out after sending, or its worker
    # vanished holding the lease): look before acting again.
    uncertain: bool = False
    # Set when the lease is lost: a long action should stop, its result would be rejected.
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Until when, on this process's monotonic clock, the lease is trusted (it moves with each
    # renewal); None: no lease is held (an action called outside an attempt).
    trusted_until: Callable[[], float] | None = field(default=None, repr=False)

    def lease_held(self) -> bool:
        """Whether the action may still start an external call. The cancel flag is set by the
        lease's keeper and by the attempt's own wait, each a moment after the trust window
        closes; the clock read here closes that moment, so no request leaves once the window
        has, however the threads were scheduled."""
        if self.cancelled.is_set():
            return False
        return self.trusted_until is None or time.monotonic() < self.trusted_until()


Action = Callable[[ActionSettings, ActionContext], ActionResult]
# Looks for the effect of an earlier attempt: its result when found, None when not.
Reconciler = Callable[[ActionSettings, ActionContext], ActionResult | None]


# Actions that touch nothing outside the process and return at once: the attempt runs them in
# its own thread. Handing one to a thread of its own (to hold it to the route's time limit and
# stop waiting when the lease is lost) cost more than the action itself.
INSTANT = frozenset({"noop"})


def get_action(route: ActionSettings) -> Action:
    """The callable for a route's action name."""
    from worker.actions import http, noop, python

    actions: dict[str, Action] = {"noop": noop.run, "http": http.run, "python": python.run}
    return actions[route.action]


def get_reconciler(route: ActionSettings) -> Reconciler | None:
    """The route's reconcile step, if it has one (an http route with `reconcile_url`)."""
    from worker.actions import http

    if route.action == "http" and route.reconcile_url:
        return http.reconcile
    return None
