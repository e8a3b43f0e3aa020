"""The upgrade soak's table: what was sent and answered, what the gateway did, each step of
the upgrade with what intake answered around it, and the violations."""

from __future__ import annotations

from typing import Any

from tests.chaos.soak import _fmt, attempt_rows, closing_rows, render, traffic_rows


def _step_line(step: dict[str, Any]) -> str:
    line = f"{step['at']:.0f} s, {step['took']:.1f} s: "
    if step["step"] == "migrate":
        return line + (
            f"migrated to {step['revision']} in {step['seconds']} s (exit {step['exit_code']},"
            f" {step['lock_retries']} lock retries)"
        )
    return line + (
        f"{step['stopped']} replaced by {step['started']}"
        f" (stopped in {step['stop_seconds']} s, exit {step['exit_code']})"
    )


def _readiness(readiness: dict[str, dict[str, Any]]) -> str:
    return "; ".join(
        f"{name} ({row['version']}) ready {row['ready']}, not ready {row['not_ready']}"
        + (f" from {row['first_not_ready']} s" if row["first_not_ready"] is not None else "")
        + (f", unanswered {row['unanswered']}" if row["unanswered"] else "")
        for name, row in readiness.items()
    )


def table(report: dict[str, Any]) -> str:
    g, c = report["gateway"], report["crm"]
    k, q, fo = report["claims"], report["ordered"], report["fan_out"]
    rows = [
        *traffic_rows(report),
        *(
            (f"answers {name}", _fmt(counts))
            for name, counts in report["answers_by_receiver"].items()
        ),
        (
            "side effects",
            f"{c['effects_total']} at the CRM (both paths) for {c['keys_with_effect']} keys"
            f" ({c['keys_with_more_than_one']} keys with more than one); {c['writes']} writes,"
            f" {c['lookups']} lookups; injected: {_fmt(c['injected'])}",
        ),
        ("final states", _fmt(g["statuses"]) + " (both paths)"),
        *attempt_rows(g),
        (
            "claims",
            f"{k['events']} events by workflows; {k['claimed']} claims"
            f" ({k['claimed_reclaimed']} reclaimed); completed via {_fmt(k['completed_via'])};"
            f" {k['keys_with_more_than_one']} keys with more than one effect",
        ),
        (
            "ordered",
            f"{q['events']} updates of {q['contacts']} contacts, lanes {report['lanes']},"
            f" ended {_fmt(q['statuses'])}",
        ),
        (
            "fan-out",
            f"{fo['events']} events, ended {_fmt(fo['events_by_status'])};"
            f" {fo['keys_with_more_than_one']} delivery keys with more than one effect",
        ),
        ("schema", f"{report['schema']['before']} -> {report['schema']['after']}"),
        *((f"step {i + 1}", _step_line(step)) for i, step in enumerate(report["steps"])),
        ("readyz", _readiness(report["readiness"])),
        (
            "errors logged",
            "; ".join(f"{v}: {_fmt(e)}" for v, e in report["errors_logged"].items()) or "none",
        ),
        *closing_rows(report),
    ]
    previous = report["previous"]
    head = (
        f"idem upgrade soak: seed {report['seed']}, {previous['release']}"
        f" ({previous['commit'][:7]}) -> this checkout, order {','.join(report['order'])},"
        f" {report['duration']:g} s, {report['events']} events,"
        f" {report['workers']} workers x {report['concurrency']}, {report['started_at']}"
    )
    return render(head, rows)
