"""The reference pages of what the gateway answers and emits: error codes, metrics, log events."""

from __future__ import annotations

from docs.gen import scan
from docs.gen.models import cell, descriptions
from outbox.core.problems import TITLES


def error_descriptions() -> dict[str, str]:
    """Every error code, raised in the code or named in the registry, with what it means: the
    registry's title, else descriptions.toml's `[errors]` text (empty when neither has one)."""
    extra = descriptions().get("errors", {})
    codes = set(scan.error_codes()) | set(TITLES)
    return {code: TITLES.get(code) or extra.get(code, "") for code in sorted(codes)}


def errors_page() -> str:
    uses = scan.error_codes()
    lines = [
        "# Error codes",
        "",
        "Every refusal is an RFC 9457 problem document (`application/problem+json`) whose",
        "`error` member is one of these codes: stable API, for n8n IF nodes and scripts to branch",
        "on. Generated from the problem registry (`outbox/core/problems.py`) and every place the",
        "code raises one.",
        "",
        "```json",
        '{"type": "urn:idem:error:no_route", "title": "No route accepts this event type",',
        ' "status": 422, "detail": "No route accepts event type \'x\'.", "error": "no_route"}',
        "```",
        "",
        "| `error` | status | meaning |",
        "|---|---|---|",
    ]
    for code, text in error_descriptions().items():
        statuses = ", ".join(str(s) for s in sorted(uses[code].statuses)) if code in uses else ""
        lines.append(f"| `{code}` | {statuses} | {cell(text)} |")
    return "\n".join(lines) + "\n"


def metrics_page() -> str:
    lines = [
        "# Metrics",
        "",
        "Prometheus metrics, generated from the collectors' definitions. The receiver serves",
        "`/metrics` (its counters, and the database's state read at each scrape); each worker",
        "serves its own on `WORKER_METRICS_PORT`. Counters are exposed with the `_total` suffix",
        "(`idem_events_accepted_total`). Access: see [`METRICS_TOKEN`](settings.md).",
        "",
        "| metric | type | labels | meaning | defined in |",
        "|---|---|---|---|---|",
    ]
    for metric in scan.metrics():
        labels = ", ".join(f"`{label}`" for label in metric.labels)
        lines.append(
            f"| `{metric.name}` | {metric.kind} | {labels} | {cell(metric.help)} "
            f"| `{metric.module}` |"
        )
    return "\n".join(lines) + "\n"


def logs_page() -> str:
    lines = [
        "# Log events",
        "",
        "Every event name the processes log, generated from the code. Each line is one JSON object",
        "(`LOG_FORMAT=json`) whose `event` member is one of these names, with the event's fields",
        "beside it; secrets, authorization headers and raw payloads are never among them.",
        "",
        "| event | level | logged by |",
        "|---|---|---|",
    ]
    for name, use in scan.log_events().items():
        levels = ", ".join(sorted(use.levels))
        modules = ", ".join(f"`{m}`" for m in sorted(use.modules))
        lines.append(f"| `{name}` | {levels} | {modules} |")
    return "\n".join(lines) + "\n"
