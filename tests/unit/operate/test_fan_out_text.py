"""What `idem routes`, `idem stats` and `idem show` print for fan-out routes, destinations and
events (the commands' database side is tested on the shared stack,
tests/integration/operate/test_fan_out_views.py)."""

from __future__ import annotations

import pytest

from outbox.operate.attempts import _print_deliveries
from outbox.operate.watch import _destination_counts, _shown


def test_a_fan_out_route_shows_its_destinations_and_a_destination_its_routes() -> None:
    fan_out = {"kind": "fan_out", "action": "none", "fan_out": ["books", "notify"]}
    assert _shown(fan_out) == {
        "kind": "fan-out",
        "does": "none, fans out to books, notify",
        "state": "—",
    }
    destination = {"kind": "destination", "action": "http", "routes": ["billing", "charges"]}
    assert _shown(destination) == {"does": "http (from billing, charges)"}
    assert _shown({**destination, "routes": []}) == {"does": "http (from no route)"}
    assert _shown({"kind": "route", "action": "noop"}) == {"does": "noop"}


def test_a_destinations_counts_name_only_what_is_there() -> None:
    counts = {"pending": 2, "processing": 0, "failed_final": 1, "open_dead_letters": 1}
    assert _destination_counts(counts) == "2 pending, 1 failed final, 1 open dead letters"
    assert _destination_counts(dict.fromkeys(counts, 0)) == "none"


def test_an_event_is_shown_with_one_row_per_delivery(capsys: pytest.CaptureFixture[str]) -> None:
    row = {"attempts": 1, "error_code": None, "updated_at": "2026-12-02T00:00:00+00:00"}
    _print_deliveries(
        {
            "status": "partially_failed",
            "deliveries": [
                {**row, "destination": "books", "key": "k @books", "status": "succeeded"},
                {
                    **row,
                    "destination": "notify",
                    "key": "k @notify",
                    "status": "failed_final",
                    "error_code": "http_422",
                },
            ],
        }
    )
    printed = capsys.readouterr().out
    assert "fan-out event, partially_failed: 2 deliveries" in printed
    for shown in ("books", "notify", "succeeded", "failed_final", "http_422", "2026-12-02"):
        assert shown in printed
