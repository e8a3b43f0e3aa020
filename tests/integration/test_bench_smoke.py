"""`python -m bench.run --smoke` runs its sections and writes numeric JSON (speed not judged).

`make test` runs the sections of the receiver (ingest beside its ceiling and a bare server,
and repeats); `make test-slow` runs every section, end to end beside the naive pipeline, the
relay's drain, provider webhooks, slow downstreams, growth,
memory, ordered traffic, fan-out and the peers included (they fill and drain databases of their
own, three or four minutes more; the peers need the bench's `peers` extra, which `make
test-slow` installs).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT

# Section in the JSON -> its name in the checks table ("duplicates" comes with "ingest").
CHECKED = {
    "ingest": "1 ingest",
    "duplicates": "2 duplicates",
    "e2e": "3 end to end",
    "relay": "4 relay",
    "growth": "5 growth",
    "memory": "6 memory",
    "webhooks": "7 webhooks",
    "slow": "8 slow downstream",
    "ordered": "9 ordered traffic",
    "fanout": "10 fan-out",
    "peers": "11 peers",
    "scale": "12 scale",
}
# The webhooks, ordered, fan-out and slow-downstream sections run with every section (`make
# test-slow`); what they drive is proven in `make test` by tests/integration/ingest/
# test_provider_webhooks.py and worker/test_lanes.py, test_fan_out.py, test_partial_failure.py;
# the end-to-end section's pipeline by every stack test (its smoke cost make test 20 s).
RECEIVER_SECTIONS = ("ingest", "duplicates")


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


def _runs(value: Any) -> list[dict[str, Any]]:
    """Every load run in the document: a mapping with its `requests` and `errors`."""
    if isinstance(value, dict):
        own = [value] if {"requests", "errors"} <= value.keys() else []
        return own + [run for item in value.values() for run in _runs(item)]
    if isinstance(value, list):
        return [run for item in value for run in _runs(item)]
    return []


@pytest.mark.timeout(620)
@pytest.mark.parametrize(
    "sections",
    [
        pytest.param(RECEIVER_SECTIONS, id="receiver"),
        pytest.param(tuple(CHECKED), id="every-section", marks=pytest.mark.slow),
    ],
)
def test_bench_smoke_writes_its_sections(
    pg_admin_url: str, tmp_path: Path, sections: tuple[str, ...]
) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "--smoke",
            "--only",
            ",".join(s for s in sections if s != "duplicates"),
            "--json",
            str(out),
            "--admin-url",
            pg_admin_url,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = json.loads(out.read_text())
    assert document["failed_sections"] == []
    for section in ("machine", *sections):
        assert document.get(section), f"section {section} is missing or empty"
    for section in sections:
        numbers = _numbers(document[section])
        assert numbers, f"section {section} has no numbers"
        assert all(math.isfinite(n) for n in numbers), section
    # A load run whose every request failed measured nothing (a broken peer or ceiling).
    for run in _runs(document):
        assert run["errors"] < run["requests"], run
    for check in document["checks"]:
        assert isinstance(check["value"], int | float) and math.isfinite(check["value"])
        assert isinstance(check["ok"], bool)
    assert {c["section"] for c in document["checks"]} == {CHECKED[s] for s in sections}
