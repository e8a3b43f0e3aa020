"""MkDocs hook (mkdocs.yml `hooks:`): adds the generated reference pages to the site and puts
the latest bench run's table into the performance page, at every build."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mkdocs.structure.files import File, Files  # noqa: E402

from docs.gen import bench, lifecycle  # noqa: E402
from docs.gen.pages import pages  # noqa: E402


def on_files(files: Files, config: Any) -> Files:
    for path, content in pages().items():
        files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if bench.MARKER in markdown:
        markdown = markdown.replace(bench.MARKER, bench.latest_table())
    if lifecycle.MARKER in markdown:
        markdown = markdown.replace(lifecycle.MARKER, lifecycle.diagram())
    return markdown
