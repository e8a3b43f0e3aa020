"""The relays' lead: which relay publishes while the others stand by.

One row (`id` 1) names the relay that holds the lead, until when, and the server process of the
connection it renews it on (`backend_pid`). A relay takes the lead when it is free, has run out,
or that server process has ended (its holder died and the server closed its connection: a
restarted relay takes over at once instead of at the end of the lease); its holder renews it;
the others wait. Nothing depends on it for
correctness (relays that publish at once stay apart by SKIP LOCKED and the claim lease): it
only keeps a second relay from repeating the first one's work (outbox/relay/lead.py).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE relay_lead (
            id          smallint PRIMARY KEY CHECK (id = 1),
            holder      text NOT NULL,
            held_until  timestamptz NOT NULL,
            taken_at    timestamptz NOT NULL DEFAULT now(),
            backend_pid integer NOT NULL
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE relay_lead")
