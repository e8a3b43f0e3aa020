"""Each figure beside its ceiling and target, as a rich table and as JSON."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass
class Check:
    section: str
    figure: str
    value: float
    unit: str
    # What the figure is measured against (a ceiling, a baseline, a limit), with its value.
    reference: str
    reference_value: float | None
    target: str
    ok: bool


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _number(value: float, unit: str) -> str:
    if unit == "%":
        return f"{value:.0f} %"
    if unit in ("ms", "MiB"):
        return f"{value:,.1f} {unit}"
    return f"{value:,.0f} {unit}"


def facts_table(facts: dict[str, Any]) -> Table:
    table = Table(title="Machine", show_header=False, title_justify="left")
    table.add_column("fact", style="bold")
    table.add_column("value")
    for name, value in facts.items():
        shown = ", ".join(str(v) for v in value) if isinstance(value, list) else str(value)
        table.add_row(name, shown)
    return table


def checks_table(checks: list[Check], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("section")
    table.add_column("figure")
    table.add_column("measured", justify="right")
    table.add_column("beside", justify="right")
    table.add_column("target")
    table.add_column("", justify="center")
    for check in checks:
        reference = check.reference
        if check.reference_value is not None:
            reference = f"{reference} {_number(check.reference_value, check.unit)}"
        table.add_row(
            check.section,
            check.figure,
            _number(check.value, check.unit),
            reference,
            check.target,
            "[green]PASS[/]" if check.ok else "[red]FAIL[/]",
        )
    return table


def print_report(console: Console, facts: dict[str, Any], checks: list[Check], title: str) -> None:
    console.print(facts_table(facts))
    console.print(checks_table(checks, title))


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")


def checks_json(checks: list[Check]) -> list[dict[str, Any]]:
    return [asdict(check) for check in checks]
