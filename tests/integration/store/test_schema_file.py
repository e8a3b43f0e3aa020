"""migrations/schema.sql is the schema a freshly migrated database holds: a reader sees every
table, trigger and function body there without replaying the migrations."""

from __future__ import annotations

from docs.gen import schema


def test_schema_sql_is_what_the_migrations_leave(own_database: str) -> None:
    """A fresh database migrated to head dumps to exactly the committed file (after a
    migration, `python -m docs.gen.schema` writes it anew)."""
    assert schema.dump(own_database) == schema.SCHEMA.read_text(encoding="utf-8"), (
        "migrations/schema.sql is stale: run `python -m docs.gen.schema`"
    )


def test_schema_sql_holds_the_domain_functions() -> None:
    """The lanes' and counters' plpgsql functions and the outbox's NOTIFY trigger are there,
    bodies included."""
    text = schema.SCHEMA.read_text(encoding="utf-8")
    for name in ["lane_admit", "lane_wake", "outbox_notify", "key_counter_totals_add"]:
        assert f"CREATE FUNCTION public.{name}(" in text, name
    assert "CREATE TRIGGER" in text and "CREATE TABLE public.idempotency_keys (" in text
