"""The HA soak's faults on the Patroni cluster, and what each cost the gateway.

The faults, decided up front from the seed (`plan_ha_faults`): the primary killed (SIGKILL of
its Patroni and its PostgreSQL: the machine lost at once; the node starts again later and
rejoins as a replica), the primary partitioned away (its interface down: Patroni on it demotes
it when it can no longer renew the leader key, a replica is promoted meanwhile), a switchover
asked of Patroni's REST API, and the synchronous standby killed.

`HaChaos` is the multi-host soak's fault thread (tests/chaos/net_chaos.py) with these kinds
added; the node each fault hits is chosen when it is due (whichever is the primary then). A
watcher records when a new primary took office. `recovery` then measures, per fault, the time
from the fault to the first event accepted (200/202) on a request sent after the new primary
took office, and to the first key that succeeded after it (the database's clock).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from tests.chaos import check
from tests.chaos.client import Answer
from tests.chaos.crm import FakeCrm
from tests.chaos.ha_cluster import Cluster
from tests.chaos.ha_rabbit import RabbitCluster
from tests.chaos.net_chaos import Active, NetChaos, say
from tests.chaos.net_fleet import NetFleet
from tests.chaos.net_plan import NetFault
from tests.chaos.netns import Network

PG_KINDS = ("kill_primary", "isolate_primary", "switchover", "kill_standby")
# The RabbitMQ cluster's, when the soak runs one: a node killed, a node partitioned away.
BROKER_KINDS = ("kill_broker_node", "isolate_broker_node")
HA_KINDS = PG_KINDS + BROKER_KINDS
# How long a killed node stays down, and a partitioned primary away, before it comes back.
DOWN_SECONDS = 25.0
# How long the watcher waits for a new primary after a fault.
PROMOTION_PATIENCE = 90.0


def plan_ha_faults(
    seed: int, duration: float, short: bool, broker: bool, chosen: Sequence[str] = ()
) -> list[NetFault]:
    """A short run: the primary killed, a broker node killed (with a RabbitMQ cluster), then a
    switchover. A full run: rounds of every kind, over 10-80 % of `duration`, a fault every
    `gap` seconds so each one's aftermath is its own. `chosen` (`--faults`): those kinds in
    that order instead, spread the same way (one fault's aftermath in a run of minutes)."""
    rng = random.Random(f"ha-faults:{seed}")
    every = PG_KINDS + (BROKER_KINDS if broker else ())
    if chosen:
        kinds = list(chosen)
    elif short:
        kinds = ["kill_primary", *(["kill_broker_node"] if broker else []), "switchover"]
    else:
        rounds = max(1, int(0.75 * duration // (len(every) * 45)))
        kinds = [kind for _ in range(rounds) for kind in rng.sample(every, len(every))]
    start, window = 0.1 * duration, 0.7 * duration
    gap = window / len(kinds)
    faults = []
    for i, kind in enumerate(kinds):
        at = round(start + i * gap + rng.uniform(0, 0.1 * gap), 1)
        seconds = 0.0 if kind == "switchover" else DOWN_SECONDS
        target = "broker" if kind in BROKER_KINDS else kind.split("_")[-1]
        faults.append(NetFault(at, seconds, kind, target))
    return faults


class HaChaos(NetChaos):
    """NetChaos with the cluster's faults (the gateway's processes are supervised as there)."""

    def __init__(
        self,
        faults: list[NetFault],
        net: Network,
        fleet: NetFleet,
        crm: FakeCrm,
        now: Any,
        seed: int,
        cluster: Cluster,
        rabbit: RabbitCluster | None = None,
    ) -> None:
        super().__init__(faults, net, fleet, crm, now, seed)
        self.cluster = cluster
        self.rabbit = rabbit
        self.broker_turn = 0  # the broker nodes take turns, the first (every client's) first
        # --lag-before-kill: seconds the standbys stop receiving WAL before a primary's kill.
        self.lag_before_kill = 0.0
        self.hit: dict[int, str] = {}  # id(fault) -> the node it hit
        # Per fault (its index in `log`): when it was done, and when a new primary took office.
        self.times: dict[int, dict[str, Any]] = {}

    def _do(self, fault: NetFault) -> dict[str, Any]:
        if fault.kind not in HA_KINDS:
            return super()._do(fault)
        if fault.kind in BROKER_KINDS:
            return self._broker_fault(fault)
        old = self.cluster.leader()
        if fault.kind == "kill_standby":
            standbys = self.cluster.standbys(synchronous=self.cluster.synchronous)
            if not standbys:
                raise RuntimeError(f"no standby to kill: {self.cluster.members()}")
            node = standbys[0]
        elif old is None:
            raise RuntimeError(f"no primary: {self.cluster.members()}")
        else:
            node = old
        record: dict[str, Any] = {"host": node, "node": node, "primary_before": old}
        # How far each replica was behind, as Patroni last reported it (bytes of WAL): what an
        # asynchronous failover may lose.
        record["replica_lag_bytes"] = {
            str(m["name"]): m.get("lag")
            for m in self.cluster.members()
            if m.get("role") != "leader"
        }
        # A switchover's request returns once it is done: its clock starts when it is asked.
        asked = {"done_wall": time.time(), "at": self.now()}
        match fault.kind:
            case "kill_primary" if self.lag_before_kill > 0:
                record.update(self._kill_lagging_primary(node))
            case "kill_primary" | "kill_standby":
                record["pids"] = self.cluster.kill_node(node)
            case "isolate_primary":
                self.net.isolate(node)
            case "switchover":
                self.cluster.switchover()
        self.hit[id(fault)] = node
        # The record `_start` keeps is made from this one once it returns: its index in `log`.
        done = asked if fault.kind == "switchover" else {"done_wall": time.time(), "at": self.now()}
        times = self.times[len(self.log)] = done
        if fault.kind != "kill_standby":
            threading.Thread(target=self._watch_promotion, args=(times, old), daemon=True).start()
        return record

    def _kill_lagging_primary(self, node: str) -> dict[str, Any]:
        """The asynchronous case at its worst: the primary cut from every standby (packets
        dropped both ways: the WAL it sends is lost on the way, none is buffered at a standby)
        for `lag_before_kill` seconds while it keeps committing and acknowledging, then killed
        and the cut healed. What it committed meanwhile exists nowhere else: the promoted
        standby lacks it."""
        others = [other for other in self.cluster.nodes if other != node]
        for other in others:
            self.net.cut(node, other)
        time.sleep(self.lag_before_kill)
        pids = self.cluster.kill_node(node)
        for other in others:
            self.net.uncut(node, other)
        return {"pids": pids, "cut_from_standbys_seconds": self.lag_before_kill}

    def _broker_fault(self, fault: NetFault) -> dict[str, Any]:
        assert self.rabbit is not None, "a broker fault without a RabbitMQ cluster"
        node = self.rabbit.nodes[self.broker_turn % len(self.rabbit.nodes)]
        self.broker_turn += 1
        record: dict[str, Any] = {"host": node, "node": node}
        if fault.kind == "kill_broker_node":
            record["pids"] = self.rabbit.kill_node(node)
        else:
            self.net.isolate(node)
        self.hit[id(fault)] = node
        self.times[len(self.log)] = {"done_wall": time.time(), "at": self.now()}
        return record

    def _watch_promotion(self, times: dict[str, Any], old: str | None) -> None:
        """Note when another node is the running leader (polled every 0.2 s)."""
        deadline = time.monotonic() + PROMOTION_PATIENCE
        while time.monotonic() < deadline and not self.stop.is_set():
            leader = self.cluster.leader()
            if leader is not None and leader != old:
                times["promoted_wall"] = time.time()
                times["new_primary"] = leader
                return
            time.sleep(0.2)

    def outage(self) -> tuple[float, float] | None:
        """The first lost primary's failover, in seconds into the send phase: from the kill
        until a new primary took office (the receivers must answer 503 meanwhile)."""
        for index, record in enumerate(self.log):
            times = self.times.get(index, {})
            if record["kind"] == "kill_primary" and "promoted_wall" in times:
                return times["at"], times["at"] + times["promoted_wall"] - times["done_wall"]
        return None

    def timed_log(self) -> list[dict[str, Any]]:
        """The fault log with each HA fault's times merged in."""
        return [{**record, **self.times.get(i, {})} for i, record in enumerate(self.log)]

    def _end(self, active: Active) -> None:
        fault = active.fault
        if fault.kind not in HA_KINDS:
            super()._end(active)
            return
        self.active.remove(active)
        node = self.hit.pop(id(fault), None)
        try:
            if node is not None and fault.kind.startswith("isolate"):
                self.net.rejoin(node)
            elif node is not None and fault.kind == "kill_broker_node":
                assert self.rabbit is not None
                self.rabbit.start_node(node)
            elif node is not None:
                self.cluster.start_node(node)
        except Exception as error:
            self.errors.append(f"healing {fault.what}: {error!r}")
        self._ended(active.record)
        say(f"healed {self.now():7.1f} s  {fault.what} ({node})")


def recovery(
    faults: list[dict[str, Any]], answers: list[Answer], t0_wall: float, database_url: str
) -> dict[str, Any]:
    """Per HA fault, seconds from the fault (its kill, partition or request done) to the first
    event accepted on a request sent after the new primary took office (after the fault, for a
    lost standby) and to the first key that succeeded after then; p50 and max of each over the
    run's faults. The primary before a switchover serves until Patroni stops it: what counts
    is what the new one serves."""
    rows = []
    with check.connect(database_url) as conn:
        for fault in faults:
            if fault["kind"] not in HA_KINDS:
                continue
            began = float(fault["done_wall"])
            since = float(fault.get("promoted_wall", began))
            accepted = [
                t0_wall + a.started + a.elapsed
                for a in answers
                if a.status in (200, 202) and t0_wall + a.started >= since
            ]
            found = conn.execute(
                "SELECT extract(epoch FROM min(updated_at)) FROM idempotency_keys"
                " WHERE status = 'succeeded' AND updated_at >= to_timestamp(%s)",
                (since,),
            ).fetchone()
            succeeded = float(found[0]) if found and found[0] is not None else None
            # What a lost broker node costs: the relay's first message through the cluster.
            found = conn.execute(
                "SELECT extract(epoch FROM min(published_at)) FROM outbox"
                " WHERE published_at >= to_timestamp(%s)",
                (since,),
            ).fetchone()
            published = float(found[0]) if found and found[0] is not None else None
            # Events answered 202 in the minute before the fault whose stored row is younger
            # than the fault: the acknowledged write did not survive the failover, and a later
            # delivery of the same event stored it again (one that is never sent again is
            # `2xx_not_committed` in the checks).
            acked = [
                a.key
                for a in answers
                if a.status == 202
                and a.key
                and began - 60 <= t0_wall + a.started + a.elapsed <= began
            ]
            found = conn.execute(
                "SELECT count(*) FROM events"
                " WHERE idempotency_key = ANY(%s) AND received_at > to_timestamp(%s)",
                (acked, began),
            ).fetchone()
            lost = int(found[0]) if found else 0
            rows.append(
                {
                    "what": fault["what"],
                    "node": fault.get("node"),
                    "replica_lag_bytes": fault.get("replica_lag_bytes"),
                    "new_primary": fault.get("new_primary"),
                    "promoted_after": round(since - began, 2) if since != began else None,
                    "first_accepted_after": round(min(accepted) - began, 2) if accepted else None,
                    "first_succeeded_after": round(succeeded - began, 2) if succeeded else None,
                    "first_published_after": round(published - began, 2) if published else None,
                    "acknowledged_then_lost": lost,
                }
            )
    summary: dict[str, Any] = {"faults": rows}
    for name in ("first_accepted_after", "first_succeeded_after", "first_published_after"):
        values = [r[name] for r in rows if r[name] is not None]
        summary[name] = {
            "p50": round(statistics.median(values), 2) if values else None,
            "max": max(values) if values else None,
            "missing": len(rows) - len(values),
        }
    return summary
