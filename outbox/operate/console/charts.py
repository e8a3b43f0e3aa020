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
    -- Read-only. Accepted: keys created in the minute, a fan-out event's deliveries aside
    -- (its own key counts it once). Succeeded: succeeded keys whose last change (the
    -- success) fell in the minute, each delivery by itself. Failed: dead letters written in
    -- the minute.
    WITH bounds AS (
        SELECT date_trunc('minute', now()) - make_interval(mins => :minutes - 1) AS start,
               date_trunc('minute', now()) AS stop
    ), minutes AS (
        SELECT generate_series(b.start, b.stop, interval '1 minute') AS minute FROM bounds b
    ), accepted AS (
        SELECT date_trunc('minute', k.created_at) AS minute, count(*) AS n
          FROM idempotency_keys k, bounds b
         WHERE k.created_at >= b.start AND k.event_key IS NULL
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


def legend_sample(series: Series) -> Markup:
    """A small line-and-marker sample of a series, for the legend next to the chart."""
    dash = f' stroke-dasharray="{series.dash}"' if series.dash else ""
    return Markup(
        '<svg class="chart sample" viewBox="0 0 28 12" width="28" height="12" aria-hidden="true" '
        'xmlns="http://www.w3.org/2000/svg">'
        f'<line class="line {series.css_class}" x1="1" y1="6" x2="27" y2="6"{dash}/>'
        f"{_marker(series.marker, 14, 6, f'dot {series.css_class}')}</svg>"
    )


def render_svg(
    points: list[Minute],
    *,
    width: int = 900,
    height: int = 220,
    label_every: int = 15,
    id_prefix: str = "chart",
) -> Markup:
    """The chart as inline SVG markup (escaped, safe to put in a template). The legend is
    not part of it: the page writes it in text, with `legend_sample` for each series."""
    left, right, top, bottom = 34, 22, 10, 26
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
    title_id, desc_id = f"{id_prefix}-title", f"{id_prefix}-desc"
    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-labelledby="{title_id} {desc_id}" xmlns="http://www.w3.org/2000/svg">',
        f'<title id="{title_id}">Events per minute, last hour (UTC)</title>',
        f'<desc id="{desc_id}">Last {len(points)} minutes: {escape(summary)}.</desc>',
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
        last = i == len(points) - 1
        if p.at.minute % label_every == 0 or last:
            if not last and len(points) - 1 - i < label_every / 3:
                continue  # too close to the last label
            x = x_at(i)
            anchor = "end" if last else "middle"
            parts.append(
                f'<line class="axis" x1="{x:.1f}" y1="{top + plot_h}" x2="{x:.1f}" '
                f'y2="{top + plot_h + 4}"/>'
            )
            parts.append(
                f'<text class="tick" x="{x + (8 if last else 0):.1f}" y="{top + plot_h + 18}" '
                f'text-anchor="{anchor}">{p.at:%H:%M}</text>'
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
    parts.append("</svg>")
    return Markup("".join(parts))
