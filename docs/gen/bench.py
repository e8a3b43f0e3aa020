"""The performance page's opening table, from the latest bench document (`make bench` copies
bench/results/latest.json to docs/bench/latest.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LATEST = Path(__file__).resolve().parents[1] / "bench" / "latest.json"
MARKER = "<!-- bench: latest run -->"


def _number(value: float, unit: str) -> str:
    if unit in ("ms", "MiB") or not float(value).is_integer():
        return f"{value:,.1f} {unit}".replace(",", " ")
    return f"{value:,.0f} {unit}".replace(",", " ")


def table(document: dict[str, Any]) -> str:
    """The machine's facts and every check of the run: figure, what it is beside, target."""
    machine = document.get("machine", {})
    lines = [
        f"Run of {machine.get('date', '?')} ({document.get('profile', '')} profile, "
        f"{document.get('seconds', 0):.0f} s).",
        "",
    ]
    if document.get("note"):
        lines += [f"*{document['note']}*", ""]
    lines += ["| machine | |", "|---|---|"]
    for name, value in machine.items():
        shown = ", ".join(str(v) for v in value) if isinstance(value, list) else str(value)
        lines.append(f"| {name} | {shown} |")
    lines += ["", "| section | figure | measured | beside | target | |"]
    lines.append("|---|---|---:|---:|---|---|")
    for check in document.get("checks", []):
        beside = check["reference"]
        if check.get("reference_value") is not None:
            beside = f"{beside} {_number(check['reference_value'], check['unit'])}".strip()
        verdict = "PASS" if check["ok"] else "FAIL"
        lines.append(
            f"| {check['section']} | {check['figure']} | {_number(check['value'], check['unit'])} "
            f"| {beside} | {check['target']} | {verdict} |"
        )
    failed = document.get("failed_sections") or []
    if failed:
        lines += ["", f"Sections that failed to measure: {', '.join(failed)}."]
    return "\n".join(lines) + "\n"


def latest_table() -> str:
    return table(json.loads(LATEST.read_text(encoding="utf-8")))
