"""The upgrade soak's steps: the migrations, then each kind of process replaced by this
checkout's code one process at a time, in the order asked for, while the traffic runs.

A process is replaced as a supervisor rolls a deployment: the new one is started and waited
for (a worker until it consumes, a receiver until it listens), then the old one is stopped
with SIGTERM and waited for. A receiver is also taken out of the clients' rotation before it
is stopped, as a load balancer drains a backend: the new one joins first, so the clients
always have a receiver, and requests already sent to the old one finish there. Meanwhile
every receiver's `/readyz` is probed each second (the load balancer's view, recorded, not
acted on), and the fleet is supervised: a process that exits by itself is an incident.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

from tests.chaos.client import Scheduler
from tests.chaos.net_soak import warm_up
from tests.chaos.servers import Proc, Supervisor
from tests.chaos.settle import say
from tests.chaos.upgrade_fleet import NEW, VersionedFleet, schema_revision

# The kinds of step, and the order docs/how-to/upgrading.md prescribes.
ORDER = ("migrate", "workers", "relays", "sweeper", "receivers")
ROLE = {"workers": "worker", "relays": "relay", "sweeper": "sweeper", "receivers": "receiver"}
# The steps are spread over this span of the send phase, so traffic meets every mix of old
# and new processes, and the last steps still see a good share of it.
FIRST_STEP, LAST_STEP = 0.1, 0.7
# How long a receiver is out of the rotation before it is stopped: requests that picked it
# just before are on their way by then (a load balancer's drain; uvicorn then finishes the
# requests it has before it exits).
DRAIN_SECONDS = 2.0
# How a process stopped with SIGTERM may end: 0, or killed by the signal it was sent, which
# uvicorn raises again once its graceful shutdown is over (a receiver logs receiver.stopped
# first). None: it had to be killed.
CLEAN_EXITS = (0, -signal.SIGTERM)
# A receiver's `/readyz` answers within this, or counts as not ready.
PROBE_TIMEOUT_SECONDS = 2.0


class Rollout:
    """Runs the steps of `order` from a thread of its own, each at its planned time or once
    the step before it is done, and supervises the fleet until `stop` is set; `done` is set
    once every step ran."""

    def __init__(
        self,
        order: list[str],
        fleet: VersionedFleet,
        schedulers: list[Scheduler],
        token: str,
        now: Callable[[], float],
        duration: float,
        concurrency: int,
    ) -> None:
        self.fleet = fleet
        self.schedulers = schedulers
        self.token = token
        self.now = now
        self.concurrency = concurrency
        self.units = _units(order, fleet)
        span = (LAST_STEP - FIRST_STEP) * duration
        self.times = [
            FIRST_STEP * duration + span * i / max(1, len(self.units) - 1)
            for i in range(len(self.units))
        ]
        self.rotation = [fleet.url(p) for p in fleet.alive("receiver")]
        self.log: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.supervisor = Supervisor(fleet, now, concurrency, self.errors)
        self.probes: list[tuple[float, str, str]] = []  # (when, receiver, its answer)
        self.done = threading.Event()
        self.stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, name="rollout", daemon=True),
            threading.Thread(target=self._probe, name="readyz", daemon=True),
        ]

    def planned(self) -> list[tuple[float, tuple[str, Proc | None]]]:
        """Each step's planned time (seconds into the send phase) and what it does."""
        return list(zip(self.times, self.units, strict=True))

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _run(self) -> None:
        for at, (kind, old) in self.planned():
            while self.now() < at and not self.stop.is_set():
                self.supervisor.supervise()
                self.stop.wait(0.25)
            if self.stop.is_set():
                return
            started = self.now()
            try:
                detail = self._migrate() if old is None else self._replace(old)
            except Exception as error:  # a step that could not be done is reported
                self.errors.append(f"{kind} at {started:.1f} s: {error!r}")
                continue
            entry = {"at": round(started, 2), "step": kind, "took": round(self.now() - started, 2)}
            self.log.append({**entry, **detail})
            say(f"upgrade  {self.log[-1]}")
            if detail.get("exit_code") and old is None:
                break  # the migration failed: an operator would not roll the processes on
        self.done.set()
        while not self.stop.is_set():
            self.supervisor.supervise()
            self.stop.wait(0.25)

    def _migrate(self) -> dict[str, Any]:
        seconds, code, output = self.fleet.migrate(NEW)
        if code != 0:
            self.errors.append(f"idem migrate exited {code}: {output[-500:]}")
        return {
            "seconds": round(seconds, 2),
            "exit_code": code,
            "revision": schema_revision(self.fleet.env["DATABASE_URL"]),
            # How often a migration gave its lock up and was tried again.
            "lock_retries": output.count('"migrations.lock_retry"'),
        }

    def _replace(self, old: Proc) -> dict[str, Any]:
        self.fleet.running[old.role] = NEW
        match old.role:
            case "receiver":
                new = self.fleet.start_receiver()
                warm_up([self.fleet.url(new)], self.token)
                self._rotate(self.fleet.url(new), self.fleet.url(old))
                time.sleep(DRAIN_SECONDS)
            case "worker":
                new = self.fleet.start_worker(self.concurrency)
            case "relay":
                new = self.fleet.start_relay()
            case _:
                new = self.fleet.start_sweeper()
        stopping = self.now()
        code = self.fleet.retire(old)
        if code not in CLEAN_EXITS:
            self.errors.append(f"{old.name} ended with {code} on SIGTERM")
        return {
            "stopped": old.name,
            "started": new.name,
            "exit_code": code,
            "stop_seconds": round(self.now() - stopping, 2),
        }

    def _rotate(self, joining: str, leaving: str) -> None:
        self.rotation = [url for url in self.rotation if url != leaving] + [joining]
        for scheduler in self.schedulers:
            scheduler.set_receivers(self.rotation)

    def _probe(self) -> None:
        with httpx.Client(timeout=PROBE_TIMEOUT_SECONDS) as client:
            while not self.stop.wait(1.0):
                for proc in self.fleet.alive("receiver"):
                    try:
                        answer = client.get(f"{self.fleet.url(proc)}/readyz").status_code
                        said = "ready" if answer == 200 else "not_ready"
                    except httpx.HTTPError:
                        said = "unanswered"
                    self.probes.append((self.now(), proc.name, said))

    def readiness(self) -> dict[str, dict[str, Any]]:
        """Per receiver: its version, how many probes it answered ready, not ready (503) or
        not at all (within PROBE_TIMEOUT_SECONDS), and when it first answered not ready
        (seconds into the send phase)."""
        found: dict[str, dict[str, Any]] = {}
        for at, name, said in self.probes:
            row = found.setdefault(
                name,
                {
                    "version": self.fleet.version_of[name],
                    "ready": 0,
                    "not_ready": 0,
                    "unanswered": 0,
                    "first_not_ready": None,
                },
            )
            row[said] += 1
            if said == "not_ready" and row["first_not_ready"] is None:
                row["first_not_ready"] = round(at, 1)
        return found


def _units(order: list[str], fleet: VersionedFleet) -> list[tuple[str, Proc | None]]:
    """Each step of `order` as units: the migration, or one process to replace."""
    units: list[tuple[str, Proc | None]] = []
    for kind in order:
        if kind == "migrate":
            units.append((kind, None))
        else:
            units.extend((kind, proc) for proc in fleet.alive(ROLE[kind]))
    return units


def errors_logged(fleet: VersionedFleet) -> dict[str, dict[str, int]]:
    """Error and critical log lines of every process, by version and event."""
    counts: dict[str, Counter[str]] = {}
    for name, version in fleet.version_of.items():
        text = (fleet.log_dir / f"{name}.log").read_text(errors="replace")
        for line in text.splitlines():
            if '"level": "error"' not in line and '"level": "critical"' not in line:
                continue
            try:
                event = str(json.loads(line).get("event", ""))[:80]
            except ValueError:
                event = line[:80]
            counts.setdefault(version, Counter())[event] += 1
    return {version: dict(counter) for version, counter in counts.items()}
