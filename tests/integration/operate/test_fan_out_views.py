"""Operators per destination on the shared stack: dead letters, stats, metrics, routes, the
console and `idem` show and filter by destination; a fan-out route lists its destinations and
refuses a pause (its destinations are paused instead). The events are stored by the
receiver's own statement without outbox rows, so nothing runs them and they stay as seeded."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import quote

import httpx

from outbox.core.keys import delivery_key, mask_key
from tests.integration.operate.test_console import _session_client
from tests.support import AUTH, Stack, query, run_idem, seed_fan_out_event, seed_lane_key

BILLING = ["books", "finance-flow", "notify"]


def _get(stack: Stack, path: str, **params: Any) -> httpx.Response:
    with stack.client() as client:
        return client.get(path, params=params, headers=AUTH)


def _post(stack: Stack, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    with stack.client() as client:
        return client.post(path, json=body, headers=AUTH)


def _seed(stack: Stack) -> tuple[str, str]:
    """Two billing events (one with notify dead-lettered and finance-flow pending, one with
    books dead-lettered) and a plain dead letter of route crm."""
    db = stack.database_url
    first = seed_fan_out_event(
        db, "inv-1", {"books": "succeeded", "finance-flow": "pending", "notify": "failed_final"}
    )
    second = seed_fan_out_event(
        db, "inv-2", {"books": "failed_final", "finance-flow": "succeeded", "notify": "succeeded"}
    )
    seed_lane_key(db, "plain-1", "failed_final", lane="c-1", rank=1, error_code="http_422")
    return first, second


def _counts(**nonzero: int) -> dict[str, int]:
    """A destination's counts in `/v1/stats`: these, and 0 for the others."""
    names = ("pending", "processing", "failed_retryable", "failed_final", "quarantined")
    return dict.fromkeys((*names, "open_dead_letters"), 0) | nonzero


def _metric(text: str, name: str, **labels: str) -> float | None:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(wanted)}\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def test_dead_letters_stats_and_metrics_by_destination(stack: Stack) -> None:
    first, second = _seed(stack)
    notify = _get(stack, "/v1/dead-letters", destination="notify").json()["items"]
    assert [(d["key"], d["destination"], d["route"]) for d in notify] == [
        (delivery_key(first, "notify"), "notify", "notify")
    ]
    books = _get(stack, "/v1/dead-letters", destination="books").json()["items"]
    assert [d["key"] for d in books] == [delivery_key(second, "books")]
    every = _get(stack, "/v1/dead-letters").json()["items"]
    assert sorted(str(d["destination"]) for d in every) == ["None", "books", "notify"]
    assert _get(stack, "/v1/dead-letters", destination="archive").json()["items"] == []

    numbers = _get(stack, "/v1/stats").json()
    assert numbers["keys_by_status"]["fanned_out"] == 2
    assert numbers["keys_by_status"]["pending"] == 1  # finance-flow's: no event is pending work
    assert numbers["keys_by_status"]["failed_final"] == 3
    assert numbers["keys_by_status"]["succeeded"] == 3
    assert numbers["destinations"] == {
        "archive": _counts(),
        "books": _counts(failed_final=1, open_dead_letters=1),
        "finance-flow": _counts(pending=1),
        "ledger-sync": _counts(),
        "notify": _counts(failed_final=1, open_dead_letters=1),
    }
    assert numbers["open_dead_letters"]["permanent"] == 3

    scraped = httpx.get(f"{stack.url}/metrics", timeout=5).text
    assert _metric(scraped, "idem_keys", status="fanned_out") == 2
    assert _metric(scraped, "idem_keys_estimated", status="fanned_out") == 0
    assert (
        _metric(scraped, "idem_destination_keys", destination="finance-flow", status="pending") == 1
    )
    assert _metric(scraped, "idem_destination_dead_letters_open", destination="notify") == 1
    assert _metric(scraped, "idem_destination_dead_letters_open", destination="archive") == 0
    assert _metric(scraped, "idem_route_state", route="notify", state="closed") == 1
    assert _metric(scraped, "idem_route_state", route="billing", state="closed") is None


def test_routes_list_destinations_and_a_fan_out_route_refuses_a_pause(stack: Stack) -> None:
    listed = {item["name"]: item for item in _get(stack, "/v1/routes").json()["items"]}
    billing = listed["billing"]
    assert (billing["kind"], billing["action"], billing["fan_out"]) == ("fan_out", "none", BILLING)
    assert (billing["state"], billing["in_flight"], billing["backlog"]) == ("fans_out", None, None)
    assert listed["crm"]["kind"] == "route"
    assert (listed["books"]["kind"], listed["books"]["routes"]) == (
        "destination",
        ["billing", "accounts", "stripe-charges"],
    )
    assert (listed["archive"]["routes"], listed["archive"]["state"]) == ([], "closed")

    for action in ("pause", "resume"):
        refused = _post(
            stack, f"/v1/routes/billing/{action}", {"reason": "x"} if action == "pause" else None
        )
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"] == "route_fans_out"
        assert refused.json()["destinations"] == BILLING
        assert "books, finance-flow, notify" in refused.json()["detail"]
    assert query(stack.database_url, "SELECT route FROM route_state WHERE route = 'billing'") == []
    assert query(stack.database_url, "SELECT count(*) FROM route_changes") == [(0,)]

    paused = _post(stack, "/v1/routes/notify/pause", {"reason": "channel migration"})
    assert paused.status_code == 200 and paused.json()["changed"] is True, paused.text
    shown = {item["name"]: item for item in _get(stack, "/v1/routes").json()["items"]}
    assert shown["notify"]["state"] == "paused" and shown["books"]["state"] == "closed"
    assert _post(stack, "/v1/routes/notify/resume").status_code == 200

    # A pause recorded under the route's name before it fanned out can still be lifted.
    query(stack.database_url, "INSERT INTO route_state (route, paused) VALUES ('billing', true)")
    lifted = _post(stack, "/v1/routes/billing/resume")
    assert lifted.status_code == 200 and lifted.json()["changed"] is True, lifted.text

    with _session_client(stack) as client:
        overview = client.get("/console").text
        csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', overview)
        assert csrf is not None
        page = client.post(
            "/console/routes/billing/pause", data={"reason": "x", "csrf": csrf.group(1)}
        )
    assert page.status_code == 409 and "fans out to books, finance-flow, notify" in page.text
    routes = overview[overview.index('id="routes-heading"') : overview.index('id="chart-heading"')]
    assert "/console/routes/notify/pause" in routes and "/console/routes/books/pause" in routes
    assert "/console/routes/billing/pause" not in routes
    assert (
        "fans out to <code>books</code>, <code>finance-flow</code>, <code>notify</code>" in routes
    )
    assert "destination of billing, accounts, stripe-charges" in routes


def test_the_console_shows_an_events_deliveries_and_filters_by_destination(stack: Stack) -> None:
    first, _ = _seed(stack)
    notify = delivery_key(first, "notify")
    with _session_client(stack) as client:
        event_page = client.get("/console/keys", params={"key": first}).text
        delivery_page = client.get("/console/keys", params={"key": notify}).text
        listed = client.get("/console/dead-letters", params={"destination": "notify"}).text
        letter = re.search(r'href="/console/dead-letters/(\d+)"', listed)
        assert letter is not None
        letter_page = client.get(f"/console/dead-letters/{letter.group(1)}").text
        overview = client.get("/console").text
        csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', overview)
        assert csrf is not None
        dry = client.post(
            "/console/replays/dry-run",
            data={
                "csrf": csrf.group(1),
                "destination": "notify",
                "statuses": "failed_final",
                "limit": "100",
            },
        )
    # The event: its deliveries' status, one row per destination linking to its delivery.
    assert "processing" in event_page and "a fan-out event" in event_page
    rows = event_page[event_page.index('id="deliveries-heading"') :]
    for name, status in (("books", "succeeded"), ("finance-flow", "pending"), ("notify", "")):
        assert f"<td><code>{name}</code></td>" in rows
        assert f"/console/keys?key={quote(delivery_key(first, name), safe='/')}" in rows
        assert status in rows
    assert "failed (final)" in rows and "<code>http_422</code>" in rows
    assert 'id="attempts-heading"' not in event_page  # the event runs nothing itself
    # The delivery: back to its event.
    assert "Delivery of event" in delivery_page
    assert f'href="/console/keys?key={quote(first, safe="/")}"' in delivery_page
    # The dead letters of one destination, and one of them with its event.
    assert len(re.findall(r">Dead letter \d+</a>", listed)) == 1
    assert "<code>notify</code>" in listed and mask_key(notify) in listed
    assert (
        "Event</dt>" in letter_page and "<dt>Destination</dt><dd><code>notify</code>" in letter_page
    )
    # The replay form takes a destination, and the confirm form carries it.
    assert dry.status_code == 200, dry.text
    assert mask_key(notify) in dry.text and mask_key(delivery_key(first, "books")) not in dry.text
    assert '<input type="hidden" name="destination" value="notify">' in dry.text
    # The overview counts deliveries by destination, linked to their dead letters.
    section = overview[overview.index('id="destinations-heading"') :]
    assert "/console/dead-letters?status=open&amp;destination=notify" in section


def test_the_commands_show_and_filter_by_destination(stack: Stack) -> None:
    first, _ = _seed(stack)
    env = {**stack.env(), "COLUMNS": "250", "USER": "tester"}

    def idem(*args: str) -> Any:
        return run_idem(*args, env=env)

    listed = idem("dlq", "list", "--destination", "notify", "--json")
    assert listed.returncode == 0, listed.stderr
    items = json.loads(listed.stdout)["items"]
    assert [(d["key"], d["destination"]) for d in items] == [
        (delivery_key(first, "notify"), "notify")
    ]

    shown = idem("show", first, "--json")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert (doc["status"], doc["attempts"]) == ("processing", [])
    assert [(d["destination"], d["status"], d["key"]) for d in doc["deliveries"]] == [
        ("books", "succeeded", delivery_key(first, "books")),
        ("finance-flow", "pending", delivery_key(first, "finance-flow")),
        ("notify", "failed_final", delivery_key(first, "notify")),
    ]
    delivery = idem("show", delivery_key(first, "notify"))
    assert delivery.returncode == 0, delivery.stderr
    assert f"delivery to notify of event {first}" in delivery.stdout

    refused = idem("routes", "pause", "billing", "--reason", "month-end")
    assert refused.returncode == 2
    assert "fans out to books, finance-flow, notify" in refused.stderr
    assert "pause its destinations" in refused.stderr
