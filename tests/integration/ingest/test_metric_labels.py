"""Metric labels come from the configuration, never from a sender: events of 300 made-up
event types add one series to the receiver's metrics, not 300."""

from __future__ import annotations

import uuid
from collections import defaultdict
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from outbox.core.routes import load_routes
from tests.support import Stack, envelope, query, wait_until

EVENTS = 300


def _series(text: str) -> dict[str, set[tuple[tuple[str, str], ...]]]:
    """Each family's distinct label sets (a histogram's buckets and sums count once)."""
    found: dict[str, set[tuple[tuple[str, str], ...]]] = defaultdict(set)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            found[family.name].add(labels)
    return found


def _label_values(text: str) -> set[str]:
    return {
        value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        for value in sample.labels.values()
    }


def test_made_up_event_types_fold_into_one_label(stack: Stack, routes_file: Path) -> None:
    """300 unsigned events, each of a new event type (taken by the catch-all route): the
    receiver's and the worker's metrics name none of them, and `idem_events_accepted` has at
    most one series per event type the routes file names, plus `other`."""
    # The event types the file names exactly (no glob characters).
    named = {r.match for r in load_routes(routes_file).routes if not set(r.match) & set("*?[")}
    made_up = {f"probe.{uuid.uuid4().hex[:12]}" for _ in range(EVENTS)}
    with stack.client() as client:
        for n, event_type in enumerate(sorted(made_up)):
            answer = client.post("/v1/events", json=envelope(f"label-{n}", event_type=event_type))
            assert answer.status_code == 202, answer.text
    wait_until(
        lambda: (
            query(
                stack.database_url,
                "SELECT count(*) FROM idempotency_keys WHERE status = 'succeeded'",
            )
            == [(EVENTS,)]
        ),
        timeout=60,
    )
    receiver = httpx.get(f"{stack.url}/metrics", timeout=5).text
    worker = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['worker']}/metrics", timeout=5).text
    accepted = _series(receiver)["idem_events_accepted"]
    assert ("event_type", "other") in {labels[0] for labels in accepted if labels}
    assert len(accepted) <= len(named) + 1, sorted(accepted)[:5]
    assert not made_up & (_label_values(receiver) | _label_values(worker))
    routes = {route.label for route in load_routes(routes_file).routes} | {"other"}
    action_routes = {dict(labels)["route"] for labels in _series(worker)["idem_action_seconds"]}
    assert action_routes <= routes
