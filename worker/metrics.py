"""Worker metrics that survive Celery's prefork processes, served to whom may read them.

Each pool process writes its counters to files in PROMETHEUS_MULTIPROC_DIR (prometheus-client's
multiprocess mode); the worker's main process serves their sum on WORKER_METRICS_HOST and
WORKER_METRICS_PORT. The directory must be chosen before prometheus_client is first imported,
which is why `prepare_directory` runs at the top of `python -m worker`.

Who may read them: by default the worker binds 127.0.0.1, so only this machine (or this
container) can. Bound to any other address, the worker asks for METRICS_TOKEN as a bearer token
(compared in constant time, like the receiver's /metrics) and refuses to start without one:
route labels and error codes describe the deployment, and prometheus-client's own server has no
authentication at all.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from outbox.core.bearer import bearer_token, same_token

ENV = "PROMETHEUS_MULTIPROC_DIR"

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


def prepare_directory() -> str:
    """Point multiprocess mode at an empty directory (a fresh one unless the env names one)."""
    path = os.environ.get(ENV)
    if path:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
    else:
        path = tempfile.mkdtemp(prefix="idem-worker-metrics-")
        os.environ[ENV] = path
    return path


def is_loopback_host(host: str) -> bool:
    """Whether binding `host` keeps the metrics on this machine (127.0.0.0/8, ::1,
    `localhost`); an empty host is every interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_refusal(host: str, token: str) -> str | None:
    """Why the worker must not start with these settings, or None: metrics bound beyond this
    machine without a token would be open to anyone who can reach the port."""
    if is_loopback_host(host) or token:
        return None
    return (
        f"WORKER_METRICS_HOST={host or '(every interface)'} serves the worker's metrics beyond "
        "this machine: set METRICS_TOKEN (Prometheus sends it as a bearer token), or bind "
        "WORKER_METRICS_HOST=127.0.0.1"
    )


def guarded(app: WsgiApp, token: str) -> WsgiApp:
    """`app` behind `Authorization: Bearer <token>` when a token is set; a 401 otherwise."""
    if not token:
        return app

    def check(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        given = bearer_token(environ.get("HTTP_AUTHORIZATION"))
        if given is not None and same_token(token, given):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", 'Bearer realm="idem-metrics"'),
            ],
        )
        return [b"A valid metrics bearer token is required.\n"]

    return check


class _Server(ThreadingMixIn, WSGIServer):
    """One thread per scrape, none kept alive past the process."""

    daemon_threads = True


class _Server6(_Server):
    """The same on an IPv6 address (WORKER_METRICS_HOST=::, or ::1)."""

    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No access line per scrape on stderr (it would bypass the structured logs)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(port: int, host: str = "127.0.0.1", token: str = "") -> str | None:
    """Serve the summed metrics of all pool processes; None when served, else why not."""
    from prometheus_client import CollectorRegistry, make_wsgi_app
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # untyped upstream
    try:
        server = make_server(
            host,
            port,
            guarded(make_wsgi_app(registry), token),
            server_class=_Server6 if ":" in host else _Server,
            handler_class=_QuietHandler,
        )
    except OSError as error:
        # Most often another worker on this machine serves its metrics there already.
        return f"port {port} cannot be bound: {error.strerror or error}"
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return None


def mark_process_dead(pid: int) -> None:
    """Drop a finished pool process's live gauges (its counters stay counted)."""
    if os.environ.get(ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]  # untyped upstream
