"""The http action builds its request before sending it: what cannot be built is the key's own
permanent failure, raised before any connection is opened."""

from __future__ import annotations

import socket

import pytest

from outbox.core.routes import Route
from worker.actions import ActionContext, http
from worker.errors import RequestInvalid, classify


def _closed_port() -> int:
    """A local port nobody listens on: a request that got as far as connecting would fail
    with a connection error there, not with RequestInvalid."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _context(correlation_id: str) -> ActionContext:
    return ActionContext(
        key="crm:lead:1",
        correlation_id=correlation_id,
        attempt=1,
        source="crm",
        event_type="crm.lead",
        external_id="1",
        version=None,
        payload={"name": "Ada"},
    )


@pytest.mark.parametrize("correlation_id", ["café-1", "line\r\nX-Injected: 1"])
def test_a_header_that_cannot_be_sent_is_the_keys_permanent_failure(correlation_id: str) -> None:
    """A correlation id stored before intake checked it (not ASCII, or with CR/LF) makes the
    event's request unbuildable: a permanent `request_invalid` of that key, marked local so the
    route's breaker never hears of it, and no connection is attempted."""
    route = Route(
        match="crm.*",
        action="http",
        url=f"http://127.0.0.1:{_closed_port()}/tasks",
        reconcile_url=f"http://127.0.0.1:{_closed_port()}/tasks/{{key}}",
    )
    for call in (http.run, http.reconcile):
        with pytest.raises(Exception) as raised:
            call(route, _context(correlation_id))
        failure = classify(raised.value)
        assert (failure.error_code, failure.transient, failure.local) == (
            "request_invalid",
            False,
            True,
        ), raised.value
        assert isinstance(raised.value, RequestInvalid)
