"""The HA soak's fault plan: every kind in a full run, the CI run's two failovers, a plan of
the operator's choosing, each fault over before the drain."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from tests.chaos.ha_chaos import (
    BROKER_KINDS,
    DOWN_SECONDS,
    ETCD_KINDS,
    PG_KINDS,
    plan_ha_faults,
)


def test_a_full_run_has_every_database_kind_twice_and_etcd_s_once_in_time_order() -> None:
    faults = plan_ha_faults(3, 600, short=False, broker=False)
    assert Counter(f.kind for f in faults) == {
        **dict.fromkeys(PG_KINDS, 2),
        **dict.fromkeys(ETCD_KINDS, 1),
    }
    assert [f.at for f in faults] == sorted(f.at for f in faults)
    assert all(f.at + f.seconds <= 0.85 * 600 for f in faults)
    # Each fault's aftermath its own: the next one comes after this one is healed.
    assert all(b.at - a.at > DOWN_SECONDS + 10 for a, b in pairwise(faults))


def test_a_full_run_with_a_rabbitmq_cluster_loses_its_nodes_too() -> None:
    kinds = Counter(f.kind for f in plan_ha_faults(3, 600, short=False, broker=True))
    assert set(kinds) == set(PG_KINDS + BROKER_KINDS + ETCD_KINDS)


def test_the_etcd_faults_take_places_of_the_seed_s_choosing() -> None:
    places = {
        tuple(i for i, f in enumerate(plan_ha_faults(seed, 600, False, False)) if "etcd" in f.kind)
        for seed in range(20)
    }
    assert len(places) > 1


def test_a_chosen_plan_is_run_in_its_order_over_the_window() -> None:
    faults = plan_ha_faults(
        1, 200, short=False, broker=False, kinds=["kill_etcd_leader", "kill_primary"]
    )
    assert [(f.kind, f.host) for f in faults] == [
        ("kill_etcd_leader", "etcd-leader"),
        ("kill_primary", "primary"),
    ]
    assert 20 <= faults[0].at < faults[1].at and faults[1].at + faults[1].seconds <= 0.85 * 200


def test_the_short_run_kills_the_primary_and_etcd_s_leader_then_switches_over() -> None:
    faults = plan_ha_faults(1, 100, short=True, broker=False)
    assert [f.kind for f in faults] == ["kill_primary", "kill_etcd_leader", "switchover"]
    assert [f.seconds for f in faults] == [DOWN_SECONDS, DOWN_SECONDS, 0]
    # The killed primary's node is back before the switchover asks for a healthy standby.
    assert faults[0].at + DOWN_SECONDS < faults[2].at
    with_broker = plan_ha_faults(1, 100, short=True, broker=True)
    assert [f.kind for f in with_broker] == [
        "kill_primary",
        "kill_etcd_leader",
        "kill_broker_node",
        "switchover",
    ]


def test_chosen_faults_come_in_the_order_given_within_the_run() -> None:
    """`--faults`: exactly those kinds, in that order, each over before the drain."""
    faults = plan_ha_faults(7, 150, short=False, broker=True, kinds=["isolate_broker_node"])
    assert [(f.kind, f.host, f.seconds) for f in faults] == [
        ("isolate_broker_node", "broker", DOWN_SECONDS)
    ]
    assert faults[0].at + faults[0].seconds <= 0.85 * 150
    chosen = ["switchover", "isolate_broker_node", "kill_primary"]
    assert [f.kind for f in plan_ha_faults(7, 300, short=True, broker=True, kinds=chosen)] == chosen
