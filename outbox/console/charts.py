"""The overview's chart: accepted, succeeded and failed events per minute over the last hour,
drawn on the server as SVG (no script, no external asset).

Series are told apart by line pattern and marker as well as colour, the legend names them in
text, and the page carries the same numbers as a table for screen readers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape

from markupsafe import Markup
from sqlalchemy import Engine, TextClause, text

MINUTES = 60

PER_MINUTE: TextClause = text(
    """
    -- Read-only. Accepted: keys created in the minute. Succeeded: succeeded keys whose last
    -- change (the success) fell in the minute. Failed: dead letters written in the minute.
    WITH bounds AS (
        SELECT date_trunc('minute', now()) - make_interval(mins => :minutes - 1) AS start,
               date_trunc('minute', now()) AS stop
    ), minutes AS (
        SELECT generate_series(b.start, b.stop, interval '1 minute') AS minute FROM bounds b
    ), accepted AS (
        SELECT date_trunc('minute', k.created_at) AS minute, count(*) AS n
          FROM idempotency_keys k, bounds b
         WHERE k.created_at >= b.start
         GROUP BY 1
    ), succeeded AS (
        SELECT date_trunc('minute', k.updated_at) AS minute, count(*) AS n
          FROM idempotency_keys k, bounds b
         WHERE k.status = 'succeeded' AND k.updated_at >= b.start
         GROUP BY 1
    ), failed AS (
        SELECT date_trunc('minute', d.created_at) AS minute, count(*) AS n
          FROM dead_letters d, bounds b
         WHERE d.created_at >= b.start
         GROUP BY 1
    )
    SELECT m.minute, COALESCE(a.n, 0) AS accepted, COALESCE(s.n, 0) AS succeeded,
           COALESCE(f.n, 0) AS failed
      FROM minutes m
      LEFT JOIN accepted a USING (minute)
      LEFT JOIN succeeded s USING (minute)
      LEFT JOIN failed f USING (minute)
     ORDER BY m.minute
    """
)


@dataclass(frozen=True)
class Minute:
    at: datetime
    accepted: int
    succeeded: int
    failed: int


@dataclass(frozen=True)
class Series:
    name: str
    attribute: str
    css_class: str
    dash: str
    marker: str  # "circle" | "square" | "triangle"


SERIES = (
    Series("accepted", "accepted", "s-accepted", "", "circle"),
    Series("succeeded", "succeeded", "s-succeeded", "6 4", "square"),
    Series("failed", "failed", "s-failed", "2 3", "triangle"),
)


def per_minute(engine: Engine, minutes: int = MINUTES) -> list[Minute]:
    """Counts for each of the last `minutes` minutes, oldest first, zeros included."""
    with engine.connect() as conn:
        rows = conn.execute(PER_MINUTE, {"minutes": minutes}).all()
    return [
        Minute(r.minute.astimezone(UTC), int(r.accepted), int(r.succeeded), int(r.failed))
        for r in rows
    ]


def totals(points: list[Minute]) -> dict[str, int]:
    return {s.name: sum(getattr(p, s.attribute) for p in points) for s in SERIES}


def _nice_max(value: int) -> int:
    """A round upper bound for the y axis (at least 4, so the ticks are whole numbers)."""
    if value <= 4:
        return 4
    for step in (5, 10, 20, 25, 50):
        if value <= step:
            return step
    magnitude = 10 ** (len(str(value)) - 1)
    for factor in (1, 2, 2.5, 5, 10):
        bound = int(magnitude * factor)
        if value <= bound:
            return bound
    return value  # pragma: no cover - the loop always ends at 10 * magnitude


def _marker(kind: str, x: float, y: float, css_class: str) -> str:
    if kind == "square":
        return f'<rect class="{css_class}" x="{x - 3:.1f}" y="{y - 3:.1f}" width="6" height="6"/>'
    if kind == "triangle":
        return (
            f'<polygon class="{css_class}" '
            f'points="{x:.1f},{y - 4:.1f} {x - 4:.1f},{y + 3:.1f} {x + 4:.1f},{y + 3:.1f}"/>'
        )
    return f'<circle class="{css_class}" cx="{x:.1f}" cy="{y:.1f}" r="3"/>'


def render_svg(points: list[Minute], width: int = 720, height: int = 260) -> Markup:
    """The chart as inline SVG markup (escaped, safe to put in a template)."""
    left, right, top, bottom = 40, 12, 12, 44
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = max((getattr(p, s.attribute) for p in points for s in SERIES), default=0)
    y_max = _nice_max(peak)
    count = max(len(points), 2)

    def x_at(i: int) -> float:
        return left + plot_w * i / (count - 1)

    def y_at(v: int) -> float:
        return top + plot_h - plot_h * v / y_max

    sums = totals(points)
    summary = ", ".join(f"{sums[s.name]} {s.name}" for s in SERIES)
    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-labelledby="chart-title chart-desc" xmlns="http://www.w3.org/2000/svg">',
        '<title id="chart-title">Events per minute, last hour</title>',
        f'<desc id="chart-desc">Last {len(points)} minutes: {escape(summary)}.</desc>',
    ]
    for i in range(5):
        value = y_max * i // 4
        y = y_at(value)
        parts.append(
            f'<line class="grid" x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}"/>'
        )
        parts.append(
            f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{value}</text>'
        )
    for i, p in enumerate(points):
        if p.at.minute % 15 == 0 or i == len(points) - 1:
            x = x_at(i)
            parts.append(
                f'<line class="axis" x1="{x:.1f}" y1="{top + plot_h}" x2="{x:.1f}" '
                f'y2="{top + plot_h + 4}"/>'
            )
            parts.append(
                f'<text class="tick" x="{x:.1f}" y="{top + plot_h + 18}" '
                f'text-anchor="middle">{p.at:%H:%M}</text>'
            )
    parts.append(
        f'<line class="axis" x1="{left}" y1="{top + plot_h}" x2="{width - right}" '
        f'y2="{top + plot_h}"/>'
    )
    for s in SERIES:
        coords = " ".join(
            f"{x_at(i):.1f},{y_at(getattr(p, s.attribute)):.1f}" for i, p in enumerate(points)
        )
        dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
        parts.append(f'<polyline class="line {s.css_class}" fill="none"{dash} points="{coords}"/>')
        for i, p in enumerate(points):
            value = getattr(p, s.attribute)
            if value:
                parts.append(_marker(s.marker, x_at(i), y_at(value), f"dot {s.css_class}"))
    legend_y = height - 8
    x = left
    for s in SERIES:
        dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
        parts.append(
            f'<line class="line {s.css_class}" x1="{x}" y1="{legend_y - 4}" x2="{x + 24}" '
            f'y2="{legend_y - 4}"{dash}/>'
        )
        parts.append(_marker(s.marker, x + 12, legend_y - 4, f"dot {s.css_class}"))
        parts.append(
            f'<text class="legend" x="{x + 30}" y="{legend_y}">{s.name} ({sums[s.name]})</text>'
        )
        x += 170
    zone = f"{points[-1].at:%Z}" if points else ""
    if zone:
        parts.append(
            f'<text class="tick" x="{width - right}" y="{legend_y}" text-anchor="end">'
            f"{escape(zone)}</text>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))
