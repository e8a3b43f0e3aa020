"""Tracing's switch and its stored context, without any collector."""

from __future__ import annotations

import subprocess
import sys

import pytest

from outbox.core import tracing
from outbox.ingest.fastpath import event_route
from tests.support import ROOT


@pytest.mark.parametrize(
    ("env", "wanted"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": ""}, False),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
    ],
)
def test_only_the_standard_variables_switch_tracing_on(env: dict[str, str], wanted: bool) -> None:
    """Tracing is on when an OTLP endpoint or an exporter other than none is named, and the
    SDK is not disabled."""
    assert tracing.requested(env) is wanted


def test_with_tracing_off_nothing_is_stored_and_no_sdk_is_loaded() -> None:
    """Off, the receiver stores no context and its process never imports the tracing SDK or an
    instrumentation (redis-py's own optional metrics import aside)."""
    assert tracing.context_to_store() is None
    code = (
        "import sys; from outbox.app import create_server; app = create_server(); "
        "print(type(app).__name__, sorted(m for m in sys.modules if m.startswith("
        "('opentelemetry.sdk.trace', 'opentelemetry.instrumentation', 'opentelemetry.exporter'))))"
    )
    env = {"DATABASE_URL": "postgresql://idem@127.0.0.1:1/idem", "REDIS_URL": "redis://127.0.0.1:1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip().splitlines()[-1] == "Receiver []", done.stderr


@pytest.mark.parametrize(
    ("stored", "carrier"),
    [
        (None, {}),
        ("", {}),
        ("not json", {}),
        ("[1]", {}),
        ('{"traceparent": "00-a-b-01", "baggage": "user=1"}', {"traceparent": "00-a-b-01"}),
        (
            '{"traceparent": "00-a-b-01", "tracestate": "k=v"}',
            {"traceparent": "00-a-b-01", "tracestate": "k=v"},
        ),
    ],
)
def test_a_stored_context_is_read_back_as_trace_context_only(
    stored: str | None, carrier: dict[str, str]
) -> None:
    """What the relay reads back is the W3C trace context and nothing else; anything unreadable
    starts the span without a parent rather than failing the publish."""
    assert tracing._stored(stored) == carrier


@pytest.mark.parametrize(
    ("path", "route"),
    [
        ("/v1/events", "/v1/events"),
        ("/v1/webhooks/stripe", "/v1/webhooks/{source}"),
        ("/v1/webhooks/", None),
        ("/v1/webhooks/a/b", None),
        ("/v1/events/webform:abc", None),
        ("/healthz", None),
    ],
)
def test_event_paths_are_named_by_their_route(path: str, route: str | None) -> None:
    """The server span of an event path is named after its route, never its raw path."""
    assert event_route(path) == route


def test_a_route_urls_query_credential_never_reaches_a_client_span() -> None:
    """The worker's HTTP client span keeps the route's URL with its userinfo and every query
    value masked: `?api_key=…` stays out of `url.full` (a real SDK, console exporter, the
    request answered in-process)."""
    code = (
        "import httpx; from outbox.core import tracing; tracing.setup('test'); "
        "client = httpx.Client(transport=tracing.traced_transport("
        "httpx.MockTransport(lambda r: httpx.Response(204)))); "
        "client.post('https://ops:pw-77@crm.example/v1/leads?api_key=key-SECRET-1&x=2'); "
        "tracing.shutdown()"
    )
    env = {"OTEL_TRACES_EXPORTER": "console", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert '"url.full": "https://[redacted]@crm.example/v1/leads?api_key=' in done.stdout
    assert "key-SECRET-1" not in done.stdout and "pw-77" not in done.stdout
