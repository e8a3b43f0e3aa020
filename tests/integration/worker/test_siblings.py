"""An event's deliveries sharing their statements (`worker.siblings`) on real PostgreSQL: one
claim for all that takes or refuses each key as its own claim would, successes written by one
statement, each under its own fence, and nothing waits for a sibling that will not succeed."""

from __future__ import annotations

import threading
from collections import Counter

import psycopg
import pytest
from sqlalchemy import Engine

import worker.siblings
from tests.support import libpq, query, refuse_shared_successes, seed_pending_key, wait_until
from worker.siblings import Siblings, claim_together
from worker.store import Blocked, Claim, KeyStore

SUCCEED_ONE = (
    "-- The effect happened: store the result under the fence, and the attempt in the log; the"
)
SUCCEED_MANY = (
    "-- Several effects happened: each key succeeds under its own fence and token, as SUCCEED"
)


def _succeed_all(siblings: Siblings, claims: list[Claim]) -> list[bool]:
    """Each claim's success recorded from a thread of its own, as the attempts do."""
    recorded: list[bool] = [False] * len(claims)

    def one(index: int) -> None:
        claim = claims[index]
        try:
            recorded[index] = siblings.succeed(claim, {"n": index}, f"ref-{index}")
        finally:
            siblings.finished(claim.key)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(claims))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return recorded


def _two_claimed(db: str, store: KeyStore, prefix: str) -> tuple[Siblings, Claim, Claim]:
    """Two pending keys claimed together: their siblings' store and each key's claim."""
    keys = [seed_pending_key(db, f"{prefix}-{n}") for n in range(2)]
    siblings = claim_together(store, keys, "w1", 30)
    first, second = (siblings.claim(key, "w1", 30) for key in keys)
    assert isinstance(first, Claim) and isinstance(second, Claim)
    return siblings, first, second


def test_keys_claimed_together_are_each_taken_or_refused_as_alone(
    own_database: str, worker_engine: Engine
) -> None:
    """Three pending keys and a finished one in one claim: the three held with their own
    tokens, the finished one refused (and the refusal counted); a copy of the message claiming
    the same keys finds every one held."""
    db = own_database
    store = KeyStore(worker_engine)
    keys = [seed_pending_key(db, f"together-{n}") for n in range(3)]
    done = seed_pending_key(db, "together-done")
    query(
        db, "UPDATE idempotency_keys SET status = 'succeeded' WHERE idempotency_key = %s", (done,)
    )

    first = claim_together(store, [*keys, done], "w1", 30)
    claims = [first.claim(key, "w1", 30) for key in keys]
    assert all(isinstance(c, Claim) for c in claims)
    held = [c for c in claims if isinstance(c, Claim)]
    assert len({c.token for c in held}) == 3 and {(c.fence, c.attempt) for c in held} == {(1, 1)}
    assert held[0].payload == {"email": "a@b.c"} and held[0].sent > 0
    refused = first.claim(done, "w1", 30)
    assert isinstance(refused, Blocked) and refused.status == "succeeded"

    copy = claim_together(store, keys, "w2", 30)
    again = [copy.claim(key, "w2", 30) for key in keys]
    assert [(b.status, b.lease_live) for b in again if isinstance(b, Blocked)] == [
        ("processing", True)
    ] * 3
    assert query(
        db,
        "SELECT status, fence, attempts, blocked_deliveries FROM idempotency_keys"
        " ORDER BY idempotency_key",
    ) == [("processing", 1, 1, 1)] * 3 + [("succeeded", 0, 0, 1)]


def test_siblings_successes_are_one_statement_each_under_its_own_fence(
    own_database: str,
    worker_engine: Engine,
    statements: Counter[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three deliveries succeed at once: one statement writes all three, with their results
    and attempt rows; a fourth whose lease another worker took since writes nothing, and the
    new holder's row is untouched."""
    # The four threads' successes must meet however slowly a busy machine starts them; the
    # write goes as soon as no sibling is left to succeed, not when the linger ends.
    monkeypatch.setattr(worker.siblings, "LINGER_SECONDS", 30.0)
    db = own_database
    store = KeyStore(worker_engine)
    keys = [seed_pending_key(db, f"batch-{n}") for n in range(4)]
    siblings = claim_together(store, keys, "w1", 30)
    claims = [siblings.claim(key, "w1", 30) for key in keys]
    assert all(isinstance(c, Claim) for c in claims)
    query(
        db,
        "UPDATE idempotency_keys SET fence = fence + 1, lease_token = 'other'"
        " WHERE idempotency_key = %s",
        (keys[3],),
    )

    recorded = _succeed_all(siblings, [c for c in claims if isinstance(c, Claim)])

    assert recorded == [True, True, True, False]
    assert statements[SUCCEED_MANY] == 1 and statements[SUCCEED_ONE] == 0
    rows = query(
        db,
        "SELECT status, result, external_ref, lease_token FROM idempotency_keys"
        " ORDER BY idempotency_key",
    )
    assert rows == [("succeeded", {"n": n}, f"ref-{n}", None) for n in range(3)] + [
        ("processing", None, None, "other")
    ]
    assert query(db, "SELECT idempotency_key, outcome FROM attempts ORDER BY idempotency_key") == [
        (key, "succeeded") for key in keys[:3]
    ]


def test_a_success_is_written_without_a_sibling_still_acting(
    own_database: str, worker_engine: Engine, statements: Counter[str]
) -> None:
    """One delivery succeeds while its sibling is still acting (a slow destination): the
    success is written alone after the linger, not when the sibling ends; the sibling that
    then ends without success (a retry recorded on its own) leaves nothing waiting."""
    db = own_database
    siblings, fast, slow = _two_claimed(db, KeyStore(worker_engine), "slow")

    written = threading.Event()

    def succeed_fast() -> None:
        assert siblings.succeed(fast, {"ok": True}, None)
        written.set()

    thread = threading.Thread(target=succeed_fast)
    thread.start()
    # The sibling has not ended: the success must still be written.
    assert written.wait(10), "a success waited for a sibling that was still acting"
    thread.join()
    siblings.finished(fast.key)
    siblings.finished(slow.key)
    assert statements[SUCCEED_ONE] == 1 and statements[SUCCEED_MANY] == 0
    assert query(db, "SELECT status FROM idempotency_keys ORDER BY idempotency_key") == [
        ("succeeded",),
        ("processing",),
    ]


def test_a_shared_write_the_database_refuses_is_written_key_by_key(
    own_database: str, worker_engine: Engine, statements: Counter[str]
) -> None:
    """The shared statement fails (here: the attempt log refuses a row, as a full disk or a
    broken constraint would): each key is then written alone, as one key's success is, and
    every one lands."""
    db = own_database
    store = KeyStore(worker_engine)
    keys = [seed_pending_key(db, f"refused-{n}") for n in range(3)]
    siblings = claim_together(store, keys, "w1", 30)
    claims = [siblings.claim(key, "w1", 30) for key in keys]
    # Only the shared statement sends its attempt numbers as an array; make it fail.
    refuse_shared_successes(db)

    recorded = _succeed_all(siblings, [c for c in claims if isinstance(c, Claim)])

    assert recorded == [True, True, True]
    assert statements[SUCCEED_MANY] == 1 and statements[SUCCEED_ONE] == 3
    assert query(db, "SELECT DISTINCT status FROM idempotency_keys") == [("succeeded",)]


def test_a_sibling_that_ends_without_success_lets_the_waiting_success_go_at_once(
    own_database: str,
    worker_engine: Engine,
    statements: Counter[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One delivery's success waits for its sibling; the sibling then ends without a success
    (a retry, a dead letter): the waiting success is written then, alone, not when the linger
    runs out."""
    # A linger far longer than the test waits: only the sibling's end can release the write.
    monkeypatch.setattr(worker.siblings, "LINGER_SECONDS", 60.0)
    db = own_database
    siblings, done, ended = _two_claimed(db, KeyStore(worker_engine), "ends")

    recorded: list[bool] = []
    thread = threading.Thread(
        target=lambda: recorded.append(siblings.succeed(done, {"ok": True}, None))
    )
    thread.start()
    # The success waits for its sibling (it leads the next write).
    wait_until(lambda: siblings.waiting() == 1, timeout=20, interval=0.01)
    siblings.finished(ended.key)
    thread.join(10)

    assert recorded == [True], "the success waited for a sibling that had ended"
    assert statements[SUCCEED_ONE] == 1 and statements[SUCCEED_MANY] == 0
    assert query(db, "SELECT status FROM idempotency_keys ORDER BY idempotency_key") == [
        ("succeeded",),
        ("processing",),
    ]


@pytest.mark.parametrize(
    ("before", "committed", "taken"),
    [
        # Another worker takes the key while the shared claim waits for its row.
        (
            "pending",
            "status = 'processing', fence = 5, lease_token = 'other',"
            " locked_until = now() + interval '1 hour'",
            False,
        ),
        # A holder gives the key back (a retry due at once) while the shared claim waits.
        (
            "processing",
            "status = 'failed_retryable', fence = 5, lease_token = NULL,"
            " locked_until = NULL, next_attempt_at = NULL",
            True,
        ),
    ],
    ids=["taken-meanwhile", "given-back-meanwhile"],
)
def test_a_shared_claim_decides_on_the_row_as_committed_while_it_waited(
    own_database: str, worker_engine: Engine, before: str, committed: str, taken: bool
) -> None:
    """A shared claim reaches a row another transaction is changing and waits for its lock;
    whether it takes the key is decided on the version that transaction committed, not on the
    one the claim's statement first saw: a key taken meanwhile is refused and keeps its new
    holder's fence and token, a key given back meanwhile is taken. Its sibling, not locked,
    is taken either way."""
    db = own_database
    store = KeyStore(worker_engine)
    key, sibling = seed_pending_key(db, "raced"), seed_pending_key(db, "raced-sibling")
    query(
        db,
        "UPDATE idempotency_keys SET status = %s, fence = 4, lease_token = 'old',"
        " locked_until = now() + interval '1 hour' WHERE idempotency_key = %s"
        " AND %s = 'processing'",
        (before, key, before),
    )
    answers: list[Siblings] = []
    with psycopg.connect(libpq(db)) as other:
        other.execute(
            "SELECT 1 FROM idempotency_keys WHERE idempotency_key = %s FOR UPDATE", (key,)
        )
        claiming = threading.Thread(
            target=lambda: answers.append(claim_together(store, [key, sibling], "w", 30))
        )
        claiming.start()
        wait_until(
            lambda: (
                query(
                    db,
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND datname = current_database()",
                )
                == [(1,)]
            ),
            timeout=20,
            interval=0.01,
        )
        other.execute(f"UPDATE idempotency_keys SET {committed} WHERE idempotency_key = %s", (key,))
        other.commit()
    claiming.join(20)
    assert not claiming.is_alive()

    claims = answers[0]
    assert isinstance(claims.claim(sibling, "w", 30), Claim)
    raced = claims.claim(key, "w", 30)
    if taken:
        assert isinstance(raced, Claim) and raced.fence == 6
    else:
        assert isinstance(raced, Blocked) and raced.status == "processing"
        assert query(
            db,
            "SELECT fence, lease_token FROM idempotency_keys WHERE idempotency_key = %s",
            (key,),
        ) == [(5, "other")]
