"""Tracing end to end: a real receiver, relay, worker (and sweeper) export their spans over
OTLP/HTTP to a receiver written here, which decodes them; one trace per event, into the
downstream's request."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import redis as redis_client
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

from outbox.core import standard_webhooks
from outbox.core.keys import delivery_key
from outbox.core.wire import TASK_QUEUE
from tests.support import (
    SIGNING_SECRET,
    Downstream,
    Reply,
    Stack,
    envelope,
    finished,
    query,
    wait_until,
)

SERVER, CLIENT = ProtoSpan.SPAN_KIND_SERVER, ProtoSpan.SPAN_KIND_CLIENT
PRODUCER, CONSUMER = ProtoSpan.SPAN_KIND_PRODUCER, ProtoSpan.SPAN_KIND_CONSUMER


@dataclass(frozen=True)
class Received:
    """One span as the collector got it."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    links: tuple[str, ...]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


@dataclass
class Collector:
    """An OTLP/HTTP trace receiver: `POST /v1/traces` with an ExportTraceServiceRequest."""

    spans: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    port: int = 0

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    received = Received(
                        service=resource.get("service.name", ""),
                        name=span.name,
                        kind=span.kind,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        links=tuple(link.span_id.hex() for link in span.links),
                    )
                    with self.lock:
                        self.spans.append(received)

    def trace(self, trace_id: str) -> list[Received]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def start(self) -> ThreadingHTTPServer:
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                else:
                    collector.take(body)
                    self.send_response(200)
                    self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


@pytest.fixture
def collector() -> Iterator[Collector]:
    found = Collector()
    server = found.start()
    yield found
    server.shutdown()
    server.server_close()


@pytest.fixture
def traced(collector: Collector, private_stack: Stack) -> Stack:
    """The private stack, exporting to the collector every 50 ms. The collector is set up first
    so that it stops last: processes stopping at teardown send their last spans to it, not to
    a closed port they would retry for seconds."""
    private_stack.extra_env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector.port}",
        OTEL_BSP_SCHEDULE_DELAY="50",
    )
    return private_stack


def _post(stack: Stack, body: dict[str, Any], headers: dict[str, str] | None = None) -> str:
    with stack.client() as client:
        answer = client.post("/v1/events", json=body, headers=headers or {})
    assert answer.status_code == 202, answer.text
    key: str = answer.json()["key"]
    return key


def _traceparents(downstream: Downstream, key: str) -> list[str]:
    with downstream.lock:
        sent = [r["headers"] for r in downstream.requests if r["key"] == key]
    return [next(v for k, v in h.items() if k.lower() == "traceparent") for h in sent]


def _one(spans: list[Received], kind: int) -> Received:
    found = [s for s in spans if s.kind == kind]
    assert len(found) == 1, found
    return found[0]


def _complete(collector: Collector, trace_id: str, attempts: int, sends: int) -> list[Received]:
    """The trace once its server span, sends, attempts and client spans have all arrived."""

    def arrived() -> list[Received] | None:
        spans = collector.trace(trace_id)
        counts = [sum(s.kind == k for s in spans) for k in (SERVER, PRODUCER, CONSUMER, CLIENT)]
        return spans if counts == [1, sends, attempts, attempts] else None

    spans: list[Received] = wait_until(arrived, timeout=30)
    return spans


def test_one_trace_per_event_from_the_receiver_into_the_downstream(
    traced: Stack, collector: Collector, downstream: Downstream
) -> None:
    """Each event is one trace: the receiver's server span, the relay's send span, an attempt's
    process span and its HTTP client span, parent to child; a retried attempt (503 first) joins
    the same trace with its resend count; the downstream gets the client span's traceparent; an
    incoming traceparent is continued."""
    downstream.behaviour = lambda key, n: Reply(503) if "retried" in key and n == 1 else Reply()
    traced.start_all()
    plain = _post(traced, envelope("plain-1", event_type="plain.lead"))
    # The sender's own key, so that the downstream knows which event to refuse once.
    retried = _post(
        traced, envelope("retried-1", event_type="plain.lead"), {"Idempotency-Key": "retried-1"}
    )
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    continued = _post(
        traced,
        envelope("continued-1", event_type="plain.lead"),
        {"traceparent": f"00-{caller_trace}-{caller_span}-01"},
    )
    for key in (plain, retried, continued):
        assert finished(traced, key)["status"] == "succeeded"

    traces = {}
    for key, attempts in ((plain, 1), (retried, 2), (continued, 1)):
        parents = _traceparents(downstream, key)
        assert len(parents) == attempts
        trace_ids = {p.split("-")[1] for p in parents}
        assert len(trace_ids) == 1, parents
        trace_id = trace_ids.pop()
        spans = _complete(collector, trace_id, attempts, sends=attempts)
        traces[key] = trace_id

        server = _one(spans, SERVER)
        assert (server.service, server.name) == ("idem-receiver", "POST /v1/events")
        assert server.attributes["http.route"] == "/v1/events"
        sends = [s for s in spans if s.kind == PRODUCER]
        processes = [s for s in spans if s.kind == CONSUMER]
        clients = [s for s in spans if s.kind == CLIENT]
        for send in sends:
            assert (send.service, send.name, send.parent_id) == (
                "idem-relay",
                f"send {TASK_QUEUE}",
                server.span_id,
            )
            assert send.attributes["messaging.operation.type"] == "send"
        by_id = {s.span_id: s for s in spans}
        for process in processes:
            assert (process.service, process.name) == ("idem-worker", "process plain")
            assert process.attributes["messaging.destination.name"] == "plain"
            assert process.attributes["messaging.operation.type"] == "process"
            assert by_id[process.parent_id].kind == PRODUCER
            assert process.links == (process.parent_id,)
        assert sorted(by_id[c.parent_id].attributes["idem.attempt"] for c in clients) == list(
            range(1, attempts + 1)
        )
        for client in clients:
            assert client.service == "idem-worker"
            assert client.attributes["http.request.method"] == "POST"
            resends = client.attributes.get("http.request.resend_count")
            attempt = by_id[client.parent_id].attributes["idem.attempt"]
            assert resends == (None if attempt == 1 else attempt - 1)
        # The downstream got each client span's own context.
        assert sorted(p.split("-")[2] for p in parents) == sorted(c.span_id for c in clients)

    assert len(set(traces.values())) == 3
    assert traces[continued] == caller_trace
    continued_server = _one(collector.trace(caller_trace), SERVER)
    assert continued_server.parent_id == caller_span
    # The stored context is the receiver's span, read by every later publish.
    stored = query(
        traced.database_url,
        "SELECT trace_context FROM events WHERE idempotency_key = %s",
        (continued,),
    )
    assert stored == [(f'{{"traceparent":"00-{caller_trace}-{continued_server.span_id}-01"}}',)]


def test_a_fan_out_events_deliveries_share_one_send_and_each_attempt_joins_its_trace(
    traced: Stack, collector: Collector, downstream: Downstream
) -> None:
    """A fan-out event's three deliveries travel in one message: one send span, and under it
    each delivery's own process span (named after its destination) with its own client span,
    all in the event's trace."""
    traced.start_all()
    event = _post(traced, envelope("fanned-1", event_type="billing.invoice_paid"))
    names = ("books", "finance-flow", "notify")
    keys = [delivery_key(event, name) for name in names]
    for key in keys:
        assert finished(traced, key)["status"] == "succeeded"
    parents = [p for key in keys for p in _traceparents(downstream, key)]
    assert len(parents) == 3
    (trace_id,) = {p.split("-")[1] for p in parents}
    spans = _complete(collector, trace_id, attempts=3, sends=1)
    send = _one(spans, PRODUCER)
    processes = [s for s in spans if s.kind == CONSUMER]
    assert sorted(p.name for p in processes) == [f"process {name}" for name in names]
    assert all(p.parent_id == send.span_id and p.links == (send.span_id,) for p in processes)
    clients = [s for s in spans if s.kind == CLIENT]
    assert sorted(c.parent_id for c in clients) == sorted(p.span_id for p in processes)


# It empties or counts inside Redis.
@pytest.mark.brokers("redis")
def test_an_attempt_after_a_sweepers_redrive_joins_the_events_trace(
    traced: Stack, collector: Collector, downstream: Downstream
) -> None:
    """An event whose message was lost in the broker is re-driven by the sweeper and published
    again from its stored context: two send spans and the one attempt in the same trace."""
    traced.start_receiver()
    traced.start_relay()
    key = _post(traced, envelope("redriven-1", event_type="plain.lead"))
    wait_until(
        lambda: query(
            traced.database_url,
            "SELECT 1 FROM outbox WHERE idempotency_key = %s AND published_at IS NOT NULL",
            (key,),
        )
    )
    # The message is lost before any worker took it.
    broker: redis_client.Redis[Any] = redis_client.Redis.from_url(traced.broker_url)
    broker.flushdb()
    broker.close()
    traced.start_sweeper()
    traced.start_worker()
    assert finished(traced, key)["status"] == "succeeded"

    (parent,) = _traceparents(downstream, key)
    spans = _complete(collector, parent.split("-")[1], attempts=1, sends=2)
    server = _one(spans, SERVER)
    assert all(s.parent_id == server.span_id for s in spans if s.kind == PRODUCER)
    assert query(
        traced.database_url, "SELECT count(*) FROM outbox WHERE idempotency_key = %s", (key,)
    ) == [(2,)]


# The default pool in `make test`; prefork (its outcome crosses a pipe) in `make test-slow`.
@pytest.mark.parametrize("pool", ["threads", pytest.param("prefork", marks=pytest.mark.slow)])
def test_every_process_sends_its_spans_when_it_stops(
    traced: Stack, collector: Collector, downstream: Downstream, pool: str
) -> None:
    """With spans held back for ten minutes, the receiver, the relay and the worker (either
    pool, a prefork child included) still send every span of the event when they stop."""
    traced.extra_env.update(OTEL_BSP_SCHEDULE_DELAY="600000", WORKER_POOL=pool)
    traced.start_all()
    key = _post(traced, envelope(f"stopped-{pool}", event_type="plain.lead"))
    assert finished(traced, key)["status"] == "succeeded"
    (parent,) = _traceparents(downstream, key)
    trace_id = parent.split("-")[1]
    assert collector.trace(trace_id) == []

    traced.stop_all()
    spans = _complete(collector, trace_id, attempts=1, sends=1)
    assert {s.service for s in spans} == {"idem-receiver", "idem-relay", "idem-worker"}


def test_a_signed_request_keeps_its_signature_and_a_lookup_is_no_resend(
    traced: Stack, collector: Collector, downstream: Downstream
) -> None:
    """On a signed route the traceparent rides beside a signature that still verifies over the
    body, id and timestamp; after a 500 the reconcile lookup is a client span of its own with no
    resend count, and the re-send has a resend count of 1, all in the event's trace."""
    downstream.behaviour = lambda _key, n: Reply(500, commit=False) if n == 1 else Reply()
    traced.start_all()
    key = _post(traced, envelope("signed-traced-1", event_type="signed.lead"))
    state = finished(traced, key)
    assert (state["status"], state["attempts"]) == ("succeeded", 2)
    posts = [r for r in downstream.requests if r["key"] == key]
    lookups = list(downstream.lookup_requests)
    assert (len(posts), len(lookups)) == (2, 1)
    secret = standard_webhooks.decode_secret(SIGNING_SECRET)
    for request in [*posts, *lookups]:
        headers = {name.lower(): value for name, value in request["headers"].items()}
        assert "traceparent" in headers
        signature = standard_webhooks.mac(
            secret, headers["webhook-id"], int(headers["webhook-timestamp"]), request["raw"]
        )
        assert f"v1,{signature.decode()}" in headers["webhook-signature"].split()

    trace_id = _traceparents(downstream, key)[0].split("-")[1]
    spans = wait_until(
        lambda: (
            (found := collector.trace(trace_id))
            and sum(s.kind == CLIENT for s in found) == 3
            and sum(s.kind == CONSUMER for s in found) == 2
            and found
        ),
        timeout=30,
    )
    clients = sorted(
        (
            (s.attributes["http.request.method"], s.attributes.get("http.request.resend_count"))
            for s in spans
            if s.kind == CLIENT
        ),
        key=repr,
    )
    assert clients == [("GET", None), ("POST", 1), ("POST", None)]
