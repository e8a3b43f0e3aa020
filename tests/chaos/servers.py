"""The soak's own servers and processes: a PostgreSQL and a Redis nobody else uses, and the
gateway's processes, each of which the soak may kill and replace.

Nothing here touches a server it did not start: PostgreSQL and Redis listen on free ports of
their own (PostgreSQL with a password made for it), and every kill names a PID
this module spawned.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from outbox.store import embedded
from outbox.store.ports import free_port, wait_for_port
from tests.brokers import RabbitNode
from tests.support import ROOT


class OwnPostgres:
    """An embedded PostgreSQL in `data_dir`, with a fast stop and a start again on its port."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.server: embedded.EmbeddedPostgres | None = None
        self.url = ""

    def start(self) -> str:
        self.server, self.url = embedded.start_postgres(self.data_dir)
        return self.url

    def stop_fast(self) -> None:
        """A fast stop: sessions are disconnected, open transactions rolled back."""
        assert self.server is not None
        self.server.stop(fast=True)

    def start_again(self) -> None:
        """Start on the same data directory and port."""
        assert self.server is not None
        self.server.start()

    def cleanup(self) -> None:
        if self.server is not None:
            self.server.cleanup()
        self.server = None


class OwnRedis:
    """A redis-server without persistence on a port of its own: a restart empties it."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> str:
        self.process, self.url = embedded.start_redis(self.data_dir, self.port, appendonly=False)
        return self.url

    def stop(self) -> None:
        if self.process is not None:
            embedded.terminate([self.process])
            self.process = None

    def restart(self, pause: float = 1.0) -> None:
        self.stop()
        time.sleep(pause)
        self.start()


class OwnRabbit:
    """A RabbitMQ node of the soak's own (tests/brokers.py `RabbitNode`), never the machine's:
    a restart keeps its disk, as a restarted server does, so what it confirmed survives."""

    def __init__(self, data_dir: Path) -> None:
        self.node = RabbitNode(data_dir)
        self.port = self.node.port
        self.url = ""

    def start(self) -> str:
        self.url = self.node.start().url
        return self.url

    def stop(self) -> None:
        self.node.stop()

    def restart(self, pause: float = 1.0) -> None:
        self.stop()
        time.sleep(pause)
        self.start()


OwnBroker = OwnRedis | OwnRabbit


def children(pid: int) -> list[psutil.Process]:
    """Direct children of `pid` (Celery's pool processes of a worker). psutil remembers each
    one's start time, so a later kill cannot hit a recycled PID."""
    try:
        return psutil.Process(pid).children()
    except psutil.Error:
        return []


def _kill(processes: list[psutil.Process]) -> None:
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if process.is_running():
                process.kill()


@dataclass
class Proc:
    name: str
    role: str  # receiver | relay | worker | sweeper
    process: subprocess.Popen[bytes]
    metrics_port: int = 0
    killed: bool = False  # by the soak, on purpose
    exited: bool = False  # by itself, noticed (and replaced) by the supervisor
    log_offset: int = 0  # how far the supervisor has read its log
    broken_since: float | None = None  # when it logged an unrecoverable error


@dataclass
class Fleet:
    """The gateway's processes, started like tests.support.Stack, with logs in `log_dir`."""

    env: dict[str, str]
    log_dir: Path
    metrics_root: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    generation: dict[str, int] = field(default_factory=dict)
    receiver_port: int = 0

    def command(self, role: str, args: list[str]) -> tuple[list[str], Path, dict[str, str]]:
        """How a process of `role` runs `python args`: its command line, working directory and
        the environment it adds (the upgrade soak runs some on another release's code)."""
        return [sys.executable, *args], ROOT, {}

    def _spawn(self, role: str, args: list[str], extra: dict[str, str] | None = None) -> Proc:
        n = self.generation.get(role, 0) + 1
        self.generation[role] = n
        name = f"{role}-{n}"
        argv, cwd, code_env = self.command(role, args)
        env = {**self.env, **(extra or {}), **code_env}
        with (self.log_dir / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=log)
        proc = Proc(name, role, process)
        self.procs[name] = proc
        return proc

    def start_receiver(self) -> Proc:
        self.receiver_port = self.receiver_port or free_port()
        proc = self._spawn(
            "receiver", ["-m", "outbox.cli", "serve", "--port", str(self.receiver_port)]
        )
        wait_for_port(self.receiver_port, proc.process, timeout=60)
        return proc

    def start_relay(self) -> Proc:
        return self._spawn("relay", ["-m", "outbox.cli", "relay"])

    def start_sweeper(self) -> Proc:
        return self._spawn("sweeper", ["-m", "outbox.cli", "sweep"])

    def start_worker(self, concurrency: int = 2) -> Proc:
        port = free_port()
        n = self.generation.get("worker", 0) + 1
        # Each worker counts in a directory of its own, kept after it is killed, so the
        # counters of every process that ever ran can be summed at the end.
        metrics_dir = self.metrics_root / f"worker-{n}"
        proc = self._spawn(
            "worker",
            ["-m", "worker", "--concurrency", str(concurrency)],
            {"WORKER_METRICS_PORT": str(port), "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)},
        )
        proc.metrics_port = port
        # The metrics port opens just before Celery starts consuming.
        wait_for_port(port, proc.process, timeout=60)
        return proc

    def alive(self, role: str) -> list[Proc]:
        return [
            p
            for p in self.procs.values()
            if p.role == role and not p.killed and p.process.poll() is None
        ]

    def kill(self, proc: Proc) -> list[int]:
        """SIGKILL the process and its direct children (a worker's pool); returns the PIDs."""
        pool = children(proc.process.pid)
        proc.killed = True
        proc.process.send_signal(signal.SIGKILL)
        _kill(pool)
        proc.process.wait(timeout=10)
        return [proc.process.pid, *(p.pid for p in pool)]

    def retire(self, proc: Proc, timeout: float = 60.0) -> int | None:
        """Stop the process as a supervisor does (SIGTERM, then SIGKILL after `timeout`), on
        purpose; returns its exit code (None when it had to be killed)."""
        pool = children(proc.process.pid)
        proc.killed = True
        proc.process.send_signal(signal.SIGTERM)
        try:
            code: int | None = proc.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.process.kill()
            proc.process.wait(timeout=10)
            code = None
        _kill(pool)
        return code

    def unexpected_exits(self) -> list[Proc]:
        """Processes that ended although nobody killed them, not noticed before."""
        gone = [
            p
            for p in self.procs.values()
            if not p.killed and not p.exited and p.process.poll() is not None
        ]
        for proc in gone:
            proc.exited = True
        return gone

    def replace(self, proc: Proc, concurrency: int) -> Proc:
        """Start a process of the same role, as a supervisor (compose's restart policy) would."""
        match proc.role:
            case "receiver":
                return self.start_receiver()
            case "relay":
                return self.start_relay()
            case "worker":
                return self.start_worker(concurrency)
            case _:
                return self.start_sweeper()

    def new_log_text(self, proc: Proc) -> str:
        """What the process logged since the last call."""
        path = self.log_dir / f"{proc.name}.log"
        with path.open("rb") as log:
            log.seek(proc.log_offset)
            data = log.read()
        proc.log_offset += len(data)
        return data.decode(errors="replace")

    def last_error(self, proc: Proc) -> str:
        """Why the process went away: its last critical log line, else its last error."""
        path = self.log_dir / f"{proc.name}.log"
        found = {"critical": "", "error": ""}
        for line in path.read_text(errors="replace").splitlines():
            for level in found:
                if f'"level": "{level}"' in line:
                    found[level] = line
        line = found["critical"] or found["error"]
        try:
            record = json.loads(line)
            return f"{record.get('logger', '')}: {record.get('event', '')}"[:300]
        except ValueError:
            return line[:300]

    def stop_all(self) -> None:
        running = [p for p in self.procs.values() if p.process.poll() is None]
        pool = [child for p in running for child in children(p.process.pid)]
        embedded.terminate([p.process for p in running], grace=15)
        # A worker's pool processes normally leave with it; make sure none outlives the soak.
        _kill(pool)

    def metrics_dirs(self) -> list[Path]:
        return sorted(p for p in self.metrics_root.iterdir() if p.is_dir())


# A worker still alive this long after Celery logged "Unrecoverable error" is counted hung.
HUNG_AFTER = 20.0


@dataclass
class Supervisor:
    """Watches the fleet as compose's restart policy and a liveness probe would: a process
    that ends although nobody killed it, or a worker still there HUNG_AFTER seconds after it
    logged Celery's "Unrecoverable error" (a husk that takes no task), is recorded as an
    incident and replaced. `now` is the soak's clock; `where` adds what the soak knows of a
    process (its host) to the incident."""

    fleet: Fleet
    now: Callable[[], float]
    concurrency: int
    errors: list[str]
    where: Callable[[Proc], dict[str, Any]] = lambda _: {}
    incidents: list[dict[str, Any]] = field(default_factory=list)

    def supervise(self) -> None:
        now = self.now()
        for proc in self.fleet.alive("worker"):
            if proc.broken_since is None and "Unrecoverable error" in self.fleet.new_log_text(proc):
                proc.broken_since = now
            if proc.broken_since is not None and now - proc.broken_since > HUNG_AFTER:
                self.fleet.kill(proc)
                self._incident(proc, f"hung {HUNG_AFTER:.0f} s after an unrecoverable error")
        for proc in self.fleet.unexpected_exits():
            self._incident(proc, f"exited by itself with code {proc.process.returncode}")

    def _incident(self, proc: Proc, what: str) -> None:
        incident: dict[str, Any] = {
            "noticed_at": round(self.now(), 2),
            "process": proc.name,
            **self.where(proc),
            "what": what,
            "last_error": self.fleet.last_error(proc),
        }
        try:
            incident["replaced_by"] = self.fleet.replace(proc, self.concurrency).name
        except Exception as error:
            incident["replaced_by"] = None
            self.errors.append(f"replacing {proc.name}: {error!r}")
        self.incidents.append(incident)
        print(f"incident  {incident}", file=sys.stderr, flush=True)
