"""bench.flame_svg: a flame graph drawn on one machine names nothing of it (the committed
graphs in docs/images must not carry a machine's paths)."""

from __future__ import annotations

from pathlib import Path

from bench.flame_svg import render, tree

ROOT = Path(__file__).resolve().parents[2]


def test_directories_of_absolute_paths_are_dropped_and_relative_frames_kept() -> None:
    collapsed = (
        '4242:"/srv/app/.venv/bin/python -m outbox.cli serve";'
        "post_event (outbox/ingest/events.py:54);"
        "execute (/opt/py/lib/python3.11/site-packages/sqlalchemy/engine/base.py:12) 7\n"
    )
    process = next(iter(tree(collapsed).children.values()))
    handler = next(iter(process.children.values()))
    assert process.name == '4242:"python -m outbox.cli serve"'
    assert handler.name == "post_event (outbox/ingest/events.py)"
    assert list(handler.children) == ["execute (base.py)"]
    assert "/srv/" not in render(collapsed, "receiver")


def test_the_committed_flame_graphs_name_no_machine_path() -> None:
    for svg in sorted((ROOT / "docs/images").glob("flame-*.svg")):
        text = svg.read_text(encoding="utf-8")
        # No absolute directory of the machine that drew it (a frame keeps a file's name).
        roots = [f"/{name}/" for name in ("work", "root", "home", "tmp")]
        assert not any(root in text for root in roots), svg.name
