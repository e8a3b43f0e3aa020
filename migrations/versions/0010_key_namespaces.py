"""Keys namespaced by their source: stored event keys rewritten to the form the receiver now gives.

Until this revision a client's `Idempotency-Key` was stored as sent, so one source could take
another's key in advance. Now every key of an event of source S starts with its namespace
(`outbox.core.keys.source_namespace`): S's slug when that is S itself, else the slug, "~" and 16
hex of S's SHA-256. This revision rewrites the keys stored before it, so a repeat of an event
accepted before the upgrade is still a repeat:

- `key_namespace(source)` and `namespaced_key(source, key)` (with `key_slug`): the SQL twins of
  `keys.source_namespace` and `keys.scoped_client_key` (a test holds them equal over awkward
  sources). They stay: an operator can ask which namespace a source's keys are in.
- The foreign keys of `events`, `outbox` and `dead_letters` on `idempotency_keys` now also
  follow an update of the key (ON UPDATE CASCADE), so moving a key moves its rows. Each is added
  NOT VALID (a short lock), validated (no lock on writers) and the old one dropped, each step
  committed by itself.
- Every event key (`actor = 'worker'`; the claims API's keys stay as they are) not already in its
  namespace is moved: a derived or provider key of a usual source is already there; a client key
  `K` becomes `<namespace>:K`; a derived key of a source whose namespace is hashed
  (`my-app:t:<sha256>` of `my app`) gets the hashed namespace (`my-app~…:t:<sha256>`). Keys are
  walked in primary-key order, at most 1000 per statement, each batch committed: no statement
  grows with the table, and an interrupted upgrade resumes where it stopped (moved keys are
  skipped). A key whose new form is taken already (a client sent both `K` and `<ns>:K`) stays
  as it was and is counted in a warning. One corner is read as a client key: a derived key of
  a source whose name is itself a timestamp with an offset, or case-folds to text that is not
  in NFC (`ǰ`), had a prefix made from another spelling of the name; a repeat of such an event
  after the upgrade is a new key.

Run it with the receivers and workers stopped (compose's `migrate` step runs before they
start), after the workers drained what was in flight: a moved key's next attempt sends its new
form downstream as `Idempotency-Key` and reconciles by it, so a downstream that saw an attempt
under the old key before the upgrade cannot recognise it. The migration counts moved keys that
were still pending, processing or waiting to retry, and warns. Keys in the operators' audit
(`replays.keys`) and in the routes' transient state (permits, breaker windows) are left as
they were.

Downgrade restores the foreign keys and drops the three functions, and leaves the keys namespaced:
which keys were rewritten and which were sent in that form cannot be told apart afterwards.
After a downgrade, a repeat of a pre-upgrade event whose header had no namespace is a new key.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

import logging
from collections.abc import Sequence

from alembic import op
from sqlalchemy import text

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_log = logging.getLogger(__name__)

# Keys read (and at most moved) per statement: each batch fits any statement timeout and holds
# its row locks briefly, however many keys there are.
BATCH = 1000
_CHILDREN = ("events", "outbox", "dead_letters")

# `key_slug` is Python's `_SLUG_UNSAFE.sub("-", s)[:40]`: the same set of code points (the
# letters and digits written out, so no collation can widen a range), and `left(…, 40)` counts
# characters as `[:40]` does. A one-expression SQL function is inlined where it is called; the
# other two are PL/pgSQL so each computes the slug and namespace once per row (a SQL function
# with a subquery is not inlined and costs a hundred times more).
_FUNCTIONS = r"""
CREATE OR REPLACE FUNCTION key_slug(source text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT left(regexp_replace(source, '[^abcdefghijklmnopqrstuvwxyz0123456789._-]', '-', 'g'), 40)
$$;

CREATE OR REPLACE FUNCTION key_namespace(source text) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    slug text := key_slug(source);
BEGIN
    IF slug = source THEN
        RETURN slug;
    END IF;
    RETURN slug || '~' || left(encode(sha256(convert_to(source, 'UTF8')), 'hex'), 16);
END
$$;

CREATE OR REPLACE FUNCTION namespaced_key(source text, key text) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    slug text := key_slug(source);
    ns text := key_namespace(source);
BEGIN
    IF starts_with(key, ns || ':') THEN
        RETURN key;
    END IF;
    -- The old form of a derived key of a source whose namespace is hashed.
    IF ns <> slug AND starts_with(key, slug || ':')
       AND substr(key, length(slug) + 2)
           ~ '^[abcdefghijklmnopqrstuvwxyz0123456789._-]{1,40}:[0123456789abcdef]{64}$' THEN
        RETURN ns || substr(key, length(slug) + 1);
    END IF;
    RETURN ns || ':' || key;
END
$$;
"""

# One batch: the next BATCH keys after :after in primary-key order; the event keys among them
# that are outside their namespace move, unless the new key is taken (by a row outside the
# batch, or by an earlier key of the batch moving to the same one). Returns the last key read
# (NULL past the end) and how many moved or stayed.
_MOVE_BATCH = text(
    """
    WITH batch AS (
        SELECT idempotency_key AS old_key, actor, namespaced_key(source, idempotency_key) AS new_key
          FROM idempotency_keys
         WHERE idempotency_key > :after
         ORDER BY idempotency_key
         LIMIT :batch
    ), outside AS (
        SELECT old_key, new_key,
               row_number() OVER (PARTITION BY new_key ORDER BY old_key) AS nth
          FROM batch
         WHERE actor = 'worker' AND new_key <> old_key
    ), free AS (
        SELECT old_key, new_key FROM outside o
         WHERE nth = 1
           AND NOT EXISTS (SELECT 1 FROM idempotency_keys k WHERE k.idempotency_key = o.new_key)
    ), moved AS (
        UPDATE idempotency_keys k SET idempotency_key = f.new_key
          FROM free f
         WHERE k.idempotency_key = f.old_key
        RETURNING k.status
    )
    SELECT (SELECT max(old_key) FROM batch) AS last_key,
           (SELECT count(*) FROM moved) AS moved,
           (SELECT count(*) FROM moved
             WHERE status IN ('pending', 'processing', 'failed_retryable')) AS in_flight,
           (SELECT count(*) FROM outside) - (SELECT count(*) FROM moved) AS stayed
    """
)


def _foreign_key_follows_updates(table: str, follows: bool) -> None:
    """`table`'s key reference with ON UPDATE CASCADE (or without), in committed steps that
    a rerun resumes: add the new one NOT VALID, validate it, drop the old one, take its name."""
    name = f"{table}_idempotency_key_fkey"
    new = f"{table}_idempotency_key_next_fkey"
    wanted = "c" if follows else "a"  # pg_constraint.confupdtype: CASCADE, NO ACTION
    on_update = " ON UPDATE CASCADE" if follows else ""
    bind = op.get_bind()

    def update_rule(constraint: str) -> str | None:
        return bind.execute(
            text(
                "SELECT confupdtype FROM pg_constraint"
                " WHERE conrelid = CAST(:t AS regclass) AND conname = :n"
            ),
            {"t": table, "n": constraint},
        ).scalar()

    if update_rule(name) == wanted and update_rule(new) is None:
        return
    if update_rule(new) is None:
        op.execute(
            f"ALTER TABLE {table} ADD CONSTRAINT {new} FOREIGN KEY (idempotency_key)"
            f" REFERENCES idempotency_keys (idempotency_key) ON DELETE CASCADE{on_update}"
            " NOT VALID"
        )
    op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {new}")
    op.execute(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {name}")
    op.execute(f"ALTER TABLE {table} RENAME CONSTRAINT {new} TO {name}")


def _move_keys() -> None:
    bind = op.get_bind()
    after, moved, stayed, in_flight = "", 0, 0, 0
    # Each batch must walk the primary key's index from `after`: a sequential or bitmap scan
    # would read (and sort) every key after it, a statement growing with the table. Fresh
    # statistics make the planner take the index anyway; turning the other two off makes it sure.
    bind.execute(text("ANALYZE idempotency_keys"))
    bind.execute(text("SET enable_seqscan = off"))
    bind.execute(text("SET enable_bitmapscan = off"))
    try:
        while True:
            row = bind.execute(_MOVE_BATCH, {"after": after, "batch": BATCH}).one()
            if row.last_key is None:
                break
            after, moved, stayed = row.last_key, moved + row.moved, stayed + row.stayed
            in_flight += row.in_flight
    finally:
        bind.execute(text("RESET enable_seqscan"))
        bind.execute(text("RESET enable_bitmapscan"))
    _log.info("key namespaces: %d event keys moved into their source's namespace", moved)
    if in_flight:
        # Their next attempt sends the new key downstream (Idempotency-Key) and reconciles by
        # it, so a downstream that remembers the old one cannot recognise an earlier attempt.
        _log.warning(
            "key namespaces: %d moved event keys were still in flight (pending, processing or"
            " waiting to retry); drain the workers before upgrading (docs/how-to/upgrading.md)",
            in_flight,
        )
    if stayed:
        _log.warning(
            "key namespaces: %d event keys kept their old form: their namespaced form is"
            " another key already (the client sent both)",
            stayed,
        )


def upgrade() -> None:
    op.execute(_FUNCTIONS)
    # Each step commits by itself: locks are short, and a rerun resumes.
    with op.get_context().autocommit_block():
        for table in _CHILDREN:
            _foreign_key_follows_updates(table, follows=True)
        _move_keys()


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for table in _CHILDREN:
            _foreign_key_follows_updates(table, follows=False)
    op.execute("DROP FUNCTION namespaced_key(text, text)")
    op.execute("DROP FUNCTION key_namespace(text)")
    op.execute("DROP FUNCTION key_slug(text)")
