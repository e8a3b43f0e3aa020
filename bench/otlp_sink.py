"""`python -m bench.otlp_sink [--port 4318]`: an OTLP/HTTP trace receiver that decodes and
counts what it gets, then drops it; the cost of tracing measured without a collector's own work
(docs/explanation/performance.md, "Tracing"). Prints the span count by service every 10 s and at
the end.
"""

from __future__ import annotations

import argparse
import signal
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.otlp_sink", description=__doc__)
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                spans = sum(len(scope.spans) for scope in resource_spans.scope_spans)
                with lock:
                    counts[service] += spans
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    while not stop.wait(10):
        with lock:
            print(dict(counts), flush=True)
    server.shutdown()
    with lock:
        print("spans received:", dict(counts), flush=True)


if __name__ == "__main__":
    main()
