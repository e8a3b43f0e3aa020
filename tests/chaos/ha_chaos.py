"""The HA soak's faults on the Patroni cluster, and what each cost the gateway.

The faults, decided up front from the seed (`plan_ha_faults`): the primary killed (SIGKILL of
its Patroni and its PostgreSQL: the machine lost at once; the node starts again later and
rejoins as a replica), the primary partitioned away (its interface down: Patroni on it demotes
it when it can no longer renew the leader key, a replica is promoted meanwhile), a switchover
asked of Patroni's REST API, the synchronous standby killed, and the etcd member that leads
etcd's Raft group killed or partitioned away (the other two elect another; Patroni's leader key
must survive it, so the primary stays where it is).

`HaChaos` is the multi-host soak's fault thread (tests/chaos/net_chaos.py) with these kinds
added; the node each fault hits is chosen when it is due (whichever is the primary then). A
watcher records when a new primary took office. `recovery` then measures, per fault, the time
from the fault to the first event accepted (200/202) on a request sent after the new primary
took office, and to the first key that succeeded after it (the database's clock); for an etcd
fault, also when etcd had another leader and whether the primary stayed one meanwhile.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
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
# etcd's: the member that is Raft leader at that moment killed, or partitioned away.
ETCD_KINDS = ("kill_etcd_leader", "isolate_etcd_leader")
HA_KINDS = PG_KINDS + BROKER_KINDS + ETCD_KINDS
# How long a killed node stays down, and a partitioned primary away, before it comes back.
DOWN_SECONDS = 25.0
# How long the watcher waits for a new primary after a fault.
PROMOTION_PATIENCE = 90.0
# The roles Patroni's REST API gives a primary (3.0 says "master").
PRIMARY_ROLES = ("master", "primary")


def plan_ha_faults(
    seed: int, duration: float, short: bool, broker: bool, kinds: list[str] | None = None
) -> list[NetFault]:
    """`kinds` in this order if given. Otherwise a short run: the primary killed, the etcd
    leader killed, a broker node killed (with a RabbitMQ cluster), then a switchover while the
    etcd member is still down (two members of three). A full run: rounds of every PostgreSQL
    (and broker) kind, and each etcd kind once, at a place of the seed's choosing. Over 10-80 %
    of `duration`, a fault every `gap` seconds so each one's aftermath is its own."""
    rng = random.Random(f"ha-faults:{seed}")
    every = PG_KINDS + (BROKER_KINDS if broker else ())
    if kinds is not None:
        kinds = list(kinds)
    elif short:
        broker_kinds = ["kill_broker_node"] if broker else []
        kinds = ["kill_primary", "kill_etcd_leader", *broker_kinds, "switchover"]
    else:
        rounds = max(1, int(0.75 * duration // (len(every) * 45)))
        kinds = [kind for _ in range(rounds) for kind in rng.sample(every, len(every))]
        for kind in ETCD_KINDS:
            kinds.insert(rng.randrange(len(kinds) + 1), kind)
    start, window = 0.1 * duration, 0.7 * duration
    gap = window / len(kinds)
    faults = []
    for i, kind in enumerate(kinds):
        at = round(start + i * gap + rng.uniform(0, 0.1 * gap), 1)
        seconds = 0.0 if kind == "switchover" else DOWN_SECONDS
        target = "broker" if kind in BROKER_KINDS else kind.split("_")[-1]
        target = "etcd-leader" if kind in ETCD_KINDS else target
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
        # Faults begun so far: a watcher stops when the next one begins (a switchover's
        # request takes seconds, and its record is logged only once it is done).
        self.begun = 0
        # Per fault (its index in `log`): when it was done, and when a new primary took office.
        self.times: dict[int, dict[str, Any]] = {}

    def _do(self, fault: NetFault) -> dict[str, Any]:
        self.begun += 1
        if fault.kind not in HA_KINDS:
            return super()._do(fault)
        if fault.kind in BROKER_KINDS:
            return self._broker_fault(fault)
        if fault.kind in ETCD_KINDS:
            return self._etcd_fault(fault)
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
            self._watch(self._watch_promotion, times, old, self.begun)
        return record

    @staticmethod
    def _watch(target: Any, *args: Any) -> None:
        threading.Thread(target=target, args=args, daemon=True).start()

    def _etcd_fault(self, fault: NetFault) -> dict[str, Any]:
        etcd = self.cluster.etcd
        assert etcd is not None
        member = etcd.leader()
        if member is None:
            raise RuntimeError("no etcd member says it is the leader")
        primary = self.cluster.leader()
        if primary is None:
            raise RuntimeError(f"no primary: {self.cluster.members()}")
        state = self.cluster.node_state(primary) or {}
        record: dict[str, Any] = {
            "host": member,
            "node": member,
            "primary_before": primary,
            "timeline_before": state.get("timeline"),
        }
        if fault.kind == "kill_etcd_leader":
            record["pids"] = etcd.kill_member(member)
        else:
            self.net.isolate(member)
        self.hit[id(fault)] = member
        times = self.times[len(self.log)] = {"done_wall": time.time(), "at": self.now()}
        self._watch(self._watch_promotion, times, primary, self.begun)
        self._watch(self._watch_etcd, times, member, primary, state.get("timeline"), self.begun)
        return record

    def _watch_etcd(
        self, times: dict[str, Any], member: str, primary: str, timeline: int | None, number: int
    ) -> None:
        """Note when another etcd member leads, and when the primary stopped being one (its
        role or timeline changed, as its own Patroni says: that answer asks nothing of etcd),
        polled every 0.2 s until 10 s after the member is back or the next fault starts."""
        etcd = self.cluster.etcd
        assert etcd is not None
        deadline = time.monotonic() + DOWN_SECONDS + 10
        while time.monotonic() < deadline and not self.stop.is_set() and self.begun == number:
            if "etcd_elected_wall" not in times:
                leader = etcd.leader(besides=member)
                if leader is not None:
                    times.update(etcd_elected_wall=time.time(), etcd_leader=leader)
            state = self.cluster.node_state(primary) or {}
            seen = {k: state.get(k) for k in ("role", "state", "timeline")}
            demoted = state and (seen["role"] not in PRIMARY_ROLES or seen["timeline"] != timeline)
            if demoted and "primary_lost_wall" not in times:
                times.update(primary_lost_wall=time.time(), primary_seen=seen)
            time.sleep(0.2)

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

    def _watch_promotion(self, times: dict[str, Any], old: str | None, number: int) -> None:
        """Note when another node is the running leader (polled every 0.2 s), until the next
        fault begins (`number`: this fault's place among those begun)."""
        deadline = time.monotonic() + PROMOTION_PATIENCE
        while time.monotonic() < deadline and not self.stop.is_set() and self.begun == number:
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
            elif node is not None and fault.kind == "kill_etcd_leader":
                assert self.cluster.etcd is not None
                self.cluster.etcd.start_member(node)
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
        for index, fault in enumerate(faults):
            if fault["kind"] not in HA_KINDS:
                continue
            began = float(fault["done_wall"])
            # The fault's own aftermath: 30 s, or less if the next fault began sooner.
            after = [float(f["started_wall"]) for f in faults[index + 1 :]]
            until = min([began + DOWN_SECONDS + 5, *after])
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
            # What intake saw in that aftermath: answers that were not 2xx because no primary
            # took writes, and the slowest answer.
            during = [a for a in answers if began <= t0_wall + a.started < until]
            rows.append(
                {
                    "what": fault["what"],
                    "node": fault.get("node"),
                    "answered_503": sum(a.status == 503 for a in during),
                    "slowest_answer": round(max((a.elapsed for a in during), default=0.0), 2),
                    "replica_lag_bytes": fault.get("replica_lag_bytes"),
                    "new_primary": fault.get("new_primary"),
                    "promoted_after": round(since - began, 2) if since != began else None,
                    "first_accepted_after": round(min(accepted) - began, 2) if accepted else None,
                    "first_succeeded_after": round(succeeded - began, 2) if succeeded else None,
                    "first_published_after": round(published - began, 2) if published else None,
                    "acknowledged_then_lost": lost,
                    **_etcd_figures(fault, began),
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


def _etcd_figures(fault: dict[str, Any], began: float) -> dict[str, Any]:
    """An etcd fault's own: seconds until another member led etcd, and until the primary
    stopped being one (None: it stayed, as it should with two members of three left)."""
    if fault["kind"] not in ETCD_KINDS:
        return {}
    elected, lost = fault.get("etcd_elected_wall"), fault.get("primary_lost_wall")
    return {
        "etcd_leader": fault.get("etcd_leader"),
        "etcd_elected_after": round(elected - began, 2) if elected else None,
        "primary_before": fault.get("primary_before"),
        "primary_lost_after": round(lost - began, 2) if lost else None,
        "primary_seen": fault.get("primary_seen"),
    }
