"""Unit tests for the chaos soak's spells (a route down, a route refusing a share of writes):
when a spell may end, and how its check tells a spell that refused nothing from one that met
no write."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.chaos import check, plan

# A spell planned 23-32 s that began at 27.4 s, when the PostgreSQL restart before it ended.
BEGAN, SECONDS = 27.4, 9.0


@pytest.mark.parametrize(
    ("writes", "now", "over"),
    [
        (plan.PARTIAL_MIN_WRITES, 32.0, False),  # the planned end: 4.6 s of the 9 s only
        (plan.PARTIAL_MIN_WRITES, 36.3, False),
        (plan.PARTIAL_MIN_WRITES, 36.4, True),  # 9 s after it really began, writes enough
        (0, 36.4, False),  # the relays are still backing off: nothing met it yet
        (plan.PARTIAL_MIN_WRITES - 1, 60.0, False),
        (plan.PARTIAL_MIN_WRITES, 60.0, True),
        (0, BEGAN + SECONDS + plan.SPELL_GRACE_SECONDS, True),  # bounded: ends, reported
    ],
)
def test_spell_lasts_its_length_from_its_start_and_until_writes_met_it(
    writes: int, now: float, over: bool
) -> None:
    """A spell ends no sooner than its length after it really began, and no sooner than the
    gateway's writes met it enough times, unless the grace after its length has passed."""
    assert plan.spell_over(BEGAN, SECONDS, writes, plan.PARTIAL_MIN_WRITES, now) is over


def _judge(writes: int, refused: int) -> dict[str, int]:
    violations = check.Violations()
    partial = plan.PartialFailure(plan.FLAKY_COLLECTION, BEGAN, BEGAN + SECONDS, 0.51)
    db = check.DbState({}, {}, {}, set(), 0, 0, 0, {})
    crm = {"writes_while_flaky": writes, "refused_while_flaky": refused}
    facts = check.verify_partial_failure(partial, crm, Counter(), db, violations)
    assert facts["seconds"] == SECONDS
    assert (facts["writes"], facts["writes_refused"]) == (writes, refused)
    return dict(violations.counts)


def test_partial_failure_that_met_no_write_is_reported_as_such() -> None:
    """A spell no write met proves nothing: it is a violation of its own, not a pass and not
    'refused nothing'."""
    assert _judge(writes=0, refused=0) == {"partial_failure_unexercised": 1}


def test_partial_failure_that_refused_none_of_its_writes_is_unseen() -> None:
    """Writes met the spell and none was refused: the spell was not real."""
    assert _judge(writes=30, refused=0) == {"partial_failure_unseen": 1}


def test_partial_failure_that_refused_writes_passes() -> None:
    """Writes met the spell and some were refused: no violation."""
    assert _judge(writes=30, refused=14) == {}
