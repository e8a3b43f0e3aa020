"""The facts of the machine a run measured, printed beside its figures."""

from __future__ import annotations

import os
import platform
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import redis

from bench.infra import scalar


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return 0.0


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def facts(database_url: str, redis_url: str) -> dict[str, Any]:
    client = redis.Redis.from_url(redis_url)
    try:
        redis_version = str(client.info("server")["redis_version"])
    finally:
        client.close()
    load1, load5, _ = os.getloadavg()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count() or 0,
        "memory_gib": _memory_gib(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "postgresql": str(scalar(database_url, "SHOW server_version")),
        "postgresql_synchronous_commit": str(scalar(database_url, "SHOW synchronous_commit")),
        # Off: the bench does autovacuum's work on its own databases (bench.autovacuum).
        "postgresql_autovacuum": str(scalar(database_url, "SHOW autovacuum")),
        "redis": redis_version,
        "uvicorn": _version("uvicorn"),
        # uvicorn picks these up when installed; without them it runs h11 on asyncio's loop.
        "httptools": _version("httptools"),
        "uvloop": _version("uvloop"),
        "load_average_at_start": [round(load1, 2), round(load5, 2)],
    }
