"""Unit tests for the chaos soak's fan-out share: the plan gives it events whose deliveries
misbehave each by its own key, and the checker finds a delivery lost, doubled, unfinished,
misfiled or orphaned, and an event whose status disagrees with its deliveries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.chaos import check, fan_out, fan_out_check, plan

SEED = 4242


@pytest.fixture(scope="module")
def fanned() -> list[plan.PlannedEvent]:
    events, _ = plan.plan_events(SEED, 450, 45.0)
    return [e for e in events if e.fanned_out]


def test_a_share_of_the_lead_events_fans_out_the_first_with_one_refused_delivery(
    fanned: list[plan.PlannedEvent],
) -> None:
    """About 11 % of 450 events; each names the three destinations with its delivery keys'
    own behaviours; the first meets exactly one 422, so even a short run ends one event
    `partially_failed`."""
    assert 25 <= len(fanned) <= 75
    assert all(e.event_type == fan_out.EVENT_TYPE and e.via == plan.VIA_EVENTS for e in fanned)
    for event in fanned:
        assert list(event.destinations) == list(fan_out.DESTINATIONS)
        for name, key in fan_out.delivery_keys(event.key).items():
            collection = fan_out.DESTINATIONS[name]
            assert event.destinations[name] == plan.behaviour_at(SEED, key, collection)
    first = [b.kind for b in fanned[0].destinations.values()]
    assert first.count(plan.INVALID) == 1
    assert fan_out_check.expected_status(fanned[0]) == "partially_failed"


def _perfect(
    events: list[plan.PlannedEvent],
) -> tuple[dict[str, Any], check.DbState, dict[str, Any]]:
    """The CRM, the database and the answers to GET after a run that broke nothing."""
    crm: dict[str, Any] = {"effects": {}, "refs": {}, "posts": {}}
    keys: dict[str, dict[str, Any]] = {}
    dead: dict[str, list[tuple[str, str]]] = {}
    views: dict[str, Any] = {}
    for event in events:
        keys[event.key] = _row("fanned_out", fan_out.ROUTE)
        listed = []
        for name, key in fan_out.delivery_keys(event.key).items():
            kind = event.destinations[name].kind
            row = _row("succeeded", name, event_key=event.key, destination=name)
            if kind == plan.INVALID:
                row["status"] = "failed_final"
                dead[key] = [("permanent", "http_422")]
            else:
                crm["effects"][key] = 1
                crm["refs"][key] = row["external_ref"] = f"crm-{key}"
                row["result"] = {"reconciled": kind in plan.ANSWER_LOST}
            keys[key] = row
            listed.append({"key": key, "status": row["status"]})
        views[event.key] = {
            "status": fan_out_check.expected_status(event),
            "deliveries": listed,
        }
    payloads = {e.key: e.payload for e in events}
    outbox = {k for k, row in keys.items() if row["event_key"]}
    db = check.DbState(keys, payloads, dead, outbox, 0, 0, len(outbox), {})
    return crm, db, views


def _row(status: str, route: str, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "status": status,
        "route": route,
        "attempts": 1,
        "error_code": None,
        "external_ref": None,
        "result": None,
        "event_key": None,
        "destination": None,
    }
    return {**row, **fields}


def _break_nothing(crm: dict[str, Any], db: check.DbState, views: dict[str, Any], key: str) -> None:
    pass


def _double(crm: dict[str, Any], db: check.DbState, views: dict[str, Any], key: str) -> None:
    crm["effects"][key] = 2


def _lose(crm: dict[str, Any], db: check.DbState, views: dict[str, Any], key: str) -> None:
    del db.keys[key]


def _stall(crm: dict[str, Any], db: check.DbState, views: dict[str, Any], key: str) -> None:
    db.keys[key]["status"] = "processing"


def _misfile(crm: dict[str, Any], db: check.DbState, views: dict[str, Any], key: str) -> None:
    db.keys[key]["destination"] = "orders-mail"


def _orphan(crm: dict[str, Any], db: check.DbState, views: dict[str, Any], key: str) -> None:
    db.keys[key + "x"] = {**db.keys[key], "event_key": "chaos:gone"}


def _misreport(crm: dict[str, Any], db: check.DbState, views: dict[str, Any], key: str) -> None:
    event_key = db.keys[key]["event_key"]
    views[event_key]["status"] = "failed_final"


@pytest.mark.parametrize(
    ("breaks", "caught"),
    [
        (_break_nothing, set()),
        (_double, {"duplicate_effect"}),
        (_lose, {"key_missing", "fan_out_status_mismatch", "fan_out_view_deliveries"}),
        (_stall, {"key_unfinished", "fan_out_status_mismatch", "fan_out_view_deliveries"}),
        (_misfile, {"delivery_misfiled", "orphan_delivery"}),
        (_orphan, {"orphan_delivery"}),
        (_misreport, {"fan_out_status_mismatch"}),
    ],
)
def test_the_checker_finds_what_breaks_a_delivery_or_its_event(
    fanned: list[plan.PlannedEvent],
    breaks: Callable[[dict[str, Any], check.DbState, dict[str, Any], str], None],
    caught: set[str],
) -> None:
    """A run that broke nothing has no violation; each way of breaking one delivery (of an
    event whose deliveries all succeed) is reported under its own name."""
    crm, db, views = _perfect(fanned)
    healthy = next(e for e in fanned if fan_out_check.expected_status(e) == "succeeded")
    breaks(crm, db, views, fan_out.delivery_keys(healthy.key)["orders-ledger"])
    violations = check.Violations()
    facts = fan_out_check.verify_fan_out(fanned, crm, db, views, violations)
    assert set(violations.counts) == caught, violations.as_dict()
    assert facts["events"] == len(fanned)
