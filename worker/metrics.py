"""Worker metrics that survive Celery's prefork processes.

Each pool process writes its counters to files in PROMETHEUS_MULTIPROC_DIR (prometheus-client's
multiprocess mode); the worker's main process serves their sum on WORKER_METRICS_PORT. The
directory must be chosen before prometheus_client is first imported, which is why
`prepare_directory` runs at the top of `python -m worker`.
"""

from __future__ import annotations

import os
import shutil
import tempfile

ENV = "PROMETHEUS_MULTIPROC_DIR"


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


def serve(port: int) -> str | None:
    """Serve the summed metrics of all pool processes; None when served, else why not."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # untyped upstream
    try:
        start_http_server(port, addr="0.0.0.0", registry=registry)
    except OSError as error:
        # Most often another worker on this machine serves its metrics there already.
        return f"port {port} cannot be bound: {error.strerror or error}"
    return None


def mark_process_dead(pid: int) -> None:
    """Drop a finished pool process's live gauges (its counters stay counted)."""
    if os.environ.get(ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]  # untyped upstream
