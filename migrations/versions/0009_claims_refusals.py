"""Claims refused by the claims API counted apart from deliveries refused by a worker.

`/v1/claims` answering a repeat (already succeeded, in progress, finished, another payload, not
a claim key) bumped `blocked_deliveries`, so /metrics and /v1/stats reported it as
`duplicates_blocked{where="worker"}`. It now bumps `refused_claims` on the key, and
`key_counter_totals.refused_claims` keeps the total (`where="claims"`). Refusals counted
before this revision stay under the worker: the two cannot be told apart afterwards.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The trigger function of 0007, with a fourth counter; `refused` is None for 0007's own.
_ADD = """
CREATE OR REPLACE FUNCTION key_counter_totals_add() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    d bigint := NEW.duplicate_count;
    b bigint := NEW.blocked_deliveries;
    r bigint := NEW.reclaimed_count;
    {declare_refused}
BEGIN
    IF TG_OP = 'UPDATE' THEN
        d := d - OLD.duplicate_count;
        b := b - OLD.blocked_deliveries;
        r := r - OLD.reclaimed_count;
        {subtract_refused}
    END IF;
    -- Counters only count up: a replay or a purge never takes a repeat back.
    INSERT INTO key_counter_totals AS t (shard, duplicates, blocked, reclaimed{refused_column})
    VALUES (pg_backend_pid() % 8, GREATEST(d, 0), GREATEST(b, 0), GREATEST(r, 0){refused_value})
    ON CONFLICT (shard) DO UPDATE
       SET duplicates = t.duplicates + EXCLUDED.duplicates,
           blocked = t.blocked + EXCLUDED.blocked,
           reclaimed = t.reclaimed + EXCLUDED.reclaimed{refused_set};
    RETURN NULL;
END
$$
"""


def _function(with_refused: bool) -> str:
    parts = {
        "declare_refused": "c bigint := NEW.refused_claims;",
        "subtract_refused": "c := c - OLD.refused_claims;",
        "refused_column": ", refused_claims",
        "refused_value": ", GREATEST(c, 0)",
        "refused_set": ",\n           refused_claims = t.refused_claims + EXCLUDED.refused_claims",
    }
    return _ADD.format(**(parts if with_refused else dict.fromkeys(parts, "")))


def _triggers(columns: Sequence[str]) -> None:
    """(Re)create 0007's two triggers over `columns`: they fire only when one goes up."""
    op.execute("DROP TRIGGER IF EXISTS key_counter_totals_update ON idempotency_keys")
    op.execute("DROP TRIGGER IF EXISTS key_counter_totals_insert ON idempotency_keys")
    went_up = " OR ".join(f"NEW.{c} > OLD.{c}" for c in columns)
    above_zero = " OR ".join(f"NEW.{c} > 0" for c in columns)
    op.execute(
        f"CREATE TRIGGER key_counter_totals_update AFTER UPDATE OF {', '.join(columns)}"
        f" ON idempotency_keys FOR EACH ROW WHEN ({went_up})"
        " EXECUTE FUNCTION key_counter_totals_add()"
    )
    op.execute(
        "CREATE TRIGGER key_counter_totals_insert AFTER INSERT ON idempotency_keys"
        f" FOR EACH ROW WHEN ({above_zero}) EXECUTE FUNCTION key_counter_totals_add()"
    )


_COUNTERS = ("duplicate_count", "blocked_deliveries", "reclaimed_count")


def upgrade() -> None:
    # Both ADD COLUMNs with a constant default change no row (PostgreSQL 11+): instant.
    op.execute("ALTER TABLE idempotency_keys ADD COLUMN refused_claims integer NOT NULL DEFAULT 0")
    op.execute("ALTER TABLE key_counter_totals ADD COLUMN refused_claims bigint NOT NULL DEFAULT 0")
    op.execute(_function(with_refused=True))
    _triggers((*_COUNTERS, "refused_claims"))


def downgrade() -> None:
    op.execute(_function(with_refused=False))
    _triggers(_COUNTERS)
    op.execute("ALTER TABLE key_counter_totals DROP COLUMN refused_claims")
    op.execute("ALTER TABLE idempotency_keys DROP COLUMN refused_claims")
