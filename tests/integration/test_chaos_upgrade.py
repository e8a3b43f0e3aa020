"""The rolling upgrade under load (`make chaos-upgrade`), CI-sized (slow: `make test-slow`;
CI runs `make chaos-upgrade ARGS=--short`): from release 0.3.0 to this checkout while the
chaos soak's traffic runs, in the order docs/how-to/upgrading.md prescribes."""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox.store.migrate import head_revisions
from tests.chaos.upgrade_fleet import NEW, OLD, PREVIOUS_SCHEMA
from tests.integration.test_chaos import run_soak


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rolling_upgrade_under_load_breaks_no_invariant(tmp_path: Path) -> None:
    """`python -m tests.chaos.upgrade --short` exits 0 with no violation: one effect per key,
    every 2xx stored and final, intake answering only 202, 200, 503 with Retry-After or a
    conflict's 422, no process exiting by itself; the schema went from 0.3.0's to head
    live, every process kind was replaced one by one (the old code was really the old, the
    new the new), the old receivers said not ready once migrated while the new ones said
    ready, and the traffic met lost and slow answers, refusals, claims and the ordered and
    fan-out routes."""
    report = run_soak(tmp_path, "--short", module="tests.chaos.upgrade", timeout=480)
    assert report["violations"]["total"] == 0, report["violations"]

    assert report["schema"] == {"before": PREVIOUS_SCHEMA, "after": ",".join(head_revisions())}
    steps = [step["step"] for step in report["steps"]]
    assert steps == ["migrate", *["workers"] * 3, *["relays"] * 2, "sweeper", *["receivers"] * 2]
    versions = report["processes"]
    assert sorted(set(versions.values())) == [NEW, OLD]
    assert all(versions[step["stopped"]] == OLD for step in report["steps"][1:])
    assert all(versions[step["started"]] == NEW for step in report["steps"][1:])

    statuses = set(report["answers"]["answers_by_status"])
    assert statuses <= {"200", "202", "422", "503"}, statuses
    readiness = report["readiness"].values()
    assert all(r["not_ready"] for r in readiness if r["version"] == OLD)
    assert all(r["ready"] for r in readiness if r["version"] == NEW)

    injected = report["crm"]["injected"]
    assert min(injected.get(kind, 0) for kind in ("lost", "slow", "503", "422")) >= 1, injected
    assert report["claims"]["completed_via"].get("lookup", 0) >= 1
    assert report["ordered"]["statuses"].get("superseded", 0) >= 1
    assert report["fan_out"]["events"] >= 1
