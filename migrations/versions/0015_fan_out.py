"""Fan-out: one event delivered to several destinations, each delivery a key of its own.

An event of a fan-out route keeps its key (duplicates find it, its event row hangs from it) with
the status `fanned_out`: it never runs itself. Each of its deliveries is a row of
`idempotency_keys` too, with `event_key` naming the event's key and `destination` the
`[[destinations]]` table it goes to; its `route` is the destination's name, so its lease,
attempts, backoff, reconcile, dead letter, replay, circuit, limits, lanes and attempt log are
the ones every key has. A delivery has no event row of its own: `key_version` (and the worker's
claim) reach the event through `event_key`. Existing keys are untouched (their two columns
NULL): no data is rewritten, and the checks are added NOT VALID then validated, which takes
no lock that stops writers.

A delivery goes with its event (ON DELETE CASCADE); the purge removes an event's key only once
none of its deliveries is left (outbox/store/maintenance.py).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_STATUSES = (
    "'pending', 'processing', 'succeeded', 'failed_retryable', 'failed_final', 'quarantined',"
    " 'superseded'"
)

_KEY_VERSION = """
CREATE OR REPLACE FUNCTION key_version(p_key text) RETURNS text LANGUAGE sql STABLE AS $$
    -- A delivery's version is its event's.
    SELECT e.version
      FROM idempotency_keys k
      JOIN events e ON e.idempotency_key = COALESCE(k.event_key, k.idempotency_key)
     WHERE k.idempotency_key = p_key
$$
"""

_KEY_VERSION_BEFORE = """
CREATE OR REPLACE FUNCTION key_version(p_key text) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT version FROM events WHERE idempotency_key = p_key
$$
"""


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE idempotency_keys
            ADD COLUMN event_key   text REFERENCES idempotency_keys (idempotency_key)
                                   ON DELETE CASCADE ON UPDATE CASCADE,
            ADD COLUMN destination text
        """
    )
    op.execute(
        "ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_delivery_check"
        " CHECK ((event_key IS NULL) = (destination IS NULL)) NOT VALID"
    )
    op.execute("ALTER TABLE idempotency_keys VALIDATE CONSTRAINT idempotency_keys_delivery_check")
    op.execute("ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_status_check")
    op.execute(
        "ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_status_check"
        f" CHECK (status IN ({_STATUSES}, 'fanned_out')) NOT VALID"
    )
    op.execute("ALTER TABLE idempotency_keys VALIDATE CONSTRAINT idempotency_keys_status_check")
    # An event's deliveries, found from its key: its answer, the purge's "none left", the
    # backfill's "not yet delivered there" (and the cascade's delete).
    op.execute(
        "CREATE INDEX idempotency_keys_deliveries_idx ON idempotency_keys (event_key, destination)"
        " WHERE event_key IS NOT NULL"
    )
    # The backfill's walk: a fan-out route's events in order of acceptance.
    op.execute(
        "CREATE INDEX idempotency_keys_fanned_out_idx ON idempotency_keys (route, created_at)"
        " WHERE status = 'fanned_out'"
    )
    op.execute(_KEY_VERSION)


def downgrade() -> None:
    op.execute(_KEY_VERSION_BEFORE)
    op.execute("DROP INDEX idempotency_keys_fanned_out_idx")
    op.execute("DROP INDEX idempotency_keys_deliveries_idx")
    op.execute("DELETE FROM idempotency_keys WHERE status = 'fanned_out'")
    op.execute("ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_status_check")
    op.execute(
        "ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_status_check"
        f" CHECK (status IN ({_STATUSES}))"
    )
    op.execute("ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_delivery_check")
    op.execute("ALTER TABLE idempotency_keys DROP COLUMN destination")
    op.execute("ALTER TABLE idempotency_keys DROP COLUMN event_key")
