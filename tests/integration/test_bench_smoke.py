"""`python -m bench.run --smoke` runs every section and writes numeric JSON (speed not judged)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT

SECTIONS = (
    "machine",
    "ingest",
    "duplicates",
    "e2e",
    "relay",
    "growth",
    "memory",
    "webhooks",
    "slow",
    "checks",
)


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [n for item in value.values() for n in _numbers(item)]
    if isinstance(value, list):
        return [n for item in value for n in _numbers(item)]
    return []


@pytest.mark.timeout(420)
def test_bench_smoke_writes_every_section(pg_admin_url: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "--smoke",
            "--json",
            str(out),
            "--admin-url",
            pg_admin_url,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads(out.read_text())
    assert document["failed_sections"] == []
    for section in SECTIONS:
        assert document.get(section), f"section {section} is missing or empty"
    for section in SECTIONS[1:-1]:
        numbers = _numbers(document[section])
        assert numbers, f"section {section} has no numbers"
        assert all(math.isfinite(n) for n in numbers), section
    for check in document["checks"]:
        assert isinstance(check["value"], int | float) and math.isfinite(check["value"])
        assert isinstance(check["ok"], bool)
    assert {c["section"] for c in document["checks"]} == {
        "1 ingest",
        "2 duplicates",
        "3 end to end",
        "4 relay",
        "5 growth",
        "6 memory",
        "7 webhooks",
        "8 slow downstream",
    }
