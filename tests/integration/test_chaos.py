"""The chaos soak, CI-sized: 45 seconds of faults over 450 events, a fifth of them handled by
workflows through the claims API, a tenth fanned out to three destinations, and shuffled
updates of contacts on an ordered route, must break no invariant; and (slow: `make test-slow`)
a shorter one on a RabbitMQ node of the soak's own."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.brokers import RabbitNode
from tests.support import ROOT


def run_soak(
    tmp_path: Path, *options: str, module: str = "tests.chaos.soak", timeout: float = 270
) -> dict[str, Any]:
    """Run the soak `module` as its own process with `options`; its report, after it exited
    0 (`timeout`: seconds it may take)."""
    report_path = tmp_path / "chaos-report.json"
    command = [
        sys.executable,
        "-m",
        module,
        *options,
        "--report",
        str(report_path),
        # A missed quiescence bound fails at once instead of being watched for minutes.
        "--observe-after",
        "0",
    ]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM lets the soak stop every server and process it started.
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        pytest.fail(f"the soak did not finish in time:\n{output[-6000:]}")
    assert report_path.exists(), output[-6000:]
    report: dict[str, Any] = json.loads(report_path.read_text())
    assert process.returncode == 0, output[-6000:]
    return report


@pytest.mark.timeout(300)
def test_chaos_soak_breaks_no_invariant(tmp_path: Path) -> None:
    """`python -m tests.chaos.soak --duration 45 --events 450` exits 0, its report counts
    no violation, every kind of fault really happened, and the workflows' claims were
    completed, failed (effect unknown, effect none, final), abandoned and reclaimed, and the
    ordered route's contacts met stale versions (superseded) and each got its highest, and
    the fan-out route's events each got one effect per delivery, one of them refused."""
    report = run_soak(tmp_path, "--duration", "45", "--events", "450")
    assert report["ok"] is True
    assert report["violations"]["total"] == 0, report["violations"]

    faults = report["faults"]
    assert faults["kill_worker"] >= 1
    assert faults["kill_relay"] >= 1
    assert faults["restart_broker"] >= 1
    assert faults["restart_postgres"] == 1
    injected = report["crm"]["injected"]
    assert injected.get("lost", 0) >= 1, injected
    assert injected.get("slow", 0) >= 1, injected
    assert injected.get("503", 0) >= 1, injected
    # The receiver said 503 + Retry-After while PostgreSQL was down.
    assert report["answers"]["answers_during_outage"].get("503", 0) >= 1
    assert report["answers"]["max_latency_seconds"] < 10

    claims = report["claims"]
    assert claims["events"] >= 60, claims
    assert claims["completed_via"].get("create", 0) >= 1, claims
    # Lost answers and abandoned claims were completed from the CRM lookup.
    assert claims["completed_via"].get("lookup", 0) >= 1, claims
    declared = claims["declared_failures"]
    assert declared.get("retryable/unknown", 0) >= 1, declared
    assert declared.get("retryable/none", 0) >= 1, declared
    assert declared.get("final/none", 0) >= 1, declared
    assert claims["abandoned"] >= 1, claims
    assert claims["claimed_reclaimed"] >= 1, claims
    assert claims["claimed_uncertain"] >= 1, claims
    assert claims["keys_with_more_than_one"] == 0, claims
    assert claims["gateway_requests_for_claims_keys"] == 0, claims

    # One route's downstream was down: its circuit opened and closed again, a bounded number
    # of writes reached it (the soak's own check), and its keys all succeeded once (above).
    outage = report["route_outage"]
    assert outage["writes_refused"] >= 1, outage
    assert outage["circuit_opened"] >= 1, outage
    assert outage["circuit_closed"] >= 1, outage
    assert outage["final_circuit"] == "closed", outage

    # Another route's downstream refused a share of its writes for a while: the spell was real,
    # and its keys all succeeded once (above) without a stall or a loop.
    partial = report["partial_failure"]
    assert partial["writes_refused"] >= 1, partial
    assert partial["final_circuit"] == "closed", partial

    # Ordered traffic: each contact's versions were applied in increasing order and ended at the
    # highest (the soak's own checks); the shuffled sending really made some of them stale.
    ordered = report["ordered"]
    assert ordered["contacts"] >= 10, ordered
    assert ordered["statuses"].get("superseded", 0) >= 1, ordered
    assert ordered["statuses"].get("succeeded", 0) >= ordered["contacts"], ordered

    # Fan-out: one effect per delivery key, none lost, none orphaned (the soak's own checks);
    # the plan made one delivery refuse for good, so an event ended partially_failed.
    fan_out = report["fan_out"]
    assert fan_out["events"] >= 20, fan_out
    assert fan_out["deliveries"] == 3 * fan_out["events"], fan_out
    assert fan_out["events_by_status"].get("partially_failed", 0) >= 1, fan_out
    assert fan_out["keys_with_more_than_one"] == 0, fan_out
    assert fan_out["orphan_deliveries"] == 0, fan_out
    assert fan_out["views_read"] == fan_out["events"], fan_out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_soak_on_rabbitmq_breaks_no_invariant(tmp_path: Path) -> None:
    """The same soak, shorter, on a RabbitMQ node of its own (restarted with its disk, as a
    server is; the machine's RabbitMQ is never touched): exits 0 with no violation, the node
    was restarted and workers and relays were killed while events flowed, and every key has
    one effect at most, and no process ended by itself."""
    if RabbitNode.script() is None:
        pytest.skip("no rabbitmq-server script to start a node of the soak's own")
    report = run_soak(tmp_path, "--broker", "rabbitmq", "--duration", "20", "--events", "200")
    assert report["ok"] is True and report["broker"] == "rabbitmq"
    assert report["violations"]["total"] == 0, report["violations"]
    faults = report["faults"]
    assert faults["restart_broker"] >= 1 and faults["kill_worker"] >= 1, faults
    assert faults["kill_relay"] >= 1 and faults["restart_postgres"] == 1, faults
    assert report["crm"]["keys_with_more_than_one"] == 0, report["crm"]
    assert report["claims"]["keys_with_more_than_one"] == 0, report["claims"]
    # No process ended by itself (three workers on one host: each its own node name).
    assert report["incidents"] == [], report["incidents"]
