"""Every generated page, by its path under docs/."""

from __future__ import annotations

from collections.abc import Callable

from docs.gen import api, cli, observed, reference, schema_page
from docs.gen.scan import ROOT


def changelog_page() -> str:
    """CHANGELOG.md as a page of the site, its links made relative to the site's root."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    return text.replace("](docs/", "](")


GENERATED: dict[str, Callable[[], str]] = {
    "reference/settings.md": reference.settings_page,
    "reference/routes-file.md": reference.routes_page,
    "reference/cli.md": cli.page,
    "reference/http-api.md": api.page,
    "reference/errors.md": observed.errors_page,
    "reference/metrics.md": observed.metrics_page,
    "reference/logs.md": observed.logs_page,
    "reference/schema.md": schema_page.page,
    "changelog.md": changelog_page,
}


def pages() -> dict[str, str]:
    """{path under docs/: Markdown} for every generated page."""
    return {path: build() for path, build in GENERATED.items()}
