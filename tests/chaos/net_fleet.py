"""The gateway's processes on the multi-host soak's hosts, and the servers on theirs.

`NetFleet` is `servers.Fleet` with a host per process: each one runs on its host through
`ip netns exec` (with the host's name as its hostname), listens on the host's address, and a
replacement (after a kill, or a process that ended by itself) starts on the same host. The
processes start together and are waited for together: a loaded machine takes seconds per
Celery worker. PostgreSQL and Redis are the embedded servers, started from a thread that has
entered the db and broker hosts' namespaces, listening on those hosts' addresses.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from outbox.store import embedded, ports
from tests.chaos.netns import Network
from tests.chaos.servers import Fleet, Proc
from tests.support import ROOT

RECEIVER_PORT = 8000
METRICS_PORT = 9808
POSTGRES_PORT = 5432
REDIS_PORT = 6379
# The receivers' DB_TIMEOUT_SECONDS: a receiver cut from PostgreSQL answers 503 within twice
# this (4 s, 6 s by default), which leaves the clients' 10 s bound (check.MAX_REQUEST_SECONDS)
# room for a machine whose two cores run every host's processes and others' work besides.
RECEIVER_DB_TIMEOUT = "2"


@dataclass
class NetFleet(Fleet):
    net: Network | None = None
    host_of: dict[str, str] = field(default_factory=dict)  # process name -> host
    concurrency: int = 2

    def _spawn_on(
        self, host: str, role: str, args: list[str], extra: dict[str, str] | None = None
    ) -> Proc:
        assert self.net is not None
        n = self.generation.get(role, 0) + 1
        self.generation[role] = n
        name = f"{role}-{n}"
        with (self.log_dir / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                [*self.net.on(host), sys.executable, *args],
                env={**self.env, **(extra or {})},
                cwd=ROOT,
                stdout=log,
                stderr=log,
            )
        proc = Proc(name, role, process)
        self.procs[name] = proc
        self.host_of[name] = host
        return proc

    def url(self, host: str, port: int = RECEIVER_PORT) -> str:
        assert self.net is not None
        return f"http://{self.net.ip(host)}:{port}"

    def receiver_on(self, host: str) -> Proc:
        assert self.net is not None
        ip = self.net.ip(host)
        args = ["-m", "outbox.cli", "serve", "--host", ip, "--port", str(RECEIVER_PORT)]
        return self._spawn_on(host, "receiver", args, {"DB_TIMEOUT_SECONDS": RECEIVER_DB_TIMEOUT})

    def relay_on(self, host: str) -> Proc:
        return self._spawn_on(host, "relay", ["-m", "outbox.cli", "relay"])

    def sweeper_on(self, host: str) -> Proc:
        return self._spawn_on(host, "sweeper", ["-m", "outbox.cli", "sweep"])

    def worker_on(self, host: str) -> Proc:
        assert self.net is not None
        n = self.generation.get("worker", 0) + 1
        metrics_dir = self.metrics_root / f"worker-{n}"  # kept after a kill (see Fleet)
        proc = self._spawn_on(
            host,
            "worker",
            ["-m", "worker", "--concurrency", str(self.concurrency)],
            {
                "WORKER_METRICS_HOST": self.net.ip(host),
                "WORKER_METRICS_PORT": str(METRICS_PORT),
                "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
            },
        )
        proc.metrics_port = METRICS_PORT
        return proc

    def wait_ready(self, procs: list[Proc], timeout: float = 90.0) -> None:
        """Wait for the receivers' and workers' ports (a worker's opens just before Celery
        consumes); a process that exits meanwhile fails the start."""
        assert self.net is not None
        for proc in procs:
            port = {"receiver": RECEIVER_PORT, "worker": METRICS_PORT}.get(proc.role)
            if port is not None:
                ip = self.net.ip(self.host_of[proc.name])
                ports.wait_for_port(port, proc.process, timeout=timeout, host=ip)

    def wait_serving(self, procs: list[Proc], timeout: float = 120.0) -> None:
        """Wait until each receiver answers /readyz with 200 (its database reached) and each
        worker logged Celery's "ready." (consuming): the clock of the send phase starts with
        the gateway really up, not with processes still importing on a loaded machine."""
        deadline = time.monotonic() + timeout
        for proc in procs:
            host = self.host_of[proc.name]
            while True:
                if proc.process.poll() is not None:
                    code = proc.process.returncode
                    raise RuntimeError(f"{proc.name} on {host} exited with {code}")
                if self._serving(proc, host):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.name} on {host} not serving after {timeout:g} s")
                time.sleep(0.2)

    def _serving(self, proc: Proc, host: str) -> bool:
        if proc.role == "worker":
            return " ready." in (self.log_dir / f"{proc.name}.log").read_text(errors="replace")
        if proc.role != "receiver":
            return True
        try:
            return httpx.get(f"{self.url(host)}/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def replace(self, proc: Proc, concurrency: int = 0) -> Proc:
        """Start a process of the same role on the same host (not waited for: the fault
        thread that calls this must keep its other faults' times)."""
        host = self.host_of[proc.name]
        start = {
            "receiver": self.receiver_on,
            "relay": self.relay_on,
            "worker": self.worker_on,
            "sweeper": self.sweeper_on,
        }[proc.role]
        return start(host)

    def on_host(self, host: str, role: str | None = None) -> list[Proc]:
        """The live processes on `host` (of `role`)."""
        return [
            p
            for p in self.procs.values()
            if self.host_of.get(p.name) == host
            and (role is None or p.role == role)
            and not p.killed
            and p.process.poll() is None
        ]


def start_postgres(net: Network, data_dir: Path) -> tuple[embedded.EmbeddedPostgres, str]:
    """The embedded PostgreSQL on the db host, open to the network's hosts."""
    server = embedded.EmbeddedPostgres(
        data_dir.resolve(), port=POSTGRES_PORT, host=net.ip("db"), clients=net.subnet
    )
    with net.entered("db"):
        try:
            return server, server.start()
        except BaseException:
            server.cleanup()
            raise


def start_redis(net: Network, data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The embedded redis-server on the broker host, without persistence (as `make chaos`)."""
    with net.entered("broker"):
        return embedded.start_redis(data_dir, REDIS_PORT, appendonly=False, host=net.ip("broker"))
