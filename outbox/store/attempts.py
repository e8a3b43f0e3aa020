"""The attempt log's statements: the fragment every outcome statement carries, and the read.

An attempt is written by the statement that records its outcome (`outbox.store.lifecycle`,
`outbox.store.lanes`), as a CTE of that statement: one round trip, and a write the fence
rejected logs nothing. The same statement trims the key's rows beyond the newest
`KEPT_PER_KEY` (by id, which is the order they were written in), so a key retried for weeks
stays bounded; the rows go with their key (ON DELETE CASCADE, migration 0012).

Every statement carrying `logged()` takes the same parameters (`worker.store.attempt_params`,
`outbox.claims.service`): :key, :attempt, :fence, :started_at (NULL: the claim's own row's
time, else now), :worker, :outcome, :reconciled, :status_code, :log_error_code, :log_detail
(:attempt NULL: the key's count).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, RowMapping, TextClause, text

from outbox.core.timewindow import iso

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

KEPT_PER_KEY = 50
# What an operator reads of an attempt's detail: enough for an error message, never a body.
DETAIL_CHARS = 500

_COLUMNS = (
    "idempotency_key, attempt, fence, started_at, outcome, reconciled, status_code, error_code,"
    " detail, worker"
)


def trimmed(inserted: int = 1) -> str:
    """The CTE that keeps each key `logged` wrote to within the bound, counting the `inserted`
    rows per key this same statement adds (which its DELETE cannot see). Keys come from
    `logged` (its RETURNING), so a statement that logs several keys trims each, and one whose
    write the fence refused trims none."""
    return f"""
    trimmed AS (
        DELETE FROM attempts a
         USING (SELECT DISTINCT idempotency_key FROM logged) t
         WHERE a.idempotency_key = t.idempotency_key
           AND a.id < (SELECT id FROM attempts WHERE idempotency_key = t.idempotency_key
                        ORDER BY id DESC OFFSET {KEPT_PER_KEY - inserted - 1} LIMIT 1)
    )"""


def logged(
    source: str,
    *,
    outcome: str = "CAST(:outcome AS text)",
    error_code: str = "CAST(:log_error_code AS text)",
    where: str = "",
) -> str:
    """The CTEs `logged` and `trimmed`: one attempt row for each row of `source` (the CTE the
    outcome statement wrote, empty when the fence refused it)."""
    return f"""
    logged AS (
        INSERT INTO attempts ({_COLUMNS})
        SELECT idempotency_key, COALESCE(CAST(:attempt AS integer), attempts),
               CAST(:fence AS bigint),
               COALESCE(CAST(:started_at AS timestamptz),
                        (SELECT max(a.started_at) FROM attempts a
                          WHERE a.idempotency_key = :key AND a.fence = CAST(:fence AS bigint)
                            AND a.outcome = 'claimed'),
                        now()),
               {outcome}, CAST(:reconciled AS boolean), CAST(:status_code AS integer),
               {error_code}, CAST(:log_detail AS text), CAST(:worker AS text)
          FROM {source} {where}
        RETURNING idempotency_key
    ), {trimmed()}"""


# The claim's own rows, in CLAIM_KEY: a reclaimed lease ends the previous holder's attempt
# (`lease_lost` for the worker, `expired` for a workflow), and a workflow's claim is itself a
# row (`claimed`). In one INSERT so that the ids keep that order.
CLAIMED = f"""
    logged AS (
        INSERT INTO attempts ({_COLUMNS})
        SELECT idempotency_key, attempt, fence, started_at, outcome, NULL, NULL, error_code,
               NULL, worker
          FROM (SELECT 1 AS n, idempotency_key, attempts - 1 AS attempt, fence - 1 AS fence,
                       previous_updated_at AS started_at,
                       CASE WHEN actor = 'workflow' THEN 'expired' ELSE 'lease_lost' END
                           AS outcome,
                       'lease_expired' AS error_code, previous_owner AS worker
                  FROM claimed WHERE previous_status = 'processing'
                UNION ALL
                SELECT 2, idempotency_key, attempts, fence, now(), 'claimed', NULL,
                       CAST(:owner AS text)
                  FROM claimed WHERE actor = 'workflow'
                 ORDER BY 1) AS r
        RETURNING idempotency_key
    ), {trimmed(2)}"""

OF_KEY: TextClause = text(
    """
    -- A key's attempts, oldest first (the newest KEPT_PER_KEY are kept).
    SELECT attempt, fence, started_at, ended_at,
           EXTRACT(EPOCH FROM ended_at - started_at) * 1000 AS duration_ms, outcome,
           reconciled, status_code, error_code, detail, worker
      FROM attempts
     WHERE idempotency_key = :key
     ORDER BY id
    """
)


def _shown(row: RowMapping) -> dict[str, Any]:
    shown = dict(row)
    shown["started_at"], shown["ended_at"] = iso(row["started_at"]), iso(row["ended_at"])
    shown["duration_ms"] = round(float(row["duration_ms"]), 1)
    return shown


def attempts_of(engine: Engine, key: str) -> list[dict[str, Any]]:
    """The operators' one shape: oldest first, JSON-ready (instants in ISO 8601, duration in
    milliseconds); the detail was bounded and redacted when it was written."""
    with engine.connect() as conn:
        return [_shown(r) for r in conn.execute(OF_KEY, {"key": key}).mappings()]


async def attempts_of_async(engine: AsyncEngine, key: str) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        return [_shown(r) for r in (await conn.execute(OF_KEY, {"key": key})).mappings()]
