"""The overview's per-minute chart, drawn as SVG on the server."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta

from outbox.operate.console import charts

SVG = "{http://www.w3.org/2000/svg}"


def _hour(failed_at: int = 59) -> list[charts.Minute]:
    start = datetime(2026, 11, 30, 3, 0, tzinfo=UTC)
    return [
        charts.Minute(
            start + timedelta(minutes=i),
            accepted=i % 7,
            succeeded=i % 5,
            failed=3 if i == failed_at else 0,
        )
        for i in range(60)
    ]


def test_the_chart_draws_three_series_with_a_text_description() -> None:
    """Three polylines, one point per minute, and a title and description for screen readers."""
    points = _hour()
    root = ET.fromstring(str(charts.render_svg(points)))
    lines = root.findall(f"{SVG}polyline")
    assert len(lines) == 3
    assert all(len(line.attrib["points"].split()) == 60 for line in lines)
    # Told apart by pattern, not only by colour.
    assert len({line.attrib.get("stroke-dasharray", "") for line in lines}) == 3
    desc = root.find(f"{SVG}desc")
    assert desc is not None and desc.text is not None
    totals = charts.totals(points)
    assert f"{totals['accepted']} accepted" in desc.text and "3 failed" in desc.text
    labels = [t.text for t in root.findall(f"{SVG}text")]
    assert "03:00" in labels and "03:59" in labels


def test_an_empty_hour_still_draws_axes() -> None:
    """With no events the chart has a zero baseline and whole-number ticks up to 4."""
    empty = [charts.Minute(m.at, 0, 0, 0) for m in _hour()]
    root = ET.fromstring(str(charts.render_svg(empty, width=360, label_every=30)))
    ticks = {t.text for t in root.findall(f"{SVG}text")}
    assert {"0", "1", "2", "3", "4"} <= ticks
    assert not root.findall(f"{SVG}circle")


def test_the_y_axis_ends_on_a_round_number() -> None:
    """The axis' top is the smallest round bound at or above the peak."""
    assert [charts._nice_max(v) for v in (0, 3, 4, 5, 7, 11, 21, 26, 49, 51, 99, 101, 240)] == [
        4,
        4,
        4,
        5,
        10,
        20,
        25,
        50,
        50,
        100,
        100,
        200,
        250,
    ]
