"""Python actions the test routes name (`tests.actions:…`); the worker imports them."""

from __future__ import annotations

import time

from worker.actions import ActionContext, ActionResult


def sleep_then_succeed(ctx: ActionContext) -> ActionResult:
    """Work for `payload["seconds"]`, watching the cancel flag; report whether it was set."""
    deadline = time.monotonic() + float(ctx.payload.get("seconds", 0))
    while time.monotonic() < deadline and not ctx.cancelled.is_set():
        time.sleep(0.05)
    return ActionResult(result={"cancelled": ctx.cancelled.is_set()}, external_ref="slow-1")


def echo_payload(ctx: ActionContext) -> ActionResult:
    """Answer with the event's payload as the result (so the result carries its values)."""
    return ActionResult(result=dict(ctx.payload))
