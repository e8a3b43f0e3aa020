"""The key lifecycle's state diagram, drawn from `outbox.store.lifecycle.TRANSITIONS` (the
same list a unit test holds against the CHECK constraint and the architecture page's table)."""

from __future__ import annotations

from collections import defaultdict

from outbox.store.lifecycle import TRANSITIONS, Status

MARKER = "<!-- lifecycle: state diagram -->"
# Final states: nothing moves a key out of them but an operator's replay.
FINAL = {Status.SUCCEEDED, Status.SUPERSEDED}


def diagram() -> str:
    """A Mermaid state diagram: one arrow per (from, to) pair, labelled with its transitions."""
    labels: dict[tuple[str, str], list[str]] = defaultdict(list)
    for transition in TRANSITIONS:
        for source in transition.sources:
            start = "[*]" if source is None else source.value
            labels[(start, transition.target.value)].append(transition.name)
    lines = ["```mermaid", "stateDiagram-v2"]
    for (start, end), names in labels.items():
        lines.append(f"    {start} --> {end}: {', '.join(names)}")
    lines += [f"    {status.value} --> [*]" for status in Status if status in FINAL]
    lines.append("```")
    return "\n".join(lines) + "\n"
