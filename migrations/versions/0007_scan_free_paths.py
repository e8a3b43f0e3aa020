"""Scan-free periodic paths and the relay's claim lease.

- `outbox.claimed_until`: a relay takes a batch by setting a short lease on its rows (one
  committed statement), publishes with no transaction open, then marks the rows published. A
  relay that dies mid-publish leaves rows that another relay takes once the lease has ended.
- Indexes for the paths that ran on a timer or on every scrape and read the whole table:
  pruning published outbox rows (`published_at`), the console's per-minute chart (keys by
  `created_at`, successes by `updated_at`, dead letters by `created_at`), and counting or
  replaying keys in a final failed state.
- `key_counter_totals`: the duplicates blocked and leases reclaimed, kept as they happen by a
  trigger that fires only when one of those counters moves (a repeat, a refused delivery, a
  reclaim), so /metrics and /v1/stats no longer sum a column over every key. Rows are spread
  over a few shards (by server process) so concurrent repeats do not queue on one row.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("ALTER TABLE outbox ADD COLUMN claimed_until timestamptz")
    # Pruning: published rows past the retention, oldest first.
    op.execute(
        "CREATE INDEX outbox_published_idx ON outbox (published_at) WHERE published_at IS NOT NULL"
    )
    # The chart's "accepted per minute".
    op.execute("CREATE INDEX idempotency_keys_created_idx ON idempotency_keys (created_at)")
    # The chart's "succeeded per minute": a success is the key's last change.
    op.execute(
        "CREATE INDEX idempotency_keys_succeeded_idx ON idempotency_keys (updated_at)"
        " WHERE status = 'succeeded'"
    )
    # Counting final failures, and replaying any mix of failed states (a replay filter names
    # them as one `status = ANY(...)`, which one partial index must cover; processing keys
    # have theirs since 0001).
    op.execute(
        "CREATE INDEX idempotency_keys_failed_idx ON idempotency_keys (updated_at)"
        " WHERE status IN ('failed_retryable', 'failed_final', 'quarantined')"
    )
    # The chart's "failed per minute" (dead_letters_open_idx covers open ones only).
    op.execute("CREATE INDEX dead_letters_created_idx ON dead_letters (created_at)")

    op.execute(
        """
        CREATE TABLE key_counter_totals (
            shard       integer PRIMARY KEY,
            -- Repeats answered by the receiver (idempotency_keys.duplicate_count).
            duplicates  bigint NOT NULL DEFAULT 0,
            -- Deliveries a worker refused (idempotency_keys.blocked_deliveries).
            blocked     bigint NOT NULL DEFAULT 0,
            -- Claims that took over an expired lease (idempotency_keys.reclaimed_count).
            reclaimed   bigint NOT NULL DEFAULT 0
        )
        """
    )
    # The totals so far, once; from here on the trigger keeps them.
    op.execute(
        """
        INSERT INTO key_counter_totals (shard, duplicates, blocked, reclaimed)
        SELECT 0, COALESCE(sum(duplicate_count), 0), COALESCE(sum(blocked_deliveries), 0),
               COALESCE(sum(reclaimed_count), 0)
          FROM idempotency_keys
        """
    )
    op.execute(
        """
        CREATE FUNCTION key_counter_totals_add() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            d bigint := NEW.duplicate_count;
            b bigint := NEW.blocked_deliveries;
            r bigint := NEW.reclaimed_count;
        BEGIN
            IF TG_OP = 'UPDATE' THEN
                d := d - OLD.duplicate_count;
                b := b - OLD.blocked_deliveries;
                r := r - OLD.reclaimed_count;
            END IF;
            -- Counters only count up: a replay or a purge never takes a repeat back.
            INSERT INTO key_counter_totals AS t (shard, duplicates, blocked, reclaimed)
            VALUES (pg_backend_pid() % 8, GREATEST(d, 0), GREATEST(b, 0), GREATEST(r, 0))
            ON CONFLICT (shard) DO UPDATE
               SET duplicates = t.duplicates + EXCLUDED.duplicates,
                   blocked = t.blocked + EXCLUDED.blocked,
                   reclaimed = t.reclaimed + EXCLUDED.reclaimed;
            RETURN NULL;
        END
        $$
        """
    )
    # WHEN keeps the trigger off the hot path: a new key, a claim or a finish moves none of
    # the three counters and fires nothing.
    op.execute(
        """
        CREATE TRIGGER key_counter_totals_update
        AFTER UPDATE OF duplicate_count, blocked_deliveries, reclaimed_count
        ON idempotency_keys FOR EACH ROW
        WHEN (NEW.duplicate_count > OLD.duplicate_count
              OR NEW.blocked_deliveries > OLD.blocked_deliveries
              OR NEW.reclaimed_count > OLD.reclaimed_count)
        EXECUTE FUNCTION key_counter_totals_add()
        """
    )
    op.execute(
        """
        CREATE TRIGGER key_counter_totals_insert
        AFTER INSERT ON idempotency_keys FOR EACH ROW
        WHEN (NEW.duplicate_count > 0 OR NEW.blocked_deliveries > 0 OR NEW.reclaimed_count > 0)
        EXECUTE FUNCTION key_counter_totals_add()
        """
    )
    # Emptying the keys (a test, a fresh start) starts the totals again.
    op.execute(
        """
        CREATE FUNCTION key_counter_totals_reset() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            DELETE FROM key_counter_totals;
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        "CREATE TRIGGER key_counter_totals_truncate AFTER TRUNCATE ON idempotency_keys"
        " FOR EACH STATEMENT EXECUTE FUNCTION key_counter_totals_reset()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER key_counter_totals_truncate ON idempotency_keys")
    op.execute("DROP TRIGGER key_counter_totals_insert ON idempotency_keys")
    op.execute("DROP TRIGGER key_counter_totals_update ON idempotency_keys")
    op.execute("DROP FUNCTION key_counter_totals_reset()")
    op.execute("DROP FUNCTION key_counter_totals_add()")
    op.execute("DROP TABLE key_counter_totals")
    op.execute("DROP INDEX dead_letters_created_idx")
    op.execute("DROP INDEX idempotency_keys_failed_idx")
    op.execute("DROP INDEX idempotency_keys_succeeded_idx")
    op.execute("DROP INDEX idempotency_keys_created_idx")
    op.execute("DROP INDEX outbox_published_idx")
    op.execute("ALTER TABLE outbox DROP COLUMN claimed_until")
