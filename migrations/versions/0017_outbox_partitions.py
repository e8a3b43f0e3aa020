"""The outbox partitioned by day, so its retention drops whole days instead of deleting rows.

Every event, retry, re-drive and replay adds an outbox row; once published it is kept only to
answer "was it sent, and when?" (`OUTBOX_RETENTION_SECONDS`, a week). Deleting those rows one
by one costs as much as writing them. Partitioned by `created_at` (a day per partition, UTC),
the purge drops a day once every row in it is published and past the retention
(`outbox.maintenance.partitions`): milliseconds, no dead rows, nothing for autovacuum.

No row is copied. The existing table becomes the partition of everything created before the
next midnight (UTC) and is dropped like any day once its newest row is past the retention; the
next days get partitions of their own, and a DEFAULT partition takes any row whose day has none
yet (the sweeper creates them ahead), so an insert never fails for want of a partition. The
existing table's indexes become its partition's; its key reference is taken over as it is.
Attaching it scans the table once to check its range, under the migration's lock.

Only the outbox is partitioned. A key must be unique across all time (PostgreSQL enforces a
unique index on a partitioned table only together with the partition key), and it lives a TTL
after its last change, not after its creation; an event lives as long as its key. Both stay
single tables, purged in batches (docs/how-to/scaling-out.md, "Partitioning").

The downgrade copies the rows back into a single table.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05
"""

from collections.abc import Sequence
from datetime import UTC, timedelta

from alembic import op
from sqlalchemy import text

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Days made ahead at once; the sweeper keeps as many ahead from then on.
_AHEAD_DAYS = 3

_INDEXES = (
    # The relay's only read: due, unpublished rows in order.
    ("outbox_due_idx", "(available_at, id) WHERE published_at IS NULL"),
    ("outbox_key_idx", "(idempotency_key)"),
    ("outbox_published_idx", "(published_at) WHERE published_at IS NOT NULL"),
)


def upgrade() -> None:
    # The locks first, in the order the gateway's statements take them (a key, then its outbox
    # row): the key reference below needs one on the keys, and taken after the outbox's it
    # deadlocked with a receiver that held its key and waited for the outbox (make
    # chaos-upgrade). Waited for briefly, then the migration is tried again
    # (outbox/store/migrate.py).
    op.execute("LOCK TABLE idempotency_keys IN SHARE ROW EXCLUSIVE MODE")
    op.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
    bind = op.get_bind()
    midnight = bind.execute(
        text("SELECT date_trunc('day', now() AT TIME ZONE 'UTC') + interval '1 day'")
    ).scalar_one()
    first_day = midnight.replace(tzinfo=UTC)
    legacy = f"outbox_before_{first_day:%Y%m%d}"
    op.execute(f"ALTER TABLE outbox RENAME TO {legacy}")
    # Its primary key on `id` alone cannot be a partition's: attaching builds (id, created_at).
    op.execute(f"ALTER TABLE {legacy} DROP CONSTRAINT outbox_pkey")
    for name, _ in _INDEXES:
        op.execute(f"ALTER INDEX {name} RENAME TO {name.replace('outbox', legacy)}")
    op.execute(f"DROP TRIGGER outbox_notify ON {legacy}")
    op.execute(
        f"CREATE TABLE outbox (LIKE {legacy} INCLUDING DEFAULTS) PARTITION BY RANGE (created_at)"
    )
    _outbox_parts("id, created_at")
    # Its indexes and key reference match the new table's and become theirs.
    op.execute(
        f"ALTER TABLE outbox ATTACH PARTITION {legacy}"
        f" FOR VALUES FROM (MINVALUE) TO ('{first_day.isoformat()}')"
    )
    op.execute("CREATE TABLE outbox_default PARTITION OF outbox DEFAULT")
    for n in range(_AHEAD_DAYS):
        day, ends = first_day + timedelta(days=n), first_day + timedelta(days=n + 1)
        op.execute(
            f"CREATE TABLE outbox_{day:%Y%m%d} PARTITION OF outbox"
            f" FOR VALUES FROM ('{day.isoformat()}') TO ('{ends.isoformat()}')"
        )


def _outbox_parts(primary_key: str) -> None:
    """What the new `outbox` table takes over from the one it replaces: the sequence of its
    ids (which must outlive the table before it), its keys, indexes and NOTIFY trigger."""
    op.execute("ALTER SEQUENCE outbox_id_seq OWNED BY outbox.id")
    op.execute(f"ALTER TABLE outbox ADD PRIMARY KEY ({primary_key})")
    for name, definition in _INDEXES:
        op.execute(f"CREATE INDEX {name} ON outbox {definition}")
    op.execute(
        "ALTER TABLE outbox ADD CONSTRAINT outbox_idempotency_key_fkey FOREIGN KEY"
        " (idempotency_key) REFERENCES idempotency_keys (idempotency_key)"
        " ON DELETE CASCADE ON UPDATE CASCADE"
    )
    op.execute(
        "CREATE TRIGGER outbox_notify AFTER INSERT ON outbox"
        " FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify()"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE outbox RENAME TO outbox_parted")
    op.execute("ALTER INDEX outbox_pkey RENAME TO outbox_parted_pkey")
    for name, _ in _INDEXES:
        op.execute(f"ALTER INDEX {name} RENAME TO {name.replace('outbox', 'outbox_parted')}")
    op.execute("DROP TRIGGER outbox_notify ON outbox_parted")
    op.execute("CREATE TABLE outbox (LIKE outbox_parted INCLUDING DEFAULTS)")
    op.execute("INSERT INTO outbox SELECT * FROM outbox_parted")
    _outbox_parts("id")
    op.execute("DROP TABLE outbox_parted")
