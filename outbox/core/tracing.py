"""Tracing with OpenTelemetry: one trace per event, from the receiver into the downstream.

Off unless the standard variables ask for it (`OTEL_TRACES_EXPORTER`, or an OTLP endpoint in
`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), and then only with the
`otel` extra installed. The hot paths (accept, the relay's batch, an attempt) call into this
module whatever the configuration, so each entry point begins with one look at a module global;
with tracing off nothing of OpenTelemetry's SDK or instrumentations is imported by this module,
and no span, carrier or header is built.

Where the trace goes (docs/explanation/architecture.md, "Tracing"):
- the receiver's HTTP server span (the ASGI instrumentation around the event paths, which take
  a path ahead of FastAPI's own tracing) continues an incoming `traceparent` or starts the
  trace, and its context is stored with the event (`events.trace_context`, written by the
  accept statement);
- the relay reads the stored context with its batch and makes a messaging `send` span per
  message, a child of it, whose context travels in the Celery message's headers;
- every attempt is a `process` span, a child of (and linked to) that send span, named after the
  route; a retry or a sweeper's re-drive is published again from the stored context, so an
  attempt hours later is in the same trace;
- the HTTP instrumentation of the worker's client makes the client span and injects its
  `traceparent` into the downstream request (after signing: the signature covers the body, the
  id and the timestamp only).
"""

from __future__ import annotations

import contextvars
import json
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

from outbox.core.logs import get_logger
from outbox.core.redaction import url_masked

if TYPE_CHECKING:
    import httpx
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer
    from starlette.types import ASGIApp, Receive, Scope, Send

log = get_logger(__name__)

# The propagation fields kept with an event: the trace context only, never baggage (which may
# carry what a sender put there, and is not ours to store).
STORED_FIELDS = ("traceparent", "tracestate")
# Requests that are no event's: probes and scrapes would each start a trace.
UNTRACED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# `messaging.system`: the semantic conventions name no value for Celery's Redis transport.
MESSAGING_SYSTEM = "celery"

_provider: TracerProvider | None = None
_tracer: Tracer | None = None
# `http.request.resend_count` of the request an action is about to send (attempt - 1).
_resend_count: contextvars.ContextVar[int] = contextvars.ContextVar("resend_count", default=0)


def requested(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard variables ask for traces (OpenTelemetry's own meaning of them)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def enabled() -> bool:
    return _tracer is not None


def untraced(scope: MutableMapping[str, Any]) -> bool:
    """FastAPI's own tracing skips these requests (its `telemetry` setting `exclude`)."""
    return scope.get("path") in UNTRACED_PATHS


def setup(service: str) -> bool:
    """Install the SDK's tracer provider for this process when the environment asks for it.

    `service` is the default `service.name` (OTEL_SERVICE_NAME wins). Spans leave in batches
    (OTEL_BSP_* variables); `shutdown` flushes them when the process stops."""
    global _provider, _tracer
    if _tracer is not None or not requested():
        return _tracer is not None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("tracing.unavailable", hint="pip install 'idem-gateway[otel]'")
        return False
    # The stable HTTP conventions (`http.request.method`, `url.full`, `http.request.resend_count`)
    # rather than the instrumentations' older default; set before any instrumentation reads it.
    os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "http")
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
    for exporter in _exporters():
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider, _tracer = provider, provider.get_tracer("idem-gateway")
    log.info("tracing.enabled", service=os.environ.get("OTEL_SERVICE_NAME") or service)
    return True


def _exporters() -> list[Any]:
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(",")]
    exporters: list[Any] = []
    for name in names:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
            )
            if protocol != "http/protobuf":
                log.warning("tracing.protocol_unsupported", protocol=protocol, used="http/protobuf")
            exporters.append(OTLPSpanExporter())
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        elif name and name != "none":
            log.warning("tracing.exporter_unknown", exporter=name)
    return exporters


def shutdown() -> None:
    """Flush the spans still queued and stop exporting (a process's last step)."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
        _provider, _tracer = None, None


def flush() -> None:
    """Send the spans still queued, for a process that ends without running `shutdown`
    (a prefork pool's child)."""
    if _provider is not None:
        _provider.force_flush()


# The receiver.


def instrument_asgi(app: ASGIApp, route_of: Callable[[str], str | None]) -> ASGIApp:
    """The app with the ASGI instrumentation's HTTP server span around the event paths, when
    tracing is on. `route_of(path)` names an event path's route (`http.route`), else None.

    The events and webhooks take a path ahead of the framework (outbox/ingest/fastpath.py), so
    FastAPI's own tracing, which names every other request's server span after its route,
    never sees them; the instrumentation wraps those requests only, so no request gets two
    server spans."""
    if _tracer is None:
        return app
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    def span_details(scope: dict[str, Any]) -> tuple[str, dict[str, str]]:
        route = route_of(scope.get("path") or "") or ""
        return f"{scope.get('method') or 'HTTP'} {route}", {"http.route": route}

    traced = OpenTelemetryMiddleware(
        app,
        default_span_details=span_details,
        # One span per request: the body's chunks and the answer's parts add nothing.
        exclude_spans=["receive", "send"],
    )

    async def receiver(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_of(scope["path"]) is not None:
            await traced(scope, receive, send)
        else:
            await app(scope, receive, send)

    return receiver


def context_to_store() -> str | None:
    """The current span's W3C context as stored with an event; None with tracing off."""
    if _tracer is None:
        return None
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    kept = {name: carrier[name] for name in STORED_FIELDS if name in carrier}
    return json.dumps(kept, separators=(",", ":")) if kept else None


def _stored(stored: str | None) -> dict[str, str]:
    """The carrier an event's stored context was written from; empty when none or unreadable."""
    if not stored:
        return {}
    try:
        carrier = json.loads(stored)
    except ValueError:
        return {}
    if not isinstance(carrier, dict):
        return {}
    return {k: v for k, v in carrier.items() if k in STORED_FIELDS and isinstance(v, str)}


# The relay.


class Sends:
    """The `send` spans of one batch: each a child of its event's stored context, each ended
    once the batch is in the broker (or failed with it)."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        self._spans: list[Span] = []

    def start(self, stored: str | None, destination: str, message_id: str) -> dict[str, str]:
        """Start one message's span; returns the headers that carry its context."""
        from opentelemetry import propagate, trace

        parent = propagate.extract(_stored(stored))
        span = self._tracer.start_span(
            f"send {destination}",
            context=parent,
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "messaging.system": MESSAGING_SYSTEM,
                "messaging.operation.name": "send",
                "messaging.operation.type": "send",
                "messaging.destination.name": destination,
                "messaging.message.id": message_id,
            },
        )
        self._spans.append(span)
        headers: dict[str, str] = {}
        propagate.inject(headers, context=trace.set_span_in_context(span))
        return {name: headers[name] for name in STORED_FIELDS if name in headers}

    def end(self, error: BaseException | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        for span in self._spans:
            if error is not None:
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            span.end()
        self._spans.clear()


def batch_sends() -> Sends | None:
    """Spans for one batch of messages; None with tracing off."""
    return None if _tracer is None else Sends(_tracer)


# The worker.


Outcome = TypeVar("Outcome", bound=str)


def traced_attempt(
    headers: Callable[[str], Any],
    destination: str,
    message_id: str,
    run: Callable[[], Outcome],
) -> Outcome:
    """Run one attempt (`run`, returning its outcome's name) inside its `process` span.

    `headers(name)` reads the delivered message's header; the span's parent and link is the
    relay's send span carried there. The route is named later, once the claim knows it
    (`attempt_route`)."""
    if _tracer is None:
        return run()
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, Status, StatusCode

    carrier = {name: value for name in STORED_FIELDS if isinstance(value := headers(name), str)}
    parent = propagate.extract(carrier)
    sent = trace.get_current_span(parent).get_span_context()
    with _tracer.start_as_current_span(
        f"process {destination}",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        links=[Link(sent)] if sent.is_valid else None,
        attributes={
            "messaging.system": MESSAGING_SYSTEM,
            "messaging.operation.name": "process",
            "messaging.operation.type": "process",
            "messaging.destination.name": destination,
            "messaging.message.id": message_id,
        },
    ) as span:
        outcome = run()
        span.set_attribute("idem.attempt.outcome", outcome)
        if outcome in ("retry", "dead_letter"):
            span.set_status(Status(StatusCode.ERROR, outcome))
        return outcome


def attempt_route(route: str, attempt: int) -> None:
    """Name the attempt's span after its route (`messaging.destination.name`), known once the
    key is claimed."""
    if _tracer is None:
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    span.update_name(f"process {route}")
    span.set_attribute("messaging.destination.name", route)
    span.set_attribute("idem.attempt", attempt)


def set_resend_count(resends: int) -> None:
    """The action's request about to be sent is its key's `resends`-th resend (attempt - 1);
    set in the action's own thread, so the reconcile lookup before it counts as none."""
    _resend_count.set(resends)


def traced_transport(transport: httpx.BaseTransport) -> httpx.BaseTransport:
    """The HTTP instrumentation's client span around each request the transport sends,
    `traceparent` injected; the transport itself when tracing is off."""
    if _tracer is None:
        return transport
    from opentelemetry.instrumentation.httpx import SyncOpenTelemetryTransport

    return SyncOpenTelemetryTransport(transport, request_hook=_request_hook)


def _request_hook(span: Span, request: Any) -> None:
    if not span.is_recording():
        return
    # A route's URL may hold a credential in its query (`?api_key=…`); the instrumentation
    # masks the userinfo only, so the span keeps the URL with every query value masked, as
    # the logs keep no URL at all.
    span.set_attribute("url.full", url_masked(str(request.url)))
    # Set only on a resend, as the conventions ask (the first request has none).
    resends = _resend_count.get()
    if resends > 0:
        span.set_attribute("http.request.resend_count", resends)
