"""README's configuration table matches the settings the gateway reads."""

from __future__ import annotations

import re
from collections import Counter

from outbox.core.settings import Settings
from tests.support import ROOT

# Read by uvicorn itself, not by the gateway's settings.
READ_BY_UVICORN = {"FORWARDED_ALLOW_IPS"}


def _configuration_table() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([A-Z0-9_]+)`(?: / `([A-Z0-9_]+)`)? \|", section, re.MULTILINE)
    return [name for row in rows for name in row if name]


def test_every_setting_is_documented_once_and_nothing_else_is() -> None:
    """Each environment variable the settings read has exactly one row in README's
    "Configuration" table, and the table names no variable the settings do not read."""
    documented = Counter(_configuration_table())
    assert [name for name, count in documented.items() if count > 1] == []
    assert set(documented) == {field.upper() for field in Settings.model_fields} | READ_BY_UVICORN
