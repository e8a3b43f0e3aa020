"""The key's state machine as written down: the transition table, the CHECK constraint, the
statements and docs/explanation/architecture.md say the same thing."""

from __future__ import annotations

import re
from pathlib import Path

from outbox.store import ingest, lanes, lifecycle, maintenance, siblings
from outbox.store.lifecycle import TRANSITIONS, Status

ROOT = Path(__file__).resolve().parents[3]


def _check_constraint_statuses() -> set[str]:
    """The constraint as the latest revision that rewrote it left it (0015: + fanned_out)."""
    text = (ROOT / "migrations/versions/0015_fan_out.py").read_text()
    block = text.split("_STATUSES = (", 1)[1].split(")\n", 1)[0]
    added = text.split('f" CHECK (status IN ({_STATUSES}, ', 1)[1].split(")", 1)[0]
    return set(re.findall(r"'([a-z_]+)'", block + added))


def test_the_states_are_the_check_constraint() -> None:
    """Every status of the enum is allowed by the table's CHECK constraint, and no other."""
    assert {s.value for s in Status} == _check_constraint_statuses()


def test_every_state_is_reached_and_every_transition_names_its_statement() -> None:
    """Each status is the target of some transition; each statement named exists."""
    assert {t.target for t in TRANSITIONS} == set(Status)
    for transition in TRANSITIONS:
        module, _, name = transition.statement.rpartition(".")
        owner = {"ingest": ingest, "lanes": lanes}.get(module, lifecycle)
        assert hasattr(owner, name), transition


def test_architecture_doc_lists_every_transition() -> None:
    """docs/explanation/architecture.md has a table row per transition with its statement."""
    doc = (ROOT / "docs/explanation/architecture.md").read_text()
    for transition in TRANSITIONS:
        row = next(
            (line for line in doc.splitlines() if line.startswith(f"| {transition.name} |")), None
        )
        assert row is not None, transition.name
        assert transition.statement.rpartition(".")[2] in row, transition.name
        assert transition.target.value in row, transition.name


def test_every_fenced_write_names_fence_and_token() -> None:
    """Renew, succeed, retry and fail each require the fence AND the lease token."""
    for statement in (
        lifecycle.RENEW_LEASE,
        lifecycle.SUCCEED,
        lifecycle.SCHEDULE_RETRY,
        lifecycle.FAIL_FINAL,
    ):
        sql = statement.text
        assert "fence = :fence AND lease_token = :token" in sql
    # Several keys' successes at once: each row under its own fence and token.
    assert "k.fence = o.fence AND k.lease_token = o.token" in siblings.SUCCEED_KEYS.text


def test_every_claim_and_redrive_names_the_actor() -> None:
    """The claim, the sweeper's re-drives and the replay's queueing filter on the actor."""
    assert "k.actor = :actor" in lifecycle.CLAIM_KEY.text
    assert "actor = 'worker'" in lifecycle.ENQUEUE_REPLAYED.text
    for statement in (maintenance.REDRIVE_EXPIRED_LEASES, maintenance.REDRIVE_STALLED_KEYS):
        assert "k.actor = 'worker'" in statement.text
    assert ingest.RESERVE_KEY.text.count("actor = 'worker'") == 1
