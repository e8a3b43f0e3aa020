"""`noop`: records a result and touches nothing; for tests, benchmarks and dry routes."""

from __future__ import annotations

from outbox.core.actions import ActionSettings
from worker.actions import ActionContext, ActionResult


def run(route: ActionSettings, ctx: ActionContext) -> ActionResult:
    return ActionResult(result={"action": "noop", "attempt": ctx.attempt})
