"""The docs site's reference is complete: every setting, routes-file key, command, error code
and metric the code defines has a description, and the generated pages show each of them."""

from __future__ import annotations

import pytest
from pydantic import Field

from docs.gen import bench, cli, lifecycle, models, observed, scan
from docs.gen.pages import pages
from outbox.core.problems import TITLES
from outbox.core.settings import Settings
from outbox.store.lifecycle import TRANSITIONS, Status
from tests.support import ROOT

README_MAX_LINES = 250


def test_every_setting_and_routes_file_key_is_described() -> None:
    """descriptions.toml describes every field of the settings and routes-file models."""
    assert models.missing_descriptions() == []


def test_no_description_names_a_field_that_does_not_exist() -> None:
    """A renamed or removed field leaves no description behind."""
    assert models.stale_descriptions() == []


def test_a_new_setting_without_a_description_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check sees a field it has no text for (the check itself can fail)."""

    class Grown(Settings):
        brand_new_knob: int = Field(default=3)

    monkeypatch.setitem(models.MODELS, "settings", Grown)
    assert models.missing_descriptions() == ["settings.brand_new_knob"]


def test_every_command_and_option_has_help() -> None:
    """Every `idem` command, sub-commands included, and each of its options and arguments."""
    names = {command.name for command in cli.commands()}
    assert {"idem dev", "idem serve", "idem dlq list", "idem routes pause"} <= names
    assert cli.undocumented() == []


def test_every_error_code_has_a_meaning() -> None:
    """Each code raised anywhere (or in the registry) has a title or a description."""
    codes = observed.error_descriptions()
    assert {"no_route", "idempotency_key_reused", "version_ahead", "body_too_slow"} <= set(codes)
    assert [code for code, text in codes.items() if not text.strip()] == []


def test_error_descriptions_name_only_codes_the_registry_lacks() -> None:
    """descriptions.toml's `[errors]` holds codes that are raised and have no registry title:
    a code given a title in outbox/core/problems.py, or no longer raised, leaves it."""
    extra = models.descriptions().get("errors", {})
    raised = scan.error_codes()
    assert [code for code in extra if code not in raised or code in TITLES] == []


def test_every_metric_has_help_text() -> None:
    """Each collector's metric has its documentation string (what /metrics shows as HELP)."""
    found = scan.metrics()
    assert {"idem_events_accepted", "idem_attempts", "idem_outbox_backlog"} <= {
        metric.name for metric in found
    }
    assert [metric.name for metric in found if not metric.help.strip()] == []


def test_the_generated_pages_show_every_name() -> None:
    """Each setting's variable, each routes-file key, command, code, metric and log event is on
    its page: the pages are built from the same lists the checks above read."""
    built = pages()
    for name in Settings.model_fields:
        assert f"| `{name.upper()}` |" in built["reference/settings.md"], name
    for section in models.MODELS:
        for name in models.own_fields(section):
            assert f"| `{name}` |" in built["reference/routes-file.md"] or section == "settings"
    for command in cli.commands():
        assert f"## `{command.name}`" in built["reference/cli.md"]
    for code in observed.error_descriptions():
        assert f"| `{code}` |" in built["reference/errors.md"]
    for metric in scan.metrics():
        assert f"| `{metric.name}` |" in built["reference/metrics.md"]
    events = scan.log_events()
    assert {"relay.published", "attempt.finished"} <= set(events)
    for event in events:
        assert f"| `{event}` |" in built["reference/logs.md"]
    assert "| `POST` | `/v1/events` |" in built["reference/http-api.md"]


def test_the_performance_page_opens_with_the_latest_runs_table() -> None:
    """The page's first section is the latest run, whose table (the marker the site's build
    replaces) lists every check of the committed bench document, each with its verdict."""
    page = (ROOT / "docs/explanation/performance.md").read_text(encoding="utf-8")
    first = page.split("\n## ")[1]
    assert first.startswith("The latest run\n") and bench.MARKER in first
    table = bench.latest_table()
    document = bench.json.loads(bench.LATEST.read_text(encoding="utf-8"))
    assert document["checks"]
    for check in document["checks"]:
        assert f"| {check['section']} | {check['figure']} |" in table


def test_the_readme_is_a_front_door() -> None:
    """At most 250 lines, and it links into the docs site rather than holding it."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    for target in ["docs/tutorials/first-event.md", "docs/tutorials/n8n-exactly-once.md"]:
        assert f"]({target})" in readme
        assert (ROOT / target).is_file()
    assert "make test" in readme and "make run" in readme


def test_the_architecture_page_draws_every_transition() -> None:
    """The key lifecycle's diagram is drawn from the transitions the code allows, on the
    architecture page: every status and every transition's name is in it."""
    page = (ROOT / "docs/explanation/architecture.md").read_text(encoding="utf-8")
    assert lifecycle.MARKER in page
    drawn = lifecycle.diagram()
    for status in Status:
        assert f" {status.value} " in drawn or f" {status.value}:" in drawn, status
    for transition in TRANSITIONS:
        assert transition.name in drawn, transition.name
