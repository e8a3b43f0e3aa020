"""What the soak will do, decided up front from the seed: each key's behaviour at the fake
CRM, each event's deliveries, and the schedule of faults.

A key's behaviour is a pure function of (seed, key), so the fake CRM (which only sees the
Idempotency-Key header) and the checker (which knows every event) agree on it without talking,
and the final state every key must reach is known before the run starts.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outbox.ingest.envelope import Envelope
from tests.chaos import fan_out

SOURCE = "chaos"
EVENT_TYPES = ("crm.lead.created", "crm.deal.won", "crm.task.assigned")
# The CRM collection each event type writes to (the routes file maps them the same way).
COLLECTIONS = {"crm.lead.created": "leads", "crm.deal.won": "deals", "crm.task.assigned": "tasks"}

# Ordered traffic: updates of CRM contacts through one route with `order_by = "/contact/id"` and
# `versions = "supersede"`. Each contact gets several versions, sent shuffled, some at the same
# instant, each delivered one to three times; the CRM records per contact the order versions
# were applied in. They come on top of the other events: ORDERED_SHARE as many.
ORDERED_EVENT_TYPE = "crm.contact.updated"
ORDERED_COLLECTION = "contacts"
ORDERED_SHARE = 0.15
ORDERED_VERSIONS = (3, 6)  # versions per contact, drawn per contact
# A contact's first deliveries all fall within this many seconds (shuffled), and this share of
# its versions go at one instant.
ORDERED_SPREAD_SECONDS = 1.5
ORDERED_SAME_INSTANT = 0.3

# Behaviours and their shares of the keys; the rest answer 201 at once.
LOST = "lost"  # commit, then drop the connection without an answer
UNAVAILABLE = "unavailable"  # 503 + Retry-After (1-2 s) once or twice, no write; then 201
RATE_LIMITED = "rate_limited"  # 429 once, no write; then 201
INVALID = "invalid"  # 422 every time, never a write: a permanent failure
SLOW = "slow"  # commit, then answer after the client's read timeout
# Take the write in, answer nothing, and apply it 0.5-1 s after the client gave up (a busy CRM
# that acts late): whoever looks the key up before then finds nothing.
APPLIED_LATE = "applied_late"
OK = "ok"
SHARES = (
    (LOST, 0.10),
    (UNAVAILABLE, 0.10),
    (RATE_LIMITED, 0.05),
    (INVALID, 0.02),
    (SLOW, 0.05),
    (APPLIED_LATE, 0.05),
)
BEHAVIOURS = (*(name for name, _ in SHARES), OK)
# Behaviours whose first write is certain to be followed by a lost answer: the next attempt
# must reconcile (find the effect) rather than write again.
ANSWER_LOST = frozenset({LOST, SLOW, APPLIED_LATE})

# Who acts on an event's key: the gateway's worker (posted to /v1/events) or a workflow that
# makes the CRM call itself through /v1/claims (tests/chaos/workflow.py).
VIA_EVENTS = "events"
VIA_CLAIMS = "claims"
CLAIMS_SHARE = 0.20
# Of the claims events, the share whose first run crashes right after the CRM created the
# task (no /complete, no /fail): the lease runs out and a later delivery reclaims the key.
ABANDON_SHARE = 0.10
# Claim leases: short, so abandoned claims are reclaimed within the run; long enough that a
# workflow can still make its CRM call inside one (see workflow.ACT_MARGIN_SECONDS).
CLAIM_LEASE_SECONDS = (3, 5)
# The first claims events are given keys with these behaviours (and the first OK one is
# abandoned), so even a short run drives every path of a workflow: complete, retryable and
# final failure, lost answer, abandon and reclaim.
CLAIMS_COVERAGE = (INVALID, LOST, SLOW, APPLIED_LATE, UNAVAILABLE, RATE_LIMITED, OK)


@dataclass(frozen=True)
class Behaviour:
    kind: str
    failures: int = 0  # how many 503s before success (UNAVAILABLE)
    retry_after: int = 0  # seconds announced with each 503


def behaviour_at(seed: int, key: str, collection: str, late: bool = True) -> Behaviour:
    """The key's behaviour at one collection of the fake CRM. The ordered contacts never
    refuse a write for good (a 422 would leave a dead letter holding the contact's lane, and
    the last version could not be applied): their invalid share behaves fine."""
    behaviour = behaviour_of(seed, key, late)
    if collection == ORDERED_COLLECTION and behaviour.kind == INVALID:
        return Behaviour(OK)
    return behaviour


def behaviour_of(seed: int, key: str, late: bool = True) -> Behaviour:
    """The key's behaviour at the fake CRM: deterministic in (seed, key). Without `late`, no
    write is applied late: that share behaves fine (the upgrade soak's previous release
    could act twice on such a write, a defect fixed since)."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    share = int.from_bytes(digest[:8], "big") / 2**64
    for kind, size in SHARES:
        if share < size:
            if kind == APPLIED_LATE and not late:
                return Behaviour(OK)
            if kind == UNAVAILABLE:
                return Behaviour(kind, failures=1 + digest[8] % 2, retry_after=1 + digest[9] % 2)
            return Behaviour(kind)
        share -= size
    return Behaviour(OK)


# How a delivery relates to the event's first one.
FIRST = "first"
SOON = "soon"  # a few seconds later (a provider's redelivery, a double click)
CONCURRENT = "concurrent"  # at the same instant as the first
LATE = "late"  # at the end of the run, long after the key finished
CONFLICT = "conflict"  # same key, another payload: must be refused and change nothing
AFTER_LEASE = "after_lease"  # claims: a redelivery after an abandoned claim's lease ran out


@dataclass
class PlannedEvent:
    index: int
    event_type: str
    external_id: str
    payload: dict[str, Any]
    key: str
    behaviour: Behaviour
    via: str = VIA_EVENTS
    lease_seconds: int = 0  # claims only: the lease each claim asks for
    abandon: bool = False  # claims only: the first run that creates the task crashes
    # Ordered traffic only: the contact (its lane) and this update's version of it.
    contact: str | None = None
    version: int | None = None
    # Fan-out only: destination -> the behaviour its delivery's key meets at the CRM.
    destinations: dict[str, Behaviour] = field(default_factory=dict)

    @property
    def ordered(self) -> bool:
        return self.contact is not None

    @property
    def fanned_out(self) -> bool:
        return bool(self.destinations)

    def claim_body(self, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        """What a workflow POSTs to /v1/claims for this event."""
        return {
            "key": self.key,
            "payload": self.payload if payload is None else payload,
            "lease_seconds": self.lease_seconds,
            "workflow": "chaos-soak-workflow",
        }

    def body(self, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {
            "source": SOURCE,
            "event_type": self.event_type,
            "external_id": self.external_id,
            "payload": self.payload if payload is None else payload,
            "workflow": "chaos-soak",
        }
        if self.version is not None:
            body["version"] = self.version
        return body


@dataclass
class Delivery:
    event: PlannedEvent
    kind: str
    at: float  # seconds after the start of the send phase
    body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Fault:
    at: float
    # kill_worker | kill_relay | restart_broker | restart_postgres | route_down | route_up |
    # route_flaky | route_steady
    kind: str


# One route's downstream goes down for a while: every write the gateway sends to that
# collection answers 503 without Retry-After and writes nothing (the workflows' own calls,
# which no route governs, still go through). The route's circuit must open, the keys must
# wait without spending their attempts, and all of them must succeed once after.
OUTAGE_COLLECTION = "deals"
OUTAGE_SECONDS_MAX = 60.0
# The soak's routes judge their circuit over a 5 s window with at least 5 calls, and cool down
# 2 s, doubling up to 8 s, so even the CI-sized run's short outage sees trials fail and re-open.
CIRCUIT_MINIMUM_CALLS = 5
CIRCUIT_WINDOW_SECONDS = 5.0
CIRCUIT_HALF_OPEN_CALLS = 3
CIRCUIT_COOLDOWN_SECONDS = 2.0
CIRCUIT_COOLDOWN_CAP_SECONDS = 8.0

# Another route's downstream mostly works for a while: a share of the gateway's writes to it
# (30-60 %, drawn per run) answer 503 and write nothing. Every key must still succeed once;
# the circuit may open and close on the way, and no key may be stalled or loop.
FLAKY_COLLECTION = "tasks"

# A spell (the route outage, the partial failure) lasts its planned length from when it really
# began, not until its planned end: the fault before it runs in the same thread and may start
# it late (the PostgreSQL restart takes its 5 s). It also lasts until the gateway's writes met
# it `min_writes` times (*_MIN_WRITES): after the database outage the relays may stay quiet for
# up to their backoff cap (5 s), and a spell that met no write proves nothing. At most
# SPELL_GRACE_SECONDS longer it ends anyway, and the checks report how few writes it met.
SPELL_GRACE_SECONDS = 30.0
# The outage's writes are refused: enough of them to open the circuit of a quiet route.
OUTAGE_MIN_WRITES = CIRCUIT_MINIMUM_CALLS
# A share of at least 30 % refuses none of 30 writes with a chance of 0.7**30, under 1 in 30 000.
PARTIAL_MIN_WRITES = 30


def spell_over(began: float, seconds: float, writes: int, min_writes: int, now: float) -> bool:
    """Whether a spell that began at `began` (seconds into the send phase), planned to last
    `seconds`, and met `writes` of the gateway's writes so far, may end at `now`."""
    if now < began + seconds:
        return False
    return writes >= min_writes or now >= began + seconds + SPELL_GRACE_SECONDS


@dataclass(frozen=True)
class RouteOutage:
    collection: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def plan_route_outage(seed: int, duration: float) -> RouteOutage:
    """A fifth of the send phase (at most a minute), starting between 15 % and 35 % of it."""
    rng = random.Random(f"route-outage:{seed}")
    start = rng.uniform(0.15, 0.35) * duration
    return RouteOutage(OUTAGE_COLLECTION, start, start + min(OUTAGE_SECONDS_MAX, 0.2 * duration))


@dataclass(frozen=True)
class PartialFailure:
    collection: str
    start: float
    end: float
    share: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def plan_partial_failure(seed: int, duration: float) -> PartialFailure:
    """A fifth of the send phase (at most a minute), starting between 50 % and 60 % of it."""
    rng = random.Random(f"partial-failure:{seed}")
    start = rng.uniform(0.5, 0.6) * duration
    end = start + min(OUTAGE_SECONDS_MAX, 0.2 * duration)
    return PartialFailure(FLAKY_COLLECTION, start, end, round(rng.uniform(0.3, 0.6), 2))


def max_trials(outage: float, cooldown: float, cap: float, trials: int) -> int:
    """How many trial calls fit in an outage: the k-th half-open spell comes no sooner than the
    first k cool-downs (each doubles, up to the cap) after the circuit opened, and lets through
    `trials` failures plus the trials still running when the last of them re-opened it."""
    spells, elapsed, step = 0, 0.0, cooldown
    while elapsed + step <= outage:
        elapsed += step
        spells += 1
        step = min(cap, step * 2)
    return spells * (2 * trials - 1)


def derived_key(body: dict[str, Any]) -> str:
    """The key the receiver derives for `body` (same code, so the same answer)."""
    return Envelope.model_validate(body).derived_key(fold_external_id_case=False)


def claim_key(seed: int, index: int, wanted: str | None = None, late: bool = True) -> str:
    """The key a workflow claims for event `index`; with `wanted`, the first candidate key
    whose CRM behaviour is that one (a few dozen hashes at most)."""
    for attempt in range(10_000):
        key = f"wf:{seed}:task:{index:06d}" + (f"-{attempt}" if attempt else "")
        if wanted is None or behaviour_of(seed, key, late).kind == wanted:
            return key
    raise AssertionError(f"no key with behaviour {wanted}")  # 10 000 misses: not in practice


def _copies(
    rng: random.Random,
    event: PlannedEvent,
    count: int,
    first: float,
    duration: float,
    body: Callable[[], dict[str, Any]],
) -> list[Delivery]:
    """`count` more deliveries of `event`, first delivered at `first`: each soon (0-8 s
    later), at the same instant, or late (in the last 7 % of the run)."""
    copies = []
    for _ in range(count):
        kind = rng.choices((SOON, CONCURRENT, LATE), weights=(50, 25, 25))[0]
        at = {
            SOON: first + rng.uniform(0.05, 8.0),
            CONCURRENT: first,
            LATE: rng.uniform(0.93, 1.0) * duration,
        }[kind]
        copies.append(Delivery(event, kind, at, body()))
    return copies


def plan_events(
    seed: int, count: int, duration: float, claims_share: float = CLAIMS_SHARE, late: bool = True
) -> tuple[list[PlannedEvent], list[Delivery]]:
    """`count` events, their first deliveries spread over the first 85 % of `duration`, each
    delivered 1 to 4 times (some copies concurrent, some soon, some at the very end), and 4 %
    of them followed by a conflicting payload under the same key. A `claims_share` of them
    is handled by a workflow through /v1/claims instead of /v1/events, and a share of the
    other lead events goes to the fan-out route instead (`plan_fan_out`). On top of them, about
    ORDERED_SHARE as many updates of contacts on the ordered route (`plan_ordered`), numbered
    last. Without `late`, no write is applied late (`behaviour_of`)."""
    coverage = [kind for kind in CLAIMS_COVERAGE if late or kind != APPLIED_LATE]
    rng = random.Random(f"events:{seed}")
    ordered_rng = random.Random(f"ordered:{seed}")
    contacts = [
        ordered_rng.randint(*ORDERED_VERSIONS)
        for _ in range(max(1, round(count * ORDERED_SHARE / sum(ORDERED_VERSIONS) * 2)))
    ]
    window = 0.85 * duration
    events: list[PlannedEvent] = []
    deliveries: list[Delivery] = []
    claims_seen = 0
    fan_out_rng = random.Random(f"fan-out:{seed}")
    fanned_out = 0
    for index in range(count):
        event_type = EVENT_TYPES[index % len(EVENT_TYPES)]
        external_id = f"ext-{seed}-{index:06d}"
        payload = {
            "email": f"customer{index}@example.com",
            "name": f"Customer {index}",
            "amount": rng.randint(1, 10_000),
            "sequence": index,
        }
        event = PlannedEvent(index, event_type, external_id, payload, "", Behaviour(OK))
        if rng.random() < claims_share:
            wanted = coverage[claims_seen] if claims_seen < len(coverage) else None
            event.via = VIA_CLAIMS
            event.key = claim_key(seed, index, wanted, late)
            event.lease_seconds = rng.randint(*CLAIM_LEASE_SECONDS)
            event.abandon = wanted == OK or rng.random() < ABANDON_SHARE
            claims_seen += 1
        else:
            if event_type == fan_out.REPLACES and fan_out_rng.random() < fan_out.SHARE_OF_LEADS:
                plan_fan_out(seed, event, refusing=not fanned_out, late=late)
                fanned_out += 1
            event.key = event.key or derived_key(event.body())
        event.behaviour = behaviour_of(seed, event.key, late)
        events.append(event)
        body = event.claim_body if event.via == VIA_CLAIMS else event.body
        first = window * index / count + rng.uniform(0, window / count)
        deliveries.append(Delivery(event, FIRST, first, body()))
        copies = rng.choices((1, 2, 3, 4), weights=(40, 30, 20, 10))[0]
        deliveries.extend(_copies(rng, event, copies - 1, first, duration, body))
        if event.abandon:
            # The provider's redelivery after the crashed run, past the longest lease (the
            # workflow also redelivers a crashed run itself, whenever it crashes).
            at = first + CLAIM_LEASE_SECONDS[1] + rng.uniform(1.0, 5.0)
            deliveries.append(Delivery(event, AFTER_LEASE, at, body()))
        if rng.random() < 0.04:
            changed = {**payload, "name": f"Someone Else {index}", "amount": payload["amount"] + 1}
            at = first + rng.uniform(0.5, 15.0) if rng.random() < 0.7 else duration
            deliveries.append(Delivery(event, CONFLICT, min(at, duration), body(changed)))
    plan_ordered(seed, contacts, duration, events, deliveries, ordered_rng, late)
    deliveries.sort(key=lambda d: d.at)
    return events, deliveries


def delivery_behaviours(seed: int, event_key: str, late: bool = True) -> dict[str, Behaviour]:
    """Destination -> the behaviour the event's delivery there meets (its own key's)."""
    return {
        name: behaviour_at(seed, key, fan_out.DESTINATIONS[name], late)
        for name, key in fan_out.delivery_keys(event_key).items()
    }


def plan_fan_out(seed: int, event: PlannedEvent, refusing: bool, late: bool = True) -> None:
    """Make `event` one of the fan-out route's, with its key and its deliveries' behaviours.
    With `refusing` (the first fan-out event), its external id is the first candidate whose
    deliveries meet exactly one refusal (422): even the CI-sized run has an event that ends
    `partially_failed`."""
    base = event.external_id
    event.event_type = fan_out.EVENT_TYPE
    for attempt in range(10_000):
        event.external_id = base + (f"-{attempt}" if attempt else "")
        event.key = derived_key(event.body())
        event.destinations = delivery_behaviours(seed, event.key, late)
        kinds = [b.kind for b in event.destinations.values()]
        if not refusing or kinds.count(INVALID) == 1:
            return
    raise AssertionError("no external id with one refused delivery")  # not in practice


def plan_ordered(
    seed: int,
    contacts: list[int],
    duration: float,
    events: list[PlannedEvent],
    deliveries: list[Delivery],
    rng: random.Random,
    late: bool = True,
) -> None:
    """Updates of `len(contacts)` contacts (contact i gets versions 1 .. contacts[i]), appended
    to `events` and `deliveries`. A contact's first deliveries fall within
    ORDERED_SPREAD_SECONDS, in an order of their own (shuffled), a share of them at one
    instant, between 5 % and 80 % of `duration`; each is delivered one to three times (the
    copies soon, concurrent or late, as for the other events)."""
    for number, versions in enumerate(contacts):
        contact = f"contact-{seed}-{number:04d}"
        start = rng.uniform(0.05, 0.8) * duration
        instant = start + rng.uniform(0, ORDERED_SPREAD_SECONDS)
        for version in range(1, versions + 1):
            index = len(events)
            payload = {
                "contact": {"id": contact, "version": version},
                "email": f"{contact}@example.com",
                "name": f"Contact {number} v{version}",
            }
            event = PlannedEvent(
                index,
                ORDERED_EVENT_TYPE,
                contact,
                payload,
                "",
                Behaviour(OK),
                contact=contact,
                version=version,
            )
            event.key = derived_key(event.body())
            event.behaviour = behaviour_at(seed, event.key, ORDERED_COLLECTION, late)
            events.append(event)
            same = rng.random() < ORDERED_SAME_INSTANT
            first = instant if same else start + rng.uniform(0, ORDERED_SPREAD_SECONDS)
            deliveries.append(Delivery(event, FIRST, first, event.body()))
            copies = rng.choices((1, 2, 3), weights=(40, 40, 20))[0]
            deliveries.extend(_copies(rng, event, copies - 1, first, duration, event.body))


def plan_faults(seed: int, duration: float) -> list[Fault]:
    """Kills and restarts spread over 10-85 % of the send phase, a few of each kind; the
    PostgreSQL restart happens once, near the middle; one route's downstream is down once, and
    another's refuses a share of its writes for a while."""
    rng = random.Random(f"faults:{seed}")
    counts = {
        "kill_worker": max(2, round(duration / 60)),
        "kill_relay": max(1, round(duration / 100)),
        "restart_broker": max(1, round(duration / 150)),
    }
    outage = plan_route_outage(seed, duration)
    flaky = plan_partial_failure(seed, duration)
    faults = [
        Fault(rng.uniform(0.45, 0.55) * duration, "restart_postgres"),
        Fault(outage.start, "route_down"),
        Fault(outage.end, "route_up"),
        Fault(flaky.start, "route_flaky"),
        Fault(flaky.end, "route_steady"),
    ]
    for kind, n in counts.items():
        slot = 0.75 * duration / n
        for i in range(n):
            faults.append(Fault(0.1 * duration + slot * (i + rng.uniform(0.1, 0.9)), kind))
    faults.sort(key=lambda f: f.at)
    return faults
