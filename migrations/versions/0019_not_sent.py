"""The attempt log names an attempt whose request never reached anything that could act.

Such an attempt (a refused connection, a name that does not resolve, a TLS handshake that
failed, n8n's "webhook not registered") spends nothing: its key waits and asks again within
seconds (worker/errors.py, `not_sent`). The log shows it as `not_sent`, apart from the waits a
route imposes and from failures that may have acted.

The outcome check is replaced without a long lock: the new one is added NOT VALID (a brief
lock, no scan) and validated afterwards, which reads the table under a lock that lets writers
go on; old and new workers write only values it allows.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06
"""

from collections.abc import Sequence

from alembic import op
from sqlalchemy import text

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Rows rewritten per statement of the downgrade.
_BATCH = 5000

_OUTCOMES = (
    "'succeeded', 'transient', 'permanent', 'uncertain', 'reconciled_found', "
    "'deferred_circuit', 'deferred_limit', 'deferred_pause', 'deferred_lane', "
    "'deferred_in_progress', 'superseded', 'lease_lost', "
    "'claimed', 'completed', 'failed', 'expired'"
)


def _replace_check(outcomes: str) -> None:
    op.execute("ALTER TABLE attempts DROP CONSTRAINT IF EXISTS attempts_outcome_check")
    op.execute(
        "ALTER TABLE attempts ADD CONSTRAINT attempts_outcome_check "
        f"CHECK (outcome IN ({outcomes})) NOT VALID"
    )
    op.execute("ALTER TABLE attempts VALIDATE CONSTRAINT attempts_outcome_check")


def upgrade() -> None:
    _replace_check(_OUTCOMES + ", 'not_sent'")


def downgrade() -> None:
    # Rows written as `not_sent` would break the older check: they are the waits they were.
    rewrite = text(
        """
        WITH batch AS (SELECT id FROM attempts WHERE outcome = 'not_sent' LIMIT :batch)
        UPDATE attempts a SET outcome = 'deferred_limit' FROM batch WHERE a.id = batch.id
        """
    )
    while op.get_bind().execute(rewrite, {"batch": _BATCH}).rowcount:
        pass
    _replace_check(_OUTCOMES)
