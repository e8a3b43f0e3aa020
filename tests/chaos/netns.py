"""A small network of Linux network namespaces for the multi-host soak, with faults per link.

Each host is a network namespace named `idemnet-<pid>-<tag>-<host>` with one interface, `eth0`,
the end of a veth pair whose other end is a port of a bridge in a hub namespace of the same
prefix: a switch with every host on one /24. Nothing is added to the namespace this process
started in (no interface, route or rule), and only namespaces this object created are ever
changed or deleted (`created`, in the order they were made).

Faults, per link (two hosts) or per host:

- **cut**: each end drops, on input, every packet from the other (`iptables -j DROP` in each
  host's own namespace). A silent black hole: connections neither fail nor answer, as when a
  switch port or a firewall in between drops traffic; a connect times out, an open connection
  waits for TCP to give up.
- **degrade**: each end hands the other's packets to an NFQUEUE served by a `tests.chaos.nfdelay`
  process in its namespace, which holds each packet for delay ± jitter and drops a share of
  them (netem's job, done in user space because a kernel may lack netem).
- **isolate**: the host's `eth0` is set down: every link at once, and the host itself sees its
  network gone (a new connection fails at once with "network unreachable").

Processes run on a host through `ip netns exec`, in a UTS namespace of their own whose hostname
is the host's name: the worker's lease holder (`host:pid:thread`) then names its host.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from outbox.store.embedded import terminate
from tests.support import ROOT

PREFIX = "idemnet"
SUBNET = "10.77.0"
PREFIX_LENGTH = 24
# The soak's hosts and the last byte of each one's address.
HOSTS: dict[str, int] = {
    "client": 10,
    "db": 20,
    "broker": 21,
    "receiver-1": 31,
    "receiver-2": 32,
    "relay": 40,
    "worker-1": 51,
    "worker-2": 52,
    "worker-3": 53,
}
CLONE_NEWNET = 0x40000000
_RULE_COMMENT = "idem chaos-net"
# The tools the network needs (Debian packages iproute2, iptables, util-linux).
TOOLS = ("ip", "iptables", "unshare", "hostname")


class NetworkError(RuntimeError):
    """A command that builds or changes the network failed; the message has its output."""


def _run(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: {(result.stderr or result.stdout).strip()}")
    return result.stdout


def unavailable() -> str | None:
    """Why the network cannot be built here (not root, a tool missing, no network namespaces,
    no iptables or NFQUEUE inside one); None when it can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root (ip netns, iptables)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (Debian: apt-get install iproute2 iptables)"
    probe = f"{PREFIX}-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        _run("ip", "netns", "add", probe)
    except NetworkError as error:
        return f"ip netns does not work here: {error}"
    try:
        rule = ("INPUT", "-s", "192.0.2.1", "-j", "NFQUEUE", "--queue-num", "1", "--queue-bypass")
        _run("ip", "netns", "exec", probe, "iptables", "-w", "-A", *rule)
    except NetworkError as error:
        return f"iptables with NFQUEUE does not work in a network namespace: {error}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def stale_namespaces() -> list[str]:
    """Namespaces of this soak left by a process that no longer runs (a SIGKILLed soak cannot
    clean up): listed for the operator, never removed by a soak that did not make them."""
    try:
        names = [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line]
    except NetworkError:
        return []
    stale = []
    for name in names:
        parts = name.split("-")
        ours = len(parts) > 2 and parts[0] == PREFIX and parts[1].isdigit()
        if ours and not Path(f"/proc/{parts[1]}").exists():
            stale.append(name)
    return stale


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


@dataclass
class Degradation:
    """A degraded link's two ends: (host, peer, queue, the delayer serving the queue)."""

    a: str
    b: str
    ends: list[tuple[str, str, int, subprocess.Popen[bytes]]] = field(default_factory=list)


class Network:
    """The hub, the hosts and their links; every fault undone by `close()`."""

    def __init__(self, hosts: dict[str, int] | None = None) -> None:
        self.hosts = dict(hosts or HOSTS)
        # The pid says whose they are; the tag keeps two networks of one process apart.
        self.prefix = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"
        self.created: list[str] = []
        self.cuts: set[frozenset[str]] = set()
        self.isolated: set[str] = set()
        self.delayers: list[subprocess.Popen[bytes]] = []
        self._queues = itertools.count(1)
        self.log_dir: Path | None = None

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def ip(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts[host]}"

    def host_of(self, address: str) -> str | None:
        """The host with `address`, or None."""
        for host in self.hosts:
            if self.ip(host) == address:
                return host
        return None

    @property
    def subnet(self) -> str:
        return f"{SUBNET}.0/{PREFIX_LENGTH}"

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.created.append(name)

    def build(self) -> None:
        """The hub with its bridge, and each host joined to it with its address."""
        hub = self.ns("hub")
        self._add_namespace(hub)
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
        for index, host in enumerate(self.hosts):
            ns = self.ns(host)
            self._add_namespace(ns)
            port = f"p{index}"  # inside the hub only: no name is taken outside
            _run("ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "eth0", "netns", ns)
            _run("ip", "-n", hub, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip(host)}/{PREFIX_LENGTH}", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")

    def on(self, host: str) -> list[str]:
        """The argv prefix that runs a command on `host`, with the host's name as hostname."""
        return [
            *("ip", "netns", "exec", self.ns(host)),
            *("unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', host),
        ]

    def _iptables(self, host: str, *args: str) -> None:
        _run("ip", "netns", "exec", self.ns(host), "iptables", "-w", *args)

    @contextlib.contextmanager
    def entered(self, host: str) -> Iterator[None]:
        """Run the calling thread in `host`'s network namespace for the block: sockets it opens
        and processes it starts belong there (threads it starts, too, for good)."""
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(f"/run/netns/{self.ns(host)}", os.O_RDONLY)
            try:
                _setns(target)
            finally:
                os.close(target)
            try:
                yield
            finally:
                _setns(back)
        finally:
            os.close(back)

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between `a` and `b`, at both ends (first in each INPUT chain, so
        it also beats a degraded link's queue)."""
        for host, peer in ((a, b), (b, a)):
            self._iptables(host, "-I", "INPUT", "1", *self._drop_rule(peer))
        self.cuts.add(frozenset((a, b)))

    def uncut(self, a: str, b: str) -> None:
        for host, peer in ((a, b), (b, a)):
            self._iptables(host, "-D", "INPUT", *self._drop_rule(peer))
        self.cuts.discard(frozenset((a, b)))

    def _drop_rule(self, peer: str) -> list[str]:
        return ["-s", self.ip(peer), "-m", "comment", "--comment", _RULE_COMMENT, "-j", "DROP"]

    def _queue_rule(self, peer: str, queue: int) -> list[str]:
        return [
            *("-s", self.ip(peer), "-m", "comment", "--comment", _RULE_COMMENT),
            *("-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"),
        ]

    def prepare_degrade(
        self, a: str, b: str, delay: float, jitter: float, loss: float, seed: int = 0
    ) -> Degradation:
        """Start the two delayers of a degraded link (one in each end's namespace) without
        waiting for them: a Python process takes seconds to start on a loaded machine, and
        the fault thread must keep its times. `degrade` then waits for them and adds the
        rules."""
        degradation = Degradation(a, b)
        for host, peer in ((a, b), (b, a)):
            queue = next(self._queues)
            argv = [
                *("ip", "netns", "exec", self.ns(host), sys.executable, "-m"),
                *("tests.chaos.nfdelay", "--queue", str(queue), "--delay", str(delay)),
                *("--jitter", str(jitter), "--loss", str(loss), "--seed", str(seed + queue)),
            ]
            log_path = self.log_dir / f"nfdelay-{host}-{peer}-{queue}.log" if self.log_dir else None
            with open(log_path or os.devnull, "ab") as log:
                process = subprocess.Popen(argv, stdout=log, stderr=log, cwd=ROOT)
            degradation.ends.append((host, peer, queue, process))
            self.delayers.append(process)
        return degradation

    def wait_bound(self, degradation: Degradation) -> None:
        for _, _, queue, process in degradation.ends:
            _wait_bound(process, queue)

    def degrade(self, degradation: Degradation) -> None:
        """Each packet between the link's ends held delay ± jitter seconds and dropped with
        probability `loss`, in each direction (a round trip gains twice the delay)."""
        self.wait_bound(degradation)
        for host, peer, queue, _ in degradation.ends:
            self._iptables(host, "-A", "INPUT", *self._queue_rule(peer, queue))

    def undegrade(self, degradation: Degradation) -> None:
        for host, peer, queue, _ in degradation.ends:
            self._iptables(host, "-D", "INPUT", *self._queue_rule(peer, queue))
        terminate([process for *_, process in degradation.ends], grace=5)

    def isolate(self, host: str) -> None:
        """Set the host's interface down: all of its links at once."""
        _run("ip", "-n", self.ns(host), "link", "set", "eth0", "down")
        self.isolated.add(host)

    def rejoin(self, host: str) -> None:
        _run("ip", "-n", self.ns(host), "link", "set", "eth0", "up")
        self.isolated.discard(host)

    def close(self) -> list[str]:
        """Stop the delayers and delete every namespace this object made (the veth pairs and
        rules go with them); returns what could not be done. Safe to call twice."""
        problems = []
        terminate(self.delayers, grace=5)
        self.delayers.clear()
        for name in reversed(self.created):
            result = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
            if result.returncode != 0:
                problems.append(f"ip netns del {name}: {result.stderr.strip()}")
        self.created.clear()
        return problems


def _wait_bound(process: subprocess.Popen[bytes], queue: int, timeout: float = 10.0) -> None:
    """Wait until the delayer has bound its queue (a rule added before would be bypassed):
    the queues of a namespace are listed in /proc/<pid>/net/netfilter/nfnetlink_queue."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise NetworkError(f"the delayer of queue {queue} exited {process.returncode}")
        try:
            text = Path(f"/proc/{process.pid}/net/netfilter/nfnetlink_queue").read_text()
        except OSError:
            text = ""
        if any(line.split()[:1] == [str(queue)] for line in text.splitlines()):
            return
        time.sleep(0.05)
    raise NetworkError(f"the delayer of queue {queue} did not bind in {timeout:g} s")
