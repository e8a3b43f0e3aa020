"""The multi-host soak's fault thread: starts each planned fault when it is due, heals it when
its time is up (faults overlap: several may be on at once), and supervises the processes
meanwhile (`servers.Supervisor`, as for `make chaos`).

Every fault is logged with its planned and real start, its real length, and the wall clock
of both ends, so the checks can line it up with the database's and the CRM's records.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from tests.chaos.crm import FakeCrm
from tests.chaos.net_fleet import NetFleet
from tests.chaos.net_plan import WRITE_WAIT_SECONDS, NetFault
from tests.chaos.netns import Degradation, Network
from tests.chaos.servers import Proc, Supervisor

# A degraded link's delayers start this long before it is due (a process takes seconds to
# start on a loaded machine).
PREPARE_AHEAD_SECONDS = 20.0


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class Active:
    fault: NetFault
    record: dict[str, Any]
    ends_at: float  # seconds into the send phase


class NetChaos:
    def __init__(
        self,
        faults: list[NetFault],
        net: Network,
        fleet: NetFleet,
        crm: FakeCrm,
        now: Any,
        seed: int,
    ) -> None:
        self.pending = sorted(faults, key=lambda f: f.at)
        self.planned = len(faults)
        self.net = net
        self.fleet = fleet
        self.crm = crm
        self.now = now  # seconds into the send phase (the sender's clock)
        self.seed = seed
        self.rng = random.Random(f"net-victims:{seed}")
        self.active: list[Active] = []
        self.log: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.supervisor = Supervisor(fleet, now, fleet.concurrency, self.errors, self._host)
        self.incidents = self.supervisor.incidents
        self.done = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="net-chaos", daemon=True)
        self._supervised = 0.0
        self.prepared: dict[int, Degradation] = {}  # id(fault) -> its delayers, started
        self.caught: threading.Event | None = None  # the armed catch of a waiting cut

    def _host(self, proc: Proc) -> dict[str, Any]:
        return {"host": self.fleet.host_of.get(proc.name)}

    def _run(self) -> None:
        while not self.stop.is_set():
            now = self.now()
            for active in [a for a in self.active if now >= a.ends_at]:
                self._end(active)
            waiting = False
            for fault in self.pending:
                if fault.at > now + PREPARE_AHEAD_SECONDS:
                    break
                if fault.kind == "degrade" and id(fault) not in self.prepared:
                    self._prepare(fault)
            for fault in list(self.pending):
                if now < fault.at:
                    break
                if self._waits(fault, now):
                    waiting = True
                    continue
                self.pending.remove(fault)
                self._start(fault)
            if not self.pending and not self.active:
                self.done.set()
            if time.monotonic() - self._supervised > 0.5:
                self._supervised = time.monotonic()
                self.supervisor.supervise()
            # A cut that waits for a write polls often: a write is at the CRM for moments.
            self.stop.wait(0.005 if waiting else 0.1)

    def _waits(self, fault: NetFault, now: float) -> bool:
        """Whether a cut that waits for a write goes on waiting: the CRM holds none of the
        host's yet (the catch is armed on the first call), and not for `WRITE_WAIT_SECONDS`."""
        if not fault.wait_for_write:
            return False
        if self.caught is None:
            self.caught = self.crm.catch_request(self.net.ip(fault.host))
        return not self.caught.is_set() and now < fault.at + WRITE_WAIT_SECONDS

    def prepare(self, until: float) -> None:
        """Start the delayers of the degraded links due before `until` (seconds into the send
        phase) and wait until they serve their queues: before the send phase starts, so the
        first faults come on time."""
        for fault in self.pending:
            if fault.at < until and fault.kind == "degrade" and id(fault) not in self.prepared:
                self._prepare(fault)
        for degradation in self.prepared.values():
            self.net.wait_bound(degradation)

    def _prepare(self, fault: NetFault) -> None:
        try:
            self.prepared[id(fault)] = self.net.prepare_degrade(
                fault.host, fault.peer, fault.delay, fault.jitter, fault.loss, self.seed
            )
        except Exception as error:
            self.errors.append(f"preparing {fault.what}: {error!r}")

    def _start(self, fault: NetFault) -> None:
        started = self.now()
        record: dict[str, Any] = {
            "what": fault.what,
            "kind": fault.kind,
            "host": fault.host,
            "peer": fault.peer,
            "planned_at": fault.at,
            "at": round(started, 2),
            "planned_seconds": fault.seconds,
            "started_wall": time.time(),
        }
        if fault.wait_for_write:
            record["waited_for_write"] = round(started - fault.at, 2)
            record["write_in_flight"] = bool(self.caught and self.caught.is_set())
        try:
            record.update(self._do(fault))
        except Exception as error:  # a fault that could not be done is reported, not hidden
            self.errors.append(f"{fault.what} at {started:.1f} s: {error!r}")
            traceback.print_exc()
            return
        finally:
            if fault.wait_for_write:
                # The held request is answered once its host is cut from the database.
                self.crm.release_caught()
                self.caught = None
        self.log.append(record)
        if fault.seconds > 0:
            self.active.append(Active(fault, record, started + fault.seconds))
        else:
            self._ended(record)
        lasting = f" for {fault.seconds:g} s" if fault.seconds else ""
        say(f"fault  {started:7.1f} s  {fault.what}{lasting}")

    def _do(self, fault: NetFault) -> dict[str, Any]:
        match fault.kind:
            case "cut":
                self.net.cut(fault.host, fault.peer)
            case "degrade":
                if id(fault) not in self.prepared:
                    self._prepare(fault)
                self.net.degrade(self.prepared[id(fault)])
            case "isolate":
                self.net.isolate(fault.host)
            case "kill_worker" | "kill_relay":
                role = fault.kind.removeprefix("kill_")
                victim = self.rng.choice(self.fleet.on_host(fault.host, role))
                pids = self.fleet.kill(victim)
                new = self.fleet.replace(victim)
                return {"killed": victim.name, "pids": pids, "started": new.name}
            case _:
                raise ValueError(f"unknown fault kind {fault.kind!r}")
        return {}

    def _end(self, active: Active) -> None:
        fault = active.fault
        self.active.remove(active)
        try:
            match fault.kind:
                case "cut":
                    self.net.uncut(fault.host, fault.peer)
                case "degrade":
                    self.net.undegrade(self.prepared.pop(id(fault)))
                case "isolate":
                    self.net.rejoin(fault.host)
        except Exception as error:
            self.errors.append(f"healing {fault.what}: {error!r}")
            traceback.print_exc()
        self._ended(active.record)
        say(f"healed {self.now():7.1f} s  {fault.what}")

    def _ended(self, record: dict[str, Any]) -> None:
        record["ended_wall"] = time.time()
        record["seconds"] = round(record["ended_wall"] - record["started_wall"], 2)

    def heal_all(self) -> None:
        """Heal whatever is still on (the soak was cut short)."""
        for active in list(self.active):
            self._end(active)
