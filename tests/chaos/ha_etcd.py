"""The etcd cluster Patroni keeps its leader key in, one member per host.

Each member is the machine's etcd 3.4 (Debian's `etcd-server`) started on a host of the soak's
network with everything of its own (its name, its data directory under the soak's folder, its
client port 2379 and peer port 2380 on its host's address), all of them named in
`--initial-cluster` so that they form one Raft group. The v2 API is on (`--enable-v2`): Debian's
Patroni 3.0 speaks it through python3-etcd, and keeps its keys in the v2 store, which Raft
replicates as it does the v3 keys.

Three members keep a quorum (two) when one is lost: the leader key Patroni renews survives the
loss of any single member, the Raft leader included. A killed member starts again on the same
data directory and catches up from the leader, as a machine that rebooted.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from outbox.store.embedded import terminate
from tests.chaos.netns import Network

ETCD = "etcd"
CLIENT_PORT, PEER_PORT = 2379, 2380
# Raft's pre-vote (etcd 3.4's default is off, 3.5's on): a member that was partitioned away kept
# campaigning, raising its term; without pre-vote its return forces the leader to step down and
# a second election follows. With it, the member first asks whether it could win, is told no,
# and rejoins as a follower.
PRE_VOTE = True


@dataclass
class EtcdCluster:
    """The members (`start_member`/`kill_member` for the faults) and who leads them."""

    net: Network
    base: Path
    members: list[str]
    log_dir: Path | None = None
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def url(self, member: str, port: int = CLIENT_PORT) -> str:
        return f"http://{self.net.ip(member)}:{port}"

    def endpoints(self) -> list[str]:
        """Every member's client address (host:port), for Patroni's `etcd.hosts`."""
        return [f"{self.net.ip(member)}:{CLIENT_PORT}" for member in self.members]

    def start(self, timeout: float = 60.0) -> None:
        for member in self.members:
            self.start_member(member)
        self.wait_healthy(timeout)

    def start_member(self, member: str) -> None:
        """Start (or start again, on its data directory) one member."""
        peers = ",".join(f"{m}={self.url(m, PEER_PORT)}" for m in self.members)
        argv = [
            *self.net.on(member),
            *(ETCD, "--name", member, "--data-dir", str(self.base / member)),
            *("--listen-client-urls", self.url(member)),
            *("--advertise-client-urls", self.url(member)),
            *("--listen-peer-urls", self.url(member, PEER_PORT)),
            *("--initial-advertise-peer-urls", self.url(member, PEER_PORT)),
            *("--initial-cluster", peers, "--initial-cluster-state", "new"),
            *("--initial-cluster-token", f"idem-{self.net.prefix}", "--enable-v2=true"),
            f"--pre-vote={str(PRE_VOTE).lower()}",
        ]
        log_path = self.log_dir / f"{member}.log" if self.log_dir else None
        with open(log_path or os.devnull, "ab") as log:
            self.processes[member] = subprocess.Popen(argv, stdout=log, stderr=log)

    def kill_member(self, member: str) -> list[int]:
        """SIGKILL the member (`ip netns exec`, `unshare` and `sh` exec it: the process is
        etcd itself)."""
        process = self.processes.get(member)
        if process is None or process.poll() is not None:
            return []
        process.kill()
        process.wait()
        return [process.pid]

    def wait_healthy(self, timeout: float) -> None:
        """Every member running and answering that it has a leader (etcd's /health)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for member, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"etcd member {member} exited with {process.returncode}")
            health = [self._call("GET", f"{self.url(m)}/health") for m in self.members]
            if all(h is not None and h.get("health") == "true" for h in health):
                return
            time.sleep(0.2)
        raise RuntimeError(f"etcd is not healthy after {timeout:g} s")

    def status(self, member: str) -> dict[str, Any] | None:
        """The member's own view (v3 maintenance status): its id, the leader's id, the Raft
        term; None if it does not answer (killed, partitioned away)."""
        if member in self.net.isolated:
            return None
        found = self._call("POST", f"{self.url(member)}/v3/maintenance/status", {})
        return dict(found) if isinstance(found, dict) else None

    def leader(self, besides: str | None = None) -> str | None:
        """The member that says it is the leader (one that cannot be reached is not asked;
        `besides` is left out: the old leader, after a fault)."""
        for member in self.members:
            status = None if member == besides else self.status(member)
            if status is not None and status.get("leader") == status.get("header", {}).get(
                "member_id"
            ):
                return member
        return None

    @staticmethod
    def _call(method: str, url: str, body: Any = None) -> Any:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = httpx.request(method, url, json=body, timeout=1)
            if response.status_code == 200:
                return response.json()
        return None

    def stop(self) -> None:
        terminate(list(self.processes.values()), grace=5)
