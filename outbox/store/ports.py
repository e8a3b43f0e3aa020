"""Ports for the servers `idem dev`, the tests and the bench start: free now, and handed to no
other process on this machine while this one lives.

A port found free by binding port 0 is free only until someone else binds it. Two processes
starting servers at once (the test suite's parallel workers) were handed the same port: the
second server's bind failed, and the wait for its port found the first one answering, so a
test talked to another test's receiver. Ports here come from outside the kernel's ephemeral
range, which outgoing connections and binds to port 0 draw from, and each is reserved by a lock
on a file of its own, held until the process exits (or until it has reserved `HELD_LOCKS`
more), which the kernel releases even when the process is killed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import subprocess
import tempfile
import time
from collections import deque
from pathlib import Path

# Where the reservations' lock files are: one empty file per port ever reserved, shared by
# every process of every user on the machine (the directory is open to all, as /tmp is).
LOCK_DIR = Path(tempfile.gettempdir()) / "idem-ports"
# Ports below this are left to the system's services.
LOWEST_PORT = 10000
# The reservations a process holds at once: the oldest is given up past this. A server binds
# its port within seconds, long before a process has reserved this many more.
HELD_LOCKS = 512
# The kernel's ephemeral range when /proc does not say (Linux's default).
DEFAULT_EPHEMERAL = (32768, 60999)

_held: deque[int] = deque()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def _candidates() -> list[int]:
    """Every port outside the ephemeral range, from a random one on: processes starting
    together look at different ports first."""
    low, high = _ephemeral_range()
    ports = [port for port in range(LOWEST_PORT, 65536) if not low <= port <= high]
    start = random.randrange(len(ports))
    return ports[start:] + ports[:start]


def _lock(port: int) -> int | None:
    """The port's lock file, locked without waiting; None when another process holds it."""
    if not LOCK_DIR.exists():
        LOCK_DIR.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):  # another user made it first: it is theirs to open
            LOCK_DIR.chmod(0o1777)
    fd = os.open(LOCK_DIR / str(port), os.O_CREAT | os.O_RDONLY, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def port_free(port: int) -> bool:
    """Nothing on this machine listens on (or holds) the port now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on, reserved for this process: no other caller of this function
    on the machine is handed it while the reservation holds."""
    for port in _candidates():
        fd = _lock(port)
        if fd is None:
            continue
        if not port_free(port):
            os.close(fd)
            continue
        _held.append(fd)
        if len(_held) > HELD_LOCKS:
            os.close(_held.popleft())
        return port
    raise RuntimeError(f"no free port from {LOWEST_PORT} outside the ephemeral range")


def wait_for_port(
    port: int, process: subprocess.Popen[bytes], timeout: float = 10.0, host: str = "127.0.0.1"
) -> None:
    """Return once something accepts connections on the port; raise if `process` exits first
    or nothing does within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {process.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")
