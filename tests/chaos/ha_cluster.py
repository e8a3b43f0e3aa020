"""A Patroni-managed PostgreSQL cluster with etcd, on the HA soak's network namespaces.

An etcd member on each of the etcd hosts (tests/chaos/ha_etcd.py: three for the soak, one for a
test that needs no etcd faults) and a Patroni node on each of the "pg-N" hosts, each running
its own PostgreSQL 15 in a data directory of its own. Every Patroni node is given every etcd
member's address and moves to the next when one fails to answer. Patroni bootstraps the first
node that wins the leader key and makes the others streaming replicas; with `synchronous_mode`
one of them is the synchronous standby and every commit waits for it (`synchronous_commit =
on`), so a commit the primary acknowledged is on a node that can be promoted.

PostgreSQL refuses to run as root: Patroni, and the servers it starts, run as the `postgres`
system user (Debian's PostgreSQL packages create it). Nothing outside the soak's own folder is
written; the machine's own clusters are never touched.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from outbox.store.embedded import terminate
from tests.chaos.ha_etcd import ETCD, EtcdCluster
from tests.chaos.netns import Network

PATRONI = "/usr/bin/patroni"
PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_PORT = 5432
REST_PORT = 8008
SCOPE = "idem-ha"
RUN_AS = "postgres"
# Patroni's timing: the leader key lives `ttl` seconds, each node looks every `loop_wait`; a dead
# primary's key expires within ttl and a replica takes over on its next loop (Patroni's
# own rule: ttl >= loop_wait + 2 * retry_timeout).
TTL, LOOP_WAIT, RETRY_TIMEOUT = 10, 1, 4
# Patroni splits `retry_timeout` among the etcd members (1.33 s each of three): while etcd elects
# a leader a write to a follower waits, and a primary whose leader-key update failed on every
# member within the budget demotes itself, though the key lives on. With failsafe mode it asks
# the other Patroni nodes first (POST /failsafe) and stays the primary if every one answers.
FAILSAFE = True


def unavailable() -> str | None:
    """Why the cluster cannot run here (Patroni, etcd or PostgreSQL 15 missing), or None."""
    missing = [p for p in (PATRONI, str(PG_BIN / "postgres")) if not Path(p).exists()]
    if shutil.which(ETCD) is None:
        missing.append(ETCD)
    if missing:
        return f"missing {', '.join(missing)} (make patroni installs Debian's patroni, etcd-server)"
    try:
        pwd.getpwnam(RUN_AS)
    except KeyError:
        return f"no {RUN_AS!r} user to run PostgreSQL as"
    return None


def _config(
    net: Network, node: str, data: Path, synchronous: bool, etcd: list[str], failsafe: bool
) -> dict[str, Any]:
    ip = net.ip(node)
    subnet = net.subnet
    return {
        "scope": SCOPE,
        "name": node,
        "log": {"level": "INFO"},
        "restapi": {"listen": f"{ip}:{REST_PORT}", "connect_address": f"{ip}:{REST_PORT}"},
        "etcd": {"hosts": etcd},
        "bootstrap": {
            "dcs": {
                "ttl": TTL,
                "loop_wait": LOOP_WAIT,
                "retry_timeout": RETRY_TIMEOUT,
                "maximum_lag_on_failover": 16 * 1024 * 1024,
                "synchronous_mode": synchronous,
                "failsafe_mode": failsafe,
                "postgresql": {
                    "use_pg_rewind": True,
                    "parameters": {
                        "synchronous_commit": "on",
                        "max_connections": 200,
                        "wal_log_hints": "on",
                        "wal_keep_size": "256MB",
                        "max_wal_senders": 10,
                        "max_replication_slots": 10,
                        "hot_standby": "on",
                    },
                },
            },
            "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
        },
        "postgresql": {
            "listen": f"{ip}:{PG_PORT}",
            "connect_address": f"{ip}:{PG_PORT}",
            "data_dir": str(data / "data"),
            "bin_dir": str(PG_BIN),
            "pgpass": str(data / "pgpass"),
            "authentication": {
                "superuser": {"username": "postgres", "password": "postgres"},
                "replication": {"username": "postgres", "password": "postgres"},
                "rewind": {"username": "postgres", "password": "postgres"},
            },
            "pg_hba": [
                "local all all trust",
                f"host all all {subnet} trust",
                f"host replication all {subnet} trust",
            ],
            "parameters": {"unix_socket_directories": str(data)},
        },
    }


@dataclass
class Cluster:
    """etcd and the Patroni nodes; `start_node`/`kill_node` for the faults."""

    net: Network
    base: Path
    nodes: list[str]
    synchronous: bool = True
    log_dir: Path | None = None
    etcd_hosts: list[str] = field(default_factory=lambda: ["etcd"])
    failsafe: bool = FAILSAFE
    etcd: EtcdCluster | None = None
    patronis: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def _log(self, name: str) -> Any:
        return open(self.log_dir / f"{name}.log" if self.log_dir else os.devnull, "ab")

    def start(self, timeout: float = 120.0) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        # The soak's own temporary folder (mkdtemp's 0700) and this one: passable by the user
        # PostgreSQL runs as, which reads only its own node's folder below.
        for folder in (self.base.parent, self.base):
            os.chmod(folder, 0o755)
        self.etcd = EtcdCluster(self.net, self.base / "etcd", self.etcd_hosts, self.log_dir)
        self.etcd.start(timeout)
        user = pwd.getpwnam(RUN_AS)
        for node in self.nodes:
            data = self.base / node
            data.mkdir(mode=0o700)
            os.chown(data, user.pw_uid, user.pw_gid)
            config = data / "patroni.yml"
            # JSON is YAML: Patroni reads it as its configuration file.
            etcd = self.etcd.endpoints()
            settings = _config(self.net, node, data, self.synchronous, etcd, self.failsafe)
            config.write_text(json.dumps(settings))
            os.chown(config, user.pw_uid, user.pw_gid)
        for node in self.nodes:
            self.start_node(node)
        self.wait_healthy(timeout)

    def start_node(self, node: str) -> None:
        """Start (or start again) the node's Patroni, which starts its PostgreSQL."""
        argv = [
            *self.net.on(node),
            *("setpriv", f"--reuid={RUN_AS}", f"--regid={RUN_AS}", "--init-groups"),
            *(PATRONI, str(self.base / node / "patroni.yml")),
        ]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.base / node), "LC_ALL": "C.UTF-8"}
        with self._log(f"patroni-{node}") as log:
            self.patronis[node] = subprocess.Popen(argv, stdout=log, stderr=log, env=env)

    def kill_node(self, node: str) -> list[int]:
        """SIGKILL the node's Patroni and its PostgreSQL (the machine lost at once)."""
        pids = []
        process = self.patronis.get(node)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
            pids.append(process.pid)
        pid_file = self.base / node / "data" / "postmaster.pid"
        try:
            postmaster = int(pid_file.read_text().split()[0])
            os.kill(postmaster, signal.SIGKILL)
            pids.append(postmaster)
        except (OSError, ValueError, IndexError):
            pass
        return pids

    @staticmethod
    def _get(url: str) -> Any:
        try:
            response = httpx.get(url, timeout=2)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    def node_state(self, node: str) -> dict[str, Any] | None:
        """The node's own Patroni's view of its PostgreSQL (role, state, timeline): local, so
        it answers while etcd does not."""
        if node in self.net.isolated:
            return None
        found = self._get(f"http://{self.net.ip(node)}:{REST_PORT}/patroni")
        return dict(found) if isinstance(found, dict) else None

    def members(self) -> list[dict[str, Any]]:
        """The cluster's members as Patroni's REST API lists them (any node that answers)."""
        for node in self.nodes:
            if node in self.net.isolated:
                continue
            found = self._get(f"http://{self.net.ip(node)}:{REST_PORT}/cluster")
            if found is not None:
                return list(found.get("members", []))
        return []

    def leader(self) -> str | None:
        for member in self.members():
            if member.get("role") == "leader" and member.get("state") == "running":
                return str(member["name"])
        return None

    def standbys(self, synchronous: bool) -> list[str]:
        roles = ("sync_standby",) if synchronous else ("replica", "sync_standby")
        return [str(m["name"]) for m in self.members() if m.get("role") in roles]

    def wait_healthy(self, timeout: float) -> None:
        """A running leader, and every other node streaming (one synchronous)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            members = self.members()
            running = [m for m in members if m.get("state") in ("running", "streaming")]
            roles = [m.get("role") for m in running]
            synced = not self.synchronous or "sync_standby" in roles
            if "leader" in roles and len(running) == len(self.nodes) and synced:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the cluster is not healthy after {timeout:g} s: {self.members()}")

    def switchover(self) -> str:
        """Ask the leader to hand over to a standby (Patroni picks the synchronous one)."""
        leader = self.leader()
        if leader is None:
            raise RuntimeError("no leader to switch over from")
        response = httpx.post(
            f"http://{self.net.ip(leader)}:{REST_PORT}/switchover",
            json={"leader": leader},
            timeout=30,
        )
        if response.status_code != 200:
            raise RuntimeError(f"switchover refused: {response.status_code} {response.text}")
        return leader

    def database_url(self) -> str:
        """libpq's multi-host URL: every node, the writable one chosen at each connect."""
        hosts = ",".join(f"{self.net.ip(node)}:{PG_PORT}" for node in self.nodes)
        return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"

    def stop(self) -> None:
        terminate(list(self.patronis.values()), grace=15)
        for node in self.nodes:
            self.kill_node(node)
        if self.etcd is not None:
            self.etcd.stop()
