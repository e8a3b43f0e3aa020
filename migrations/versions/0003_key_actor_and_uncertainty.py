"""One fencing scheme and two facts on every key: who may act on it, and whether it may have
happened already.

- `actor`: `worker` for keys created by an event (only the gateway's worker acts on them),
  `workflow` for keys created by the claims API (only the workflow that claims them acts).
  Decided at creation, never changed; every claim, re-drive, replay and purge filters on it.
- `lease_token`: a random value of at least 128 bits set by every claim beside the fence. Every
  fenced write names both: the fence orders holders, the token proves who holds.
- `uncertain`: an earlier attempt may have had its effect (a timeout after sending, a dropped
  connection, a 500/502/504, a lost or expired lease, an action past its time limit, a
  workflow's `/fail` that does not say the effect is absent). Set by those outcomes, cleared
  only by a success or a reconcile that found no effect.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE idempotency_keys
            ADD COLUMN actor text NOT NULL DEFAULT 'worker'
                CONSTRAINT idempotency_keys_actor_check CHECK (actor IN (
                    'worker',   -- created by POST /v1/events: the gateway's worker acts
                    'workflow'  -- created by POST /v1/claims: the claiming workflow acts
                )),
            ADD COLUMN lease_token text,
            ADD COLUMN uncertain boolean NOT NULL DEFAULT false
        """
    )
    # Keys the claims API created before this revision carry its route label.
    op.execute("UPDATE idempotency_keys SET actor = 'workflow' WHERE route = '(claims)'")
    # What the previous code inferred from the last error code is now a stored fact.
    op.execute(
        """
        UPDATE idempotency_keys SET uncertain = true
         WHERE error_code IN ('timeout_read', 'timeout_write', 'connection_dropped',
                              'transport_error', 'lease_expired')
            OR (status = 'processing' AND locked_until < now())
        """
    )
    # Holders that claimed before this revision have no token: their leases run out and the
    # next claim (which sets one) reconciles first, as after any expired lease.


def downgrade() -> None:
    op.execute(
        "ALTER TABLE idempotency_keys DROP COLUMN uncertain, DROP COLUMN lease_token,"
        " DROP COLUMN actor"
    )
