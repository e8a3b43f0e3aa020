"""The routes file's fan-out: `[[destinations]]` and `fan_out`, what a worker finds by a
delivery's label, the event's status read off its deliveries, and a delivery's key."""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox.core import fanout
from outbox.core.keys import delivery_key, mask_key
from outbox.core.routes import Destination, Route, RoutesError, RouteTable, load_routes
from outbox.core.settings import Settings
from outbox.core.timeouts import timing_problems

FAN_OUT = """
[[destinations]]
name = "crm"
action = "http"
url = "https://crm.example/leads"
max_in_flight = 4

[[destinations]]
name = "finance-flow"
action = "http"
kind = "n8n"
url = "http://n8n:5678/webhook/finance"
order_by = "/customer"

[[destinations]]
name = "slack"
action = "noop"

[[routes]]
match = "invoice.paid"
name = "invoice-paid"
sources = ["stripe"]
ttl_days = 7
fan_out = ["crm", "finance-flow", "slack"]

[[routes]]
match = "*"
name = "default"
action = "noop"
"""


def _load(tmp_path: Path, text: str) -> RouteTable:
    path = tmp_path / "routes.toml"
    path.write_text(text, encoding="utf-8")
    return load_routes(path)


def test_a_fan_out_route_names_its_destinations_and_acts_through_them(tmp_path: Path) -> None:
    table = _load(tmp_path, FAN_OUT)
    route = table.resolve("invoice.paid")
    assert isinstance(route, Route) and route.fan_out == ["crm", "finance-flow", "slack"]
    assert route.ttl_seconds == 7 * 86_400
    destinations = table.destinations_of(route)
    assert [d.name for d in destinations] == ["crm", "finance-flow", "slack"]
    # A delivery's label finds its destination's settings; the worker needs nothing else.
    crm = table.by_label("crm")
    assert isinstance(crm, Destination) and crm.max_in_flight == 4 and crm.action == "http"
    finance = table.by_label("finance-flow")
    assert finance is not None and finance.order_by == "/customer"
    # What may act: the routes that act themselves, then every destination.
    acting = [a.label for a in table.acting()]
    assert acting == ["default", "crm", "finance-flow", "slack"]
    # A first-match file without destinations works as before.
    other = table.resolve("other.thing")
    assert other is not None and other.label == "default"


@pytest.mark.parametrize(
    ("case", "text", "fragment"),
    [
        (
            "an acting setting on a fan-out route",
            '[[destinations]]\nname = "a"\naction = "noop"\n'
            '[[routes]]\nmatch = "x"\nfan_out = ["a"]\nurl = "http://x"\n',
            "`url`: a fan-out route only matches and names its destinations",
        ),
        (
            "an unknown destination",
            '[[routes]]\nmatch = "x"\nfan_out = ["nowhere"]\n',
            "`fan_out` names 'nowhere', no `[[destinations]]`",
        ),
        (
            "a destination named twice in one fan_out",
            '[[destinations]]\nname = "a"\naction = "noop"\n'
            '[[routes]]\nmatch = "x"\nfan_out = ["a", "a"]\n',
            "names a destination twice",
        ),
        (
            "an empty fan_out",
            '[[routes]]\nmatch = "x"\nfan_out = []\n',
            "routes.0.fan_out",
        ),
        (
            "two destinations of one name",
            '[[destinations]]\nname = "a"\naction = "noop"\n'
            '[[destinations]]\nname = "a"\naction = "noop"\n'
            '[[routes]]\nmatch = "x"\nfan_out = ["a"]\n',
            "two `[[destinations]]` have the same name",
        ),
        (
            "a destination with a route's name",
            '[[destinations]]\nname = "x"\naction = "noop"\n'
            '[[routes]]\nmatch = "x"\nfan_out = ["x"]\n',
            "destination 'x' has the name of a route",
        ),
        (
            "a destination name unfit for keys and labels",
            '[[destinations]]\nname = "Slack Alerts"\naction = "noop"\n'
            '[[routes]]\nmatch = "x"\naction = "noop"\n',
            "destinations.0.name",
        ),
        (
            "a route setting on a destination",
            '[[destinations]]\nname = "a"\naction = "noop"\nmatch = "x"\n'
            '[[routes]]\nmatch = "x"\naction = "noop"\n',
            "destinations.0.match",
        ),
        (
            "a destination without its action's settings",
            '[[destinations]]\nname = "a"\naction = "http"\n'
            '[[routes]]\nmatch = "x"\naction = "noop"\n',
            "an http route needs `url`",
        ),
    ],
)
def test_a_fan_out_mistake_is_a_routes_error_naming_it(
    tmp_path: Path, case: str, text: str, fragment: str
) -> None:
    with pytest.raises(RoutesError) as caught:
        _load(tmp_path, text)
    assert fragment in str(caught.value), case


def test_a_destination_s_timeouts_are_checked_against_the_lease(tmp_path: Path) -> None:
    text = (
        '[[destinations]]\nname = "slow"\naction = "http"\nurl = "http://x"\n'
        "read_timeout_seconds = 60\n"
        '[[routes]]\nmatch = "x"\nfan_out = ["slow"]\n'
    )
    problems = timing_problems(Settings(lease_seconds=30), _load(tmp_path, text))
    assert any("route 'slow'" in problem for problem in problems), problems


@pytest.mark.parametrize(
    ("deliveries", "status"),
    [
        ([], "pending"),
        (["pending", "pending"], "pending"),
        (["pending", "processing"], "processing"),
        (["succeeded", "failed_retryable"], "processing"),
        (["succeeded", "pending"], "processing"),
        (["succeeded", "succeeded", "superseded"], "succeeded"),
        (["succeeded", "failed_final"], fanout.PARTIALLY_FAILED),
        (["superseded", "quarantined"], fanout.PARTIALLY_FAILED),
        (["failed_final", "failed_final"], "failed_final"),
        (["failed_final", "processing"], "processing"),
    ],
)
def test_the_event_s_status_is_its_deliveries(deliveries: list[str], status: str) -> None:
    assert fanout.event_status(deliveries) == status
    assert status in fanout.EVENT_STATUSES


def test_a_delivery_key_is_stable_distinct_and_never_an_event_s() -> None:
    event = "stripe:webhook:" + "a" * 64
    assert delivery_key(event, "crm") == delivery_key(event, "crm") == f"{event} @crm"
    assert delivery_key(event, "crm") != delivery_key(event, "slack")
    # No event's key has a space (visible ASCII only), so none can be a delivery's.
    assert " " in delivery_key(event, "crm")
    # Masked like its event's key, with the destination kept.
    assert mask_key(delivery_key(event, "crm")) == f"{mask_key(event)} @crm"
