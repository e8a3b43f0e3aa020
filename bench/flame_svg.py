"""A flame graph as a static SVG from collapsed stacks (py-spy's `raw` format: one line per
distinct stack, frames joined by ";", then a space and the sample count).

One SVG per process, readable in a browser or on a repository page: each box is a frame, its
width the share of samples with that frame at that place on the stack, callers below callees;
hovering a box shows its frame, samples and share. Frames narrower than `min_share` of the
whole are left out (with the samples they hold) so that the file stays small.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html import escape

WIDTH = 1200
ROW = 16
FONT = 11
CHAR = 6.2  # px per character at FONT, for trimming labels to their box
LINE = re.compile(r":\d+\)$")
# A directory in a frame (the process's command line names its interpreter by path): only
# the file's name is kept, so a graph drawn on one machine names nothing of it.
DIRECTORY = re.compile(r"(?<![^\s\"(])(?:/[^/\s\"();]+)+/")


@dataclass
class Node:
    name: str
    count: int = 0
    children: dict[str, Node] = field(default_factory=dict)


def tree(collapsed: str) -> Node:
    root = Node("all")
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        root.count += count
        node = root
        for frame in stack.split(";"):
            # One box per function: py-spy's frames name their line, dropped here.
            frame = DIRECTORY.sub("", LINE.sub(")", frame))
            node = node.children.setdefault(frame, Node(frame))
            node.count += count
    return root


def _color(name: str) -> str:
    """Warm colours, stable per frame; this project's frames (outbox/, worker/) in blue."""
    where = name.partition(" (")[2]
    seed = sum(ord(c) for c in name)
    if where.startswith(("outbox/", "worker/")):
        return f"rgb({80 + seed % 40},{140 + seed % 50},{215 + seed % 40})"
    return f"rgb({205 + seed % 50},{90 + seed % 110},{40 + seed % 40})"


def render(collapsed: str, title: str, min_share: float = 0.002) -> str:
    root = tree(collapsed)
    total = max(root.count, 1)
    boxes: list[str] = []
    depth_max = 0

    def place(node: Node, x: float, depth: int) -> None:
        nonlocal depth_max
        width = WIDTH * node.count / total
        if node.count / total < min_share:
            return
        depth_max = max(depth_max, depth)
        boxes.append(_box(node, x, depth, width, total))
        offset = x
        for child in sorted(node.children.values(), key=lambda n: n.name):
            place(child, offset, depth + 1)
            offset += WIDTH * child.count / total

    place(root, 0.0, 0)
    height = (depth_max + 1) * ROW + 40
    # Depth 0 at the bottom, as flame graphs are drawn.
    body = "\n".join(boxes)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="monospace" font-size="{FONT}">\n'
        f'<rect width="100%" height="100%" fill="#fdfdf6"/>\n'
        f'<text x="6" y="18" font-size="14">{escape(title)} ({root.count} samples)</text>\n'
        f'<g transform="translate(0,{height - ROW}) scale(1,-1)">\n{body}\n</g>\n</svg>\n'
    )


def _box(node: Node, x: float, depth: int, width: float, total: int) -> str:
    share = 100 * node.count / total
    label = node.name.replace("process ", "")
    fits = int((width - 4) / CHAR)
    text = ""
    if fits >= 4:
        shown = label if len(label) <= fits else label[: fits - 2] + ".."
        # The text is flipped back upright inside the mirrored group.
        text = (
            f'<text x="{x + 2:.1f}" y="{-(depth * ROW + 4)}" transform="scale(1,-1)">'
            f"{escape(shown)}</text>"
        )
    return (
        f"<g><title>{escape(label)} ({node.count} samples, {share:.1f} %)</title>"
        f'<rect x="{x:.1f}" y="{depth * ROW}" width="{max(width - 0.4, 0.1):.1f}" '
        f'height="{ROW - 1}" fill="{_color(node.name)}"/>{text}</g>'
    )
