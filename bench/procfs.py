"""Processes as Linux shows them in /proc: resident memory, CPU time, children."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def vm_rss_kib(pid: int) -> int:
    """VmRSS of one process in KiB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return 0


def children(pid: int) -> list[int]:
    """Direct children of `pid` (from every thread's children list)."""
    found: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                text = Path(f"/proc/{pid}/task/{task}/children").read_text()
                found += [int(p) for p in text.split()]
    return found


def tree_rss_kib(pid: int) -> int:
    """VmRSS of a process plus its descendants (a Celery worker and its pool processes)."""
    return vm_rss_kib(pid) + sum(tree_rss_kib(child) for child in children(pid))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def tree_cpu_seconds(pid: int) -> float:
    return cpu_seconds(pid) + sum(tree_cpu_seconds(child) for child in children(pid))


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot (from /proc/stat)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
