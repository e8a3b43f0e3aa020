"""The HA soak's fault plan: every kind in a full run, the CI run's two failovers, each fault
over before the drain."""

from __future__ import annotations

from collections import Counter

from tests.chaos.ha_chaos import BROKER_KINDS, DOWN_SECONDS, PG_KINDS, plan_ha_faults


def test_a_full_run_has_every_kind_twice_in_time_order() -> None:
    faults = plan_ha_faults(3, 600, short=False, broker=False)
    assert Counter(f.kind for f in faults) == dict.fromkeys(PG_KINDS, 2)
    assert [f.at for f in faults] == sorted(f.at for f in faults)
    assert all(f.at + f.seconds <= 0.85 * 600 for f in faults)


def test_a_full_run_with_a_rabbitmq_cluster_loses_its_nodes_too() -> None:
    kinds = Counter(f.kind for f in plan_ha_faults(3, 600, short=False, broker=True))
    assert set(kinds) == set(PG_KINDS + BROKER_KINDS)


def test_the_short_run_kills_the_primary_then_switches_over() -> None:
    faults = plan_ha_faults(1, 100, short=True, broker=False)
    assert [f.kind for f in faults] == ["kill_primary", "switchover"]
    assert faults[0].seconds == DOWN_SECONDS and faults[1].seconds == 0
    with_broker = plan_ha_faults(1, 100, short=True, broker=True)
    assert [f.kind for f in with_broker] == ["kill_primary", "kill_broker_node", "switchover"]


def test_chosen_faults_come_in_the_order_given_within_the_run() -> None:
    """`--faults`: exactly those kinds, in that order, each over before the drain."""
    faults = plan_ha_faults(7, 150, short=False, broker=True, chosen=["isolate_broker_node"])
    assert [(f.kind, f.host, f.seconds) for f in faults] == [
        ("isolate_broker_node", "broker", DOWN_SECONDS)
    ]
    assert faults[0].at + faults[0].seconds <= 0.85 * 150
    chosen = ["switchover", "isolate_broker_node", "kill_primary"]
    assert [
        f.kind for f in plan_ha_faults(7, 300, short=True, broker=True, chosen=chosen)
    ] == chosen
