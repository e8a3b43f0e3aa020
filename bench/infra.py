"""The servers and processes a benchmark runs against: databases, a Redis, the gateway's
processes (spawned like tests/support.py's Stack), and their resident memory."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis

from bench.autovacuum import StandIn, server_autovacuum
from bench.procfs import children
from outbox.store.embedded import start_redis
from outbox.store.migrate import upgrade
from outbox.store.ports import free_port, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"

NOOP_ROUTES = """
[[routes]]
match = "*"
name = "default"
action = "noop"
"""


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def database_url(admin_url: str, name: str) -> str:
    base, _, query = admin_url.partition("?")
    return base.rsplit("/", 1)[0] + f"/{name}" + (f"?{query}" if query else "")


def sql(url: str, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run one statement in autocommit; the rows it returned."""
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


def scalar(url: str, statement: str, params: Any = None) -> Any:
    rows = sql(url, statement, params)
    return rows[0][0] if rows else None


def worker_pool_default() -> str:
    """The worker's pool when none is named (WORKER_POOL, else the settings' default)."""
    from outbox.core.settings import Settings

    return os.environ.get("WORKER_POOL") or str(Settings.model_fields["worker_pool"].default)


@dataclass(frozen=True)
class WorkerShape:
    """A worker's pool and concurrency (None: the worker's default)."""

    pool: str | None = None
    concurrency: int | None = None

    def resolved(self) -> tuple[str, int]:
        from outbox.core.settings import Settings

        pool = self.pool or worker_pool_default()
        settings = Settings(worker_pool=pool, worker_concurrency=self.concurrency)  # type: ignore[arg-type]
        return pool, settings.concurrency()


def wait_until(condition: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout} s (last value {value!r})")
        time.sleep(interval)


class Databases:
    """A migrated template and copies of it, all named `idem_bench_<run>_*`, all dropped."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.prefix = f"idem_bench_{uuid.uuid4().hex[:8]}"
        self.template = f"{self.prefix}_template"
        self.names: list[str] = []
        self._admin(f'CREATE DATABASE "{self.template}"')
        self.names.append(self.template)
        upgrade(database_url(admin_url, self.template))
        # A server without autovacuum would measure stale plans and dead rows, not the gateway.
        thresholds = server_autovacuum(libpq(admin_url))
        self.autovacuum = StandIn(thresholds, self._copies) if thresholds else None

    def _copies(self) -> list[str]:
        """The run's databases autovacuum would visit (the template is never written)."""
        return [libpq(database_url(self.admin_url, n)) for n in self.names[1:]]

    def _admin(self, statement: str) -> None:
        with psycopg.connect(libpq(self.admin_url), autocommit=True) as conn:
            conn.execute(statement)

    def create(self, label: str) -> str:
        """A fresh database at the schema's head; its SQLAlchemy URL."""
        name = f"{self.prefix}_{label}"
        self._admin(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        self.names.append(name)
        return database_url(self.admin_url, name)

    def create_empty(self, label: str) -> str:
        """A fresh database without the gateway's schema (a peer's); its SQLAlchemy URL."""
        name = f"{self.prefix}_{label}"
        self._admin(f'CREATE DATABASE "{name}"')
        self.names.append(name)
        return database_url(self.admin_url, name)

    def analyze(self, *urls: str) -> None:
        """Statistics for every table of each database: what autovacuum gives a new database
        within its first minute. Each section calls this once its warm-up has drained, so
        that its timed runs measure the plans a running gateway (or peer) uses. Until then
        PostgreSQL plans every reused statement, the foreign-key checks' included, for tables
        of a few rows, and keeps those plans while the tables grow: a section's first rounds
        would measure how fast the first analysis came, not the gateway (as pgbench vacuums
        its tables before each run)."""
        for url in urls:
            sql(url, "ANALYZE")

    def drop(self, url: str) -> None:
        name = url.partition("?")[0].rsplit("/", 1)[1]
        self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if name in self.names:
            self.names.remove(name)

    def drop_all(self) -> None:
        if self.autovacuum:
            self.autovacuum.stop()
        for name in reversed(self.names):
            with contextlib.suppress(psycopg.Error):
                self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.names.clear()


@dataclass
class RedisServer:
    """A redis-server of the benchmark's own on a free port (never the machine's 6379)."""

    process: subprocess.Popen[bytes]
    url: str

    @classmethod
    def start(cls, data_dir: Path) -> RedisServer:
        # No persistence, like the test suite: with the embedded default (appendfsync always)
        # every LPUSH and BRPOP would wait for an fsync.
        process, url = start_redis(data_dir, appendonly=False)
        return cls(process, url)

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis.from_url(self.url.rsplit("/", 1)[0] + f"/{db}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class Processes:
    """The gateway's processes (and the benchmark's own servers) as real subprocesses."""

    database_url: str
    redis_url: str
    log_dir: Path
    routes_file: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    _waits: dict[str, Callable[[], None]] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            DATABASE_URL=self.database_url,
            REDIS_URL=self.redis_url,
            ROUTES_FILE=str(self.routes_file),
            LOG_FORMAT="json",
            LOG_LEVEL="INFO",
            PYTHONPATH=str(ROOT),
        )
        env.update(self.extra_env)
        return env

    def spawn(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with (self.log_dir / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, *args],
                env=env or self.env(),
                cwd=ROOT,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        self.processes[name] = process
        return process

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def pid(self, name: str) -> int:
        return self.processes[name].pid

    # Each start_* spawns the process and returns at once; `ready()` waits for every process
    # started so far (its port answers, a worker's pool is up), so start-ups overlap.

    def start_receiver(self, name: str = "receiver") -> str:
        port = self.ports[name] = free_port()
        self.spawn(name, ["-m", "outbox.cli", "serve", "--port", str(port)])
        self._waits[name] = lambda: self._wait_port(name)
        return self.url(name)

    def start_ceiling(self, name: str = "ceiling", *, bare: bool = False) -> str:
        port = self.ports[name] = free_port()
        self.spawn(name, ["-m", "bench.ceiling", "--port", str(port)] + (["--bare"] * bare))
        self._waits[name] = lambda: self._wait_port(name)
        return self.url(name)

    def start_relay(self, name: str = "relay", **env: str) -> None:
        """A relay; `env` overrides settings for this one (e.g. RELAY_BACKLOG_RATE="0")."""
        self.spawn(name, ["-m", "outbox.cli", "relay"], {**self.env(), **env} if env else None)
        self._waits[name] = lambda: self._wait_log(name, "relay.started")

    def start_worker(
        self, name: str = "worker", concurrency: int = 2, pool: str | None = None
    ) -> None:
        """A gateway worker; `pool` None keeps the worker's default (WORKER_POOL)."""
        port = self.ports[name] = free_port()
        env = self.env()
        env["WORKER_METRICS_PORT"] = str(port)
        # Each worker gets a metrics directory of its own (multiprocess mode).
        env["PROMETHEUS_MULTIPROC_DIR"] = str(self.log_dir / f"{name}-metrics")
        pool_args = ["--pool", pool] if pool else []
        self.spawn(name, ["-m", "worker", "--concurrency", str(concurrency), *pool_args], env)
        chosen = pool or self.extra_env.get("WORKER_POOL") or worker_pool_default()
        processes = concurrency if chosen == "prefork" else 0
        self._waits[name] = lambda: self._wait_pool(name, processes)

    def start_naive(self, name: str = "naive") -> str:
        port = self.ports[name] = free_port()
        self.spawn(name, ["-m", "bench.naive", "serve", "--port", str(port)])
        self._waits[name] = lambda: self._wait_port(name)
        return self.url(name)

    def start_naive_worker(
        self,
        name: str = "naive-worker",
        concurrency: int = 2,
        pool: str = "prefork",
        downstream: str = "",
    ) -> None:
        args = ["--concurrency", str(concurrency), "--pool", pool, "--downstream", downstream]
        self.spawn(name, ["-m", "bench.naive", "worker", *args])
        self._waits[name] = lambda: self._wait_pool(name, concurrency if pool == "prefork" else 0)

    def start_peer(self, name: str, module: str, concurrency: int, downstream: str = "") -> str:
        """A peer pipeline (bench/peer_*.py) on this database: its schema installed, then its
        endpoint `name` and its worker `name`-worker started; the endpoint's URL."""
        subprocess.run(
            [sys.executable, "-m", module, "install"],
            env=self.env(),
            cwd=ROOT,
            check=True,
            capture_output=True,
            timeout=120,
        )
        port = self.ports[name] = free_port()
        self.spawn(name, ["-m", module, "serve", "--port", str(port)])
        self._waits[name] = lambda: self._wait_port(name)
        worker = f"{name}-worker"
        args = ["--concurrency", str(concurrency), "--downstream", downstream]
        self.spawn(worker, ["-m", module, "worker", *args])
        self._waits[worker] = lambda: self._wait_log(worker, "peer worker ready")
        return self.url(name)

    def start_downstream(self, delay: float, name: str = "downstream") -> str:
        """The fake downstream (bench.downstream), answering after `delay` seconds."""
        port = self.ports[name] = free_port()
        self.spawn(name, ["-m", "bench.downstream", "--port", str(port), "--delay", str(delay)])
        self._waits[name] = lambda: self._wait_port(name)
        return self.url(name)

    def ready(self) -> None:
        """Wait until every process started so far is ready."""
        waits, self._waits = self._waits, {}
        for wait in waits.values():
            wait()

    def _wait_port(self, name: str) -> None:
        wait_for_port(self.ports[name], self.processes[name], timeout=60)

    def _wait_log(self, name: str, text: str, timeout: float = 60) -> None:
        """Wait for an INFO line; with a higher LOG_LEVEL, only for the process to be up."""
        process = self.processes[name]
        logged = self.extra_env.get("LOG_LEVEL", "INFO").upper() in ("DEBUG", "INFO")

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}: see {self.log_dir}")
            return text in self.logs(name) if logged else True

        wait_until(ready, timeout, interval=0.05)

    def _wait_pool(self, name: str, concurrency: int, timeout: float = 60) -> None:
        """A Celery worker is ready when it logged "ready." and its pool processes exist (none
        to wait for under the threads pool: pass 0)."""
        self._wait_log(name, " ready.", timeout)
        wait_until(lambda: len(children(self.processes[name].pid)) >= concurrency, timeout)

    def logs(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}: see {self.log_dir}")

    def stop(self, name: str) -> None:
        self._waits.pop(name, None)
        process = self.processes.pop(name)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                # The whole session: a Celery worker's pool processes go with it.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.stop(name)


@contextlib.contextmanager
def scratch_dir(keep: bool = False) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="idem-bench-"))
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def noop_stack(
    admin_url: str, label: str, routes_text: str | None = None
) -> Iterator[tuple[Processes, RedisServer]]:
    """A database, a Redis and noop routes (or `routes_text`) in a scratch folder, for a tool
    that starts the gateway's processes itself (bench.profile, bench.flames); all stopped and
    dropped after."""
    dbs = Databases(admin_url)
    try:
        with scratch_dir() as work:
            redis_server = RedisServer.start(work / "redis")
            routes = work / "routes.toml"
            routes.write_text(routes_text or NOOP_ROUTES, encoding="utf-8")
            procs = Processes(dbs.create(label), redis_server.url, work, routes)
            try:
                yield procs, redis_server
            finally:
                procs.stop_all()
                redis_server.stop()
    finally:
        dbs.drop_all()


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
