"""The HA soak's count of what a primary's Patroni did when etcd did not answer: read from the
Patroni logs, a demotion counted once (not again for its "in progress" lines), failsafe mode's
keeping the primary counted apart."""

from __future__ import annotations

from pathlib import Path

from tests.chaos.ha_soak import _patroni_dcs_outcomes

DEMOTED = (
    "2026-12-06 11:56:43,703 INFO: demoting self because DCS is not accessible and I was a leader"
)
AGAIN = (
    "2026-12-06 11:56:44,709 INFO: demoting self because DCS is not accessible and I was a"
    " leader in progress"
)
LOCK = (
    "2026-12-06 11:56:43,744 INFO: updated leader lock during demoting self because DCS is not"
    " accessible and I was a leader"
)
STAYED = (
    "2026-12-06 12:07:10,950 INFO: continue to run as a leader because failsafe mode is enabled"
    " and all members are accessible"
)


def test_each_demotion_and_each_failsafe_stay_counted_once(tmp_path: Path) -> None:
    (tmp_path / "patroni-pg-1.log").write_text("\n".join([DEMOTED, LOCK, AGAIN, ""]))
    (tmp_path / "patroni-pg-2.log").write_text(STAYED + "\n" + STAYED + "\n")
    (tmp_path / "etcd-1.log").write_text(DEMOTED + "\n")  # not a Patroni log
    assert _patroni_dcs_outcomes(tmp_path, failsafe=True) == {
        "failsafe_mode": True,
        "demoted": 1,
        "stayed_by_failsafe": 2,
    }


def test_no_logs_no_outcomes(tmp_path: Path) -> None:
    assert _patroni_dcs_outcomes(tmp_path, failsafe=False) == {
        "failsafe_mode": False,
        "demoted": 0,
        "stayed_by_failsafe": 0,
    }
