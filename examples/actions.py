"""A custom `python` action, as a route would name it: `examples.actions:record_payment`."""

from __future__ import annotations

from typing import Any

from worker.actions import ActionContext, ActionResult
from worker.errors import PermanentError


def record_payment(ctx: ActionContext) -> ActionResult:
    """Pretend to book a payment; refuses amounts that are not positive (a permanent error)."""
    amount: Any = ctx.payload.get("amount")
    if not isinstance(amount, int | float) or amount <= 0:
        raise PermanentError("invalid_amount", "amount must be a positive number")
    return ActionResult(result={"booked": amount}, external_ref=f"pay-{ctx.external_id}")
