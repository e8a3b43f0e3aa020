"""An event's deliveries in one message share their statements: one claim for all, and their
successes recorded together.

Each delivery alone costs two statements (its claim and its outcome), and for an event fanned
out to three destinations those six round trips, planned and executed one by one, are most of
what its deliveries cost the worker and the database beyond Celery's one message. Here the
attempts of one message see the store through `Siblings`: the keys were claimed in one
statement (`outbox.store.siblings.CLAIM_KEYS`) before the attempts started, and a success waits
up to `LINGER_SECONDS` for its siblings' so that all of them are written by one statement
(`SUCCEED_KEYS`).

Nothing else is shared, and no key's guarantees change: each key keeps its own fence, token,
lease (the heartbeat counts from when the shared claim was sent), order, admission, action and
outcome, exactly as `worker.attempt` runs one key. Waiting to be written together is safe: the
lease runs on, fenced, and the linger is a small fraction of a renewal interval. Every outcome
other than a success is recorded at once, on its own. A shared write that fails for any reason
(a result the database refuses, a dropped connection) is not retried as a batch: each waiting
key is then written alone, where a single key's handling applies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from outbox.store import lifecycle, siblings
from worker.store import Blocked, Claim, KeyStore, claim_of, success_params

# How long a recorded success waits for its siblings' before it is written without them: a
# fan-out's destinations answering within this of each other share one statement.
LINGER_SECONDS = 0.02

# The parallel arrays of a shared statement's keys and their attempts, from each key's
# parameters (`attempt_params`): what `SUCCEED_KEYS` and `ADMIT_KEYS` both take.
ATTEMPT_ARRAYS = {
    "keys": "key",
    "fences": "fence",
    "tokens": "token",
    "attempts": "attempt",
    "started_at": "started_at",
    "workers": "worker",
}

# The parallel arrays of `SUCCEED_KEYS`, from each key's `SUCCEED` parameters.
_COLUMNS = {
    **ATTEMPT_ARRAYS,
    "outcomes": "outcome",
    "reconciled": "reconciled",
    "status_codes": "status_code",
    "results": "result",
    "external_refs": "external_ref",
}


def claim_together(
    store: KeyStore, keys: Sequence[str], owner: str, lease_seconds: float
) -> Siblings:
    """Claim `keys` in one statement, each as `KeyStore.claim` would take or refuse it alone
    (a refused key's reason is read and counted as for one key). A part of one key (what a
    backlog gives: a slot comes free at a time) is claimed as a single key's message is, its
    statement shared with other messages' claims (`worker.grouped`)."""
    if len(keys) == 1:
        return Siblings(store, {keys[0]: store.claim(keys[0], owner, lease_seconds)})
    return Siblings(store, claim_keys(store, [(key, owner) for key in keys], lease_seconds))


def claim_keys(
    store: KeyStore, wanted: Sequence[tuple[str, str]], lease_seconds: float
) -> dict[str, Claim | Blocked]:
    """Claim each (key, holder) of `wanted` in one statement (`CLAIM_KEYS`), each as
    `KeyStore.claim` would take or refuse it alone: a refused key's reason is read and counted
    as for one key. The keys are distinct."""
    tokens = {key: lifecycle.new_lease_token() for key, _ in wanted}
    owners = dict(wanted)
    sent = time.monotonic()
    rows = store.all(
        siblings.CLAIM_KEYS,
        {
            "keys": list(tokens),
            "tokens": list(tokens.values()),
            "owners": [owners[key] for key in tokens],
            "owner": None,
            "lease_seconds": lease_seconds,
            **store.in_flight.params(),
        },
    )
    taken = {row["idempotency_key"]: row for row in rows}
    return {
        key: claim_of(taken[key], token, owners[key], sent) if key in taken else store.blocked(key)
        for key, token in tokens.items()
    }


class Siblings(KeyStore):
    """The store as the attempts of one message see it: `claim` hands out the key's share of
    the shared claim, `succeed` joins the shared write, `admit` (the lane step) goes through
    the process's store; every other step is the store's own.
    Each attempt calls `finished(key)` when it ends, so that no success waits for a sibling
    that will never record one. A claim or a success its siblings do not share goes through
    the process's store, where it may share a statement with other messages' attempts.

    Of the successes waiting to be written, the first to arrive leads: it waits (on `_cond`,
    where only a leader waits) until no sibling is still expected to succeed or the linger
    runs out, then takes every waiting success and writes them; each other success waits on
    its own event, set when its write is done. A success or an end wakes the leader only when
    nothing is left to wait for, so a message of n keys costs about n wake-ups, not n² (each
    success waking every waiting sibling to look again)."""

    def __init__(self, store: KeyStore, claims: Mapping[str, Claim | Blocked]) -> None:
        super().__init__(store.engine, store.in_flight)
        self._store = store
        self._claims = dict(claims)
        self._cond = threading.Condition()
        # Claimed keys whose attempt has neither recorded a success nor ended.
        self._expected = {key for key, claim in claims.items() if isinstance(claim, Claim)}
        # Successes waiting to be written: key -> its SUCCEED parameters.
        self._waiting: dict[str, dict[str, Any]] = {}
        # The success that takes the waiting ones to write them, once it may; None: none yet.
        self._leader: str | None = None
        # Set when a waiting success's write is done (`_written` holds what it said).
        self._done: dict[str, threading.Event] = {}
        # What the shared write said of each key: True/False, or None: write it alone.
        self._written: dict[str, bool | None] = {}

    def claim(self, key: str, owner: str, lease_seconds: float) -> Claim | Blocked:
        taken = self._claims.pop(key, None)
        return self._store.claim(key, owner, lease_seconds) if taken is None else taken

    def admit(self, step: dict[str, Any]) -> Mapping[str, Any]:
        return self._store.admit(step)

    def waiting(self) -> int:
        """Successes not yet in a write sent (for a test to know one waits)."""
        with self._cond:
            return len(self._waiting)

    def finished(self, key: str) -> None:
        with self._cond:
            self._expected.discard(key)
            self._wake_leader()

    def succeed(
        self, claim: Claim, result: Any, external_ref: str | None, reconciled: bool | None = None
    ) -> bool:
        key = claim.key
        done = threading.Event()
        with self._cond:
            self._waiting[key] = success_params(claim, result, external_ref, reconciled)
            self._done[key] = done
            self._expected.discard(key)
            leads = self._leader is None
            if leads:
                self._leader = key
            else:
                self._wake_leader()
        if leads:
            self._lead(time.monotonic() + LINGER_SECONDS)
        else:
            done.wait()
        with self._cond:
            recorded = self._written.pop(key)
        if recorded is None:
            return self._store.succeed(claim, result, external_ref, reconciled)
        return recorded

    def _wake_leader(self) -> None:
        """Under the lock: a leader waits only for no sibling being expected any more."""
        if self._leader is not None and not self._expected:
            self._cond.notify()

    def _lead(self, deadline: float) -> None:
        """Wait until no sibling is still expected to succeed, or the linger ran out; then
        take every waiting success, write them and tell each its answer. A success arriving
        during the write leads the next batch."""
        with self._cond:
            while self._expected and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            batch, self._waiting, self._leader = self._waiting, {}, None
        written: dict[str, bool | None] = {}
        try:
            written = self._write(batch)
        finally:
            # Whatever happened to the write, no sibling is left waiting: a key it did not
            # answer is written alone.
            with self._cond:
                self._written.update({key: written.get(key) for key in batch})
                told = [self._done.pop(key) for key in batch]
            for event in told:
                event.set()

    def _write(self, batch: dict[str, dict[str, Any]]) -> dict[str, bool | None]:
        if len(batch) == 1:
            return {key: None for key in batch}  # one key: its own statement, as usual
        try:
            done = succeed_keys(self, list(batch.values()))
        except Exception:
            return {key: None for key in batch}  # each alone, with a single key's handling
        return {key: key in done for key in batch}


def succeed_keys(store: KeyStore, successes: Sequence[Mapping[str, Any]]) -> set[str]:
    """Record several successes in one statement (`SUCCEED_KEYS`), each from its `SUCCEED`
    parameters (`success_params`); the keys whose fence and token still matched. In key order:
    the statement then locks its rows in the order `CLAIM_KEYS` does, so a redelivered copy
    of the message claiming the same keys queues behind it instead of deadlocking."""
    ordered = sorted(successes, key=lambda p: str(p["key"]))
    params = {name: [p[column] for p in ordered] for name, column in _COLUMNS.items()}
    return {row["idempotency_key"] for row in store.all(siblings.SUCCEED_KEYS, params)}
