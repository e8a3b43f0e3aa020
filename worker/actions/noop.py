"""`noop`: records a result and touches nothing; for tests, benchmarks and dry routes."""

from __future__ import annotations

from outbox.core.routes import Route
from worker.actions import ActionContext, ActionResult


def run(route: Route, ctx: ActionContext) -> ActionResult:
    return ActionResult(result={"action": "noop", "attempt": ctx.attempt})
