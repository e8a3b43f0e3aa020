"""A claim as the worker's outcome decisions see it, and an action's context, for unit tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from worker.actions import ActionContext
from worker.store import Claim

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def claim_at(attempt: int = 1, spent: float | None = None) -> Claim:
    """A claim `spent` seconds after the key's first failure (None: it never failed)."""
    return Claim(
        key="k",
        fence=1,
        token="t",
        attempt=attempt,
        correlation_id="c",
        route="crm",
        source="s",
        event_type="crm.lead",
        external_id="1",
        version=None,
        payload={},
        locked_until=T0 + timedelta(seconds=30),
        claimed_at=T0,
        first_failed_at=None if spent is None else T0 - timedelta(seconds=spent),
        previous_status="pending",
        previous_error_code=None,
        uncertain=False,
    )


def action_context(correlation_id: str = "c", uncertain: bool = False) -> ActionContext:
    """The context of an action on a CRM lead's key, outside any attempt (no lease held)."""
    return ActionContext(
        key="crm:lead:1",
        correlation_id=correlation_id,
        attempt=1,
        source="crm",
        event_type="crm.lead",
        external_id="1",
        version=None,
        payload={"name": "Ada"},
        uncertain=uncertain,
    )
