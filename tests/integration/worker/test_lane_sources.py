"""Lanes belong to their sources: another source's huge version of the same object cannot
supersede a source's updates, while the sources a route names share their lanes (real
receiver, relay and worker; the downstream records what it applied)."""

from __future__ import annotations

from pathlib import Path

from tests.integration.worker.test_lanes import (
    Recorder,
    _accepted,
    _common,
    _settled,
    _started,
    _states,
)
from tests.support import Downstream, Stack, query, wait_until


def _routes(path: Path, url: str) -> None:
    common = _common(url) + 'order_by = "/contact/id"\nversions = "supersede"\n'
    path.write_text(
        f"""
[[routes]]
match = "contact.*"
name = "contacts"
{common}
[[routes]]
match = "account.*"
name = "accounts"
sources = ["crm", "erp"]
{common}
""",
        encoding="utf-8",
    )


def _send_as(stack: Stack, source: str, event_type: str, obj: str, version: int) -> str:
    body = {
        "source": source,
        "event_type": event_type,
        "external_id": f"{obj}-{version}",
        "payload": {"contact": {"id": obj}, "v": version},
        "version": version,
    }
    with stack.client() as client:
        answer = client.post("/v1/events", json=body)
    assert answer.status_code == 202, answer.text
    key: str = answer.json()["key"]
    return key


def test_another_sources_huge_version_cannot_supersede_a_sources_updates(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """An unsigned source sends version 10^18 of customer-1 on a route open to any source;
    the genuine source's version 5 of customer-1 still runs (each source's lane is its own,
    named `<source>:<object>`)."""
    stack, routes = protected
    _routes(routes, downstream.url)
    _started(stack)
    recorder = Recorder(downstream, delay=0.0)
    squat = _send_as(stack, "intruder", "contact.updated", "customer-1", 10**18)
    recorder.sent(squat, "customer-1", 10**18)
    wait_until(lambda: _settled(stack, [squat]), timeout=30)
    genuine = _accepted(stack, recorder, "contact.updated", "customer-1", 5)
    wait_until(lambda: _settled(stack, [genuine]), timeout=30)
    assert _states(stack, [genuine])[genuine] == ("succeeded", None)
    assert sorted(recorder.applied["customer-1"]) == [5, 10**18]
    lanes = query(stack.database_url, "SELECT lane FROM idempotency_keys WHERE route = 'contacts'")
    assert sorted(lane for (lane,) in lanes) == ["crm:customer-1", "intruder:customer-1"]


def test_the_sources_a_route_names_share_its_lanes(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """On a route that names `sources = ["crm", "erp"]`, erp's version 10 of an account
    supersedes crm's later-sent version 5 of it: one lane, named by the object alone."""
    stack, routes = protected
    _routes(routes, downstream.url)
    _started(stack)
    recorder = Recorder(downstream, delay=0.0)
    newer = _send_as(stack, "erp", "account.updated", "a-1", 10)
    recorder.sent(newer, "a-1", 10)
    wait_until(lambda: _settled(stack, [newer]), timeout=30)
    older = _send_as(stack, "crm", "account.updated", "a-1", 5)
    recorder.sent(older, "a-1", 5)
    wait_until(lambda: _settled(stack, [older]), timeout=30)
    assert _states(stack, [older])[older] == ("superseded", "10")
    assert recorder.applied["a-1"] == [10]
    assert query(stack.database_url, "SELECT DISTINCT lane FROM idempotency_keys") == [("a-1",)]
