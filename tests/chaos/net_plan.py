"""The multi-host soak's faults, decided up front from the seed: which link or host, when, for
how long, and how bad.

The schedule is made of rounds. Each round cuts every kind of link the task cares about once
(a worker from PostgreSQL for three leases, a worker from Redis, a receiver from PostgreSQL, the
relay from Redis), degrades links with latency and loss, isolates a worker host altogether,
and kills a worker and the relay, with the hosts taking turns from round to round. The rounds
fill 5-85 % of the send phase (one round in a short run, three in ten minutes), so every
fault is healed well before the drain.

One worker-to-PostgreSQL cut per round waits (up to `WRITE_WAIT_SECONDS`) until the worker has
a write in flight at the CRM: the worker then holds a lease it can no longer renew, which is
the case the lease margin exists for. Another comes while the same worker's link to the CRM is
degraded, so that a write it sent late would arrive late too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKERS = ("worker-1", "worker-2", "worker-3")
RECEIVERS = ("receiver-1", "receiver-2")
# How long a round lasts at most; a shorter run has one round as long as its window.
ROUND_SECONDS = 160.0
# How long a cut waits for the worker's write at the CRM before it cuts anyway.
WRITE_WAIT_SECONDS = 15.0
# Latency per direction (a round trip gains twice this), ± jitter; loss per direction.
DELAY_SECONDS = 0.2
JITTER_SECONDS = 0.05
LOSSES = (0.05, 0.1, 0.2)


@dataclass(frozen=True)
class NetFault:
    at: float  # seconds into the send phase
    seconds: float  # how long it lasts (0: a kill, over at once)
    kind: str  # cut | degrade | isolate | kill_worker | kill_relay
    host: str
    peer: str = ""  # cut, degrade: the other end of the link
    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    wait_for_write: bool = False  # cut: when the host has a write in flight at the CRM

    @property
    def what(self) -> str:
        """The fault in a few words, for the report."""
        match self.kind:
            case "cut":
                return f"cut {self.host} <-> {self.peer}"
            case "degrade":
                return (
                    f"degrade {self.host} <-> {self.peer}: {self.delay * 1000:.0f}"
                    f" ± {self.jitter * 1000:.0f} ms each way, {self.loss:.0%} loss each way"
                )
            case "isolate":
                return f"isolate {self.host} (eth0 down)"
            case _:
                return f"{self.kind} on {self.host}"


def plan_net_faults(seed: int, duration: float, lease_seconds: float) -> list[NetFault]:
    """The rounds over 5-85 % of `duration` (see the module's docstring), sorted by time."""
    rng = random.Random(f"net-faults:{seed}")
    start, window = 0.05 * duration, 0.8 * duration
    rounds = max(1, round(window / ROUND_SECONDS))
    length = window / rounds
    # A short run's spells shrink with its window, never below what makes each one matter: a
    # worker's PostgreSQL cut outlives a lease by two more, time for the sweeper to re-drive
    # the expired lease (after SWEEP_GRACE_SECONDS) and another worker to take it over before
    # the cut holder's own write can land. Two more, not one, in a short run too: with one the
    # takeover had a second or two to spare, and on a loaded machine it came after the heal,
    # when the holder's own write had landed.
    scale = min(1.0, length / ROUND_SECONDS)
    lease_cut = 3 * lease_seconds

    def seconds(base: float, floor: float = 5.0) -> float:
        return round(max(floor, base * scale), 1)

    faults: list[NetFault] = []
    for r in range(rounds):
        t0 = start + r * length
        worker = [WORKERS[(r + i) % len(WORKERS)] for i in range(len(WORKERS))]
        receiver = RECEIVERS[r % len(RECEIVERS)]

        def at(share: float) -> float:
            return round(t0 + share * length + rng.uniform(0, 0.03 * length), 1)  # noqa: B023

        def loss() -> float:
            return rng.choice(LOSSES)

        slow = {"delay": DELAY_SECONDS, "jitter": JITTER_SECONDS}
        if scale < 1.0:
            # A short run: one cut of each kind and the slow database link, in an order that
            # lets each matter. The worker is cut from PostgreSQL first, while its requests
            # reach the CRM (after the relay's cut, the relay backs off for up to 5 s and
            # nothing flows); a receiver's cut outlasts its 6 s bound, so it answers 503.
            faults += [
                NetFault(at(0.0), seconds(40), "degrade", worker[2], "db", **slow, loss=loss()),
                NetFault(at(0.1), lease_cut, "cut", worker[1], "db", wait_for_write=True),
                NetFault(at(0.3), 10, "cut", receiver, "db"),
                NetFault(at(0.5), seconds(20), "cut", "relay", "broker"),
                NetFault(at(0.6), seconds(25), "cut", worker[0], "broker"),
            ]
            continue
        faults += [
            NetFault(at(0.0), 40, "degrade", worker[2], "db", **slow, loss=loss()),
            NetFault(at(0.05), lease_cut, "cut", worker[1], "db", wait_for_write=True),
            NetFault(at(0.15), 20, "cut", "relay", "broker"),
            NetFault(at(0.25), 20, "cut", receiver, "db"),
            NetFault(at(0.35), 25, "cut", worker[0], "broker"),
            # The same worker's link to the CRM slow and lossy while it is cut from PostgreSQL:
            # a request it sent before giving its lease up would arrive late as well.
            NetFault(at(0.45), 45, "degrade", worker[2], "client", **slow, loss=loss()),
            NetFault(at(0.5), lease_cut, "cut", worker[2], "db", wait_for_write=True),
            NetFault(at(0.6), 20, "isolate", worker[1]),
            NetFault(at(0.65), 30, "degrade", receiver, "db", **slow, loss=loss()),
            NetFault(at(0.7), 30, "degrade", "relay", "broker", **slow, loss=loss()),
            NetFault(at(0.75), 30, "degrade", worker[0], "broker", **slow, loss=loss()),
            NetFault(at(0.8), 0, "kill_worker", worker[0]),
            NetFault(at(0.9), 0, "kill_relay", "relay"),
        ]
    return sorted(faults, key=lambda fault: fault.at)
