"""The schema page: migrations/schema.sql, the database as the migrations leave it."""

from __future__ import annotations

from pathlib import Path

SCHEMA = Path(__file__).resolve().parents[2] / "migrations" / "schema.sql"


def page() -> str:
    return "\n".join(
        [
            "# Database schema",
            "",
            "The whole current schema, tables, indexes, triggers and every plpgsql function's",
            "body, as a freshly migrated database holds it: `migrations/schema.sql`, dumped from",
            "one and checked against one by `tests/integration/store/test_schema_file.py`. The",
            "migrations (`migrations/versions/`) remain how a database gets there; day partitions",
            "of `outbox` (`outbox_YYYYMMDD`) are created by the sweeper and left out.",
            "",
            "```sql",
            SCHEMA.read_text(encoding="utf-8").rstrip(),
            "```",
            "",
        ]
    )
