"""Ordering lanes on real processes, counted at a fake downstream that records the order in
which each object's updates were applied: versions sent shuffled and concurrently with retries
injected, a dead letter that blocks its lane until replayed, `skip`, a worker SIGKILLed
mid-lane, and the intake's refusals.
"""

from __future__ import annotations

import itertools
import json
import random
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

from outbox.ingest.provider_signatures import sign_shopify, sign_stripe
from tests.support import (
    AUTH,
    PROVIDER_SECRETS,
    Downstream,
    Reply,
    Stack,
    query,
    replay,
    wait_until,
)

SETTLED = ("succeeded", "superseded", "failed_final")


def _common(url: str) -> str:
    """What every route of these tests shares: the downstream, short timeouts and backoff."""
    return f"""action = "http"
url = "{url}/tasks"
external_ref_pointer = "/id"
reconcile_url = "{url}/tasks/by-key/{{key}}"
connect_timeout_seconds = 1
read_timeout_seconds = 2
backoff_base_seconds = 0.1
backoff_cap_seconds = 0.5
"""


def _routes(path: Path, url: str) -> Path:
    common = _common(url)
    path.write_text(
        f"""
[[routes]]
match = "contact.*"
name = "contacts"
order_by = "/contact/id"
versions = "supersede"
{common}
[[routes]]
match = "stamped.*"
name = "stamped"
order_by = "/contact/id"
versions = "supersede"
version_format = "timestamp"
{common}
[[routes]]
match = "ledger.*"
name = "ledger"
order_by = "external_id"
{common}
[[routes]]
match = "feed.*"
name = "feed"
order_by = "/account"
lane_on_failure = "skip"
{common}
[[routes]]
match = "profile.*"
name = "profiles"
order_by = "/contact/id"
versions = "supersede"
lane_on_failure = "skip"
{common}
[[routes]]
match = "invoice.*"
name = "invoices"
order_by = "/data/object/customer"
versions = "supersede"
{common}
[[routes]]
match = "customers/update"
name = "shop-customers"
order_by = "/id"
versions = "supersede"
version_format = "timestamp"
{common}
[[sources]]
name = "stripe"
scheme = "stripe"
secret = "{PROVIDER_SECRETS["stripe"][1]}"
version = "/created"

[[sources]]
name = "shopify"
scheme = "shopify"
secret = "{PROVIDER_SECRETS["shopify"][1]}"
version = "/updated_at"
""",
        encoding="utf-8",
    )
    return path


class Recorder:
    """What the downstream applied, per object, in the order it applied it, and the spans of
    every request (from its arrival until its answer), per object. Each request's object and
    version are read from its body (the event's payload), as a real downstream would."""

    def __init__(self, downstream: Downstream, delay: float = 0.1) -> None:
        self.downstream = downstream
        self.lock = threading.Lock()
        self.delay = delay
        self.object_of: dict[str, str] = {}
        self.version_of: dict[str, Any] = {}
        self.applied: dict[str, list[Any]] = defaultdict(list)
        self.spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        # Versions refused for good (422), and versions whose first request gets a 503.
        self.refuse: set[Any] = set()
        self.fail_first: set[Any] = set()
        downstream.behaviour = self.reply

    def sent(self, key: str, obj: str, version: Any) -> None:
        with self.lock:
            self.object_of[key] = obj
            self.version_of[key] = version

    def reply(self, key: str, number: int) -> Reply:
        now = time.monotonic()
        with self.downstream.lock:
            body = next(r["body"] for r in reversed(self.downstream.requests) if r["key"] == key)
        obj, version = body["contact"]["id"], body["v"]
        with self.lock:
            self.spans[obj].append((now, now + self.delay))
            if version in self.refuse:
                return Reply(422, delay=self.delay)
            if version in self.fail_first and number == 1:
                return Reply(503, delay=self.delay)
            self.applied[obj].append(version)
        return Reply(201, delay=self.delay)

    def overlaps(self, obj: str) -> int:
        """Requests of `obj` that began before the one before them was answered."""
        spans = sorted(self.spans[obj])
        return sum(1 for (_, end), (start, _) in itertools.pairwise(spans) if start < end)


def _send(stack: Stack, event_type: str, obj: str, version: Any, **payload: Any) -> httpx.Response:
    body = {
        "source": "crm",
        "event_type": event_type,
        "external_id": obj,
        "payload": {"contact": {"id": obj}, "account": obj, "v": version, **payload},
    }
    if version is not None:
        body["version"] = version
    with stack.client() as client:
        return client.post("/v1/events", json=body)


def _accepted(stack: Stack, recorder: Recorder, event_type: str, obj: str, version: Any) -> str:
    answer = _send(stack, event_type, obj, version)
    assert answer.status_code in (200, 202), answer.text
    key: str = answer.json()["key"]
    recorder.sent(key, obj, version)
    return key


def _states(stack: Stack, keys: list[str]) -> dict[str, tuple[str, str | None]]:
    rows = query(
        stack.database_url,
        "SELECT idempotency_key, status, superseded_by FROM idempotency_keys"
        " WHERE idempotency_key = ANY(%s)",
        (keys,),
    )
    return {key: (status, by) for key, status, by in rows}


def _settled(stack: Stack, keys: list[str]) -> bool:
    states = _states(stack, keys)
    return len(states) == len(keys) and all(s in SETTLED for s, _ in states.values())


def _started(stack: Stack, concurrency: int = 4, *, sweeper: bool = False) -> Stack:
    """The pipeline without a sweeper unless asked: a lane must be handed on by the changes
    that free it, never by the sweeper's backstop after its grace period (which would hide a
    lost hand-on behind a delay)."""
    stack.start_receiver()
    stack.start_relay()
    stack.start_worker(concurrency=concurrency)
    if sweeper:
        stack.start_sweeper()
    return stack


def test_shuffled_concurrent_versions_apply_in_increasing_order_one_at_a_time(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """20 versions of each of two contacts, shuffled and posted concurrently in two rounds,
    each version's first request refused with a 503: each contact's applied versions increase
    strictly and end at the highest; every event is succeeded or superseded (with the version
    that superseded it), none applied twice; one contact's requests never overlap while the
    two contacts' do."""
    stack, routes = protected
    _routes(routes, downstream.url)
    _started(stack)
    recorder = Recorder(downstream)
    # Every version's first request is refused with a 503: each applied one was retried.
    recorder.fail_first.update(range(1, 21))
    # Two rounds, each shuffled and posted concurrently: v1-v12 without v4 and v9, then
    # v13-v20 with v4 and v9 arriving late. Each round's newest is applied (nothing newer
    # waits), the late old ones are superseded by what was applied already.
    rng = random.Random(26)
    rounds = [
        [v for v in range(1, 13) if v not in (4, 9)],
        [*range(13, 21), 4, 9],
    ]
    keys: list[str] = []
    lock = threading.Lock()

    def post(item: tuple[str, int]) -> None:
        obj, version = item
        answer = _send(stack, "contact.updated", obj, version)
        assert answer.status_code in (200, 202), answer.text
        key = answer.json()["key"]
        recorder.sent(key, obj, version)
        with lock:
            keys.append(key)

    for versions in rounds:
        work = [(obj, v) for obj in ("c1", "c2") for v in versions]
        rng.shuffle(work)
        threads = [threading.Thread(target=post, args=(item,)) for item in work]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wait_until(lambda: _settled(stack, keys), timeout=90, interval=0.3)
    assert len(keys) == 40

    states = _states(stack, keys)
    for obj in ("c1", "c2"):
        applied = recorder.applied[obj]
        assert applied == sorted(set(applied)), (obj, applied)
        assert applied[-1] == 20, (obj, applied)
        assert recorder.overlaps(obj) == 0, obj
        assert applied[0] <= 12 and 12 in applied, (obj, applied)
    assert {status for status, _ in states.values()} <= {"succeeded", "superseded"}
    for key, (status, by) in states.items():
        effects = downstream.effects[key]
        assert effects == (1 if status == "succeeded" else 0), (key, status, effects)
        if status == "succeeded":  # refused once, then applied: the retry kept the order
            assert len(downstream.request_times(key)) == 2, key
        if recorder.version_of[key] in (4, 9):  # arrived after v12 was applied
            assert status == "superseded", key
        if status == "superseded":
            assert by is not None and int(by) > recorder.version_of[key], (key, by)
    assert sum(downstream.effects.values()) == sum(len(a) for a in recorder.applied.values())
    assert downstream.peak_in_flight >= 2  # the two contacts ran side by side
    # A superseded event's repeat is answered as such, with the version that superseded it.
    superseded = next(k for k, (s, _) in states.items() if s == "superseded")
    again = _send(
        stack, "contact.updated", recorder.object_of[superseded], recorder.version_of[superseded]
    )
    assert again.json()["status"] == "superseded", again.text
    # The lanes are free: no key parked, one row per lane remembering its applied version.
    assert query(
        stack.database_url,
        "SELECT lane, applied_version FROM lanes WHERE route = 'contacts' ORDER BY lane",
    ) == [("crm:c1", "20"), ("crm:c2", "20")]


def test_an_older_version_after_a_newer_one_is_superseded_without_a_call(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """Timestamps compare as instants (`Z` and an offset): an update stamped earlier than the
    applied one, sent later, is superseded and never reaches the downstream; a replay of a
    superseded-era dead letter cannot apply an old version either."""
    stack, routes = protected
    _routes(routes, downstream.url)
    _started(stack)
    recorder = Recorder(downstream, delay=0.0)
    newer = _accepted(stack, recorder, "stamped.updated", "s1", "2026-12-01T10:00:00Z")
    wait_until(lambda: _settled(stack, [newer]), timeout=30)
    older = _accepted(stack, recorder, "stamped.updated", "s1", "2026-12-01T10:30:00+01:00")
    wait_until(lambda: _settled(stack, [older]), timeout=30)
    assert _states(stack, [older])[older] == ("superseded", "2026-12-01T10:00:00Z")
    assert downstream.effects == {newer: 1}
    assert recorder.applied["s1"] == ["2026-12-01T10:00:00Z"]


def test_an_uncertain_older_version_holds_its_lane_until_it_is_certain(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """v1 reaches the downstream but its answer is lost (past the read timeout): v1 is
    uncertain and waits to retry. v2, arriving meanwhile, waits behind it instead of going
    first (a write of v1 still in flight could land over it); v1's retry reconciles (found)
    and ends succeeded, then v2 is applied. Without the hold, v2 went first and v1, although
    applied, ended superseded."""
    stack, routes = protected
    _routes(routes, downstream.url)
    _started(stack)
    recorder = Recorder(downstream, delay=0.0)
    plain = recorder.reply
    lost: list[str] = []

    def answer_lost_once(key: str, number: int) -> Reply:
        reply = plain(key, number)
        if not lost:  # the very first request, v1's: committed, its answer lost
            lost.append(key)
            return Reply(201, delay=3)  # the route's read timeout is 2 s
        return reply

    downstream.behaviour = answer_lost_once
    first = _send(stack, "contact.updated", "u1", 1).json()["key"]
    wait_until(lambda: downstream.effects[first] == 1, timeout=30)
    second = _accepted(stack, recorder, "contact.updated", "u1", 2)
    wait_until(lambda: _settled(stack, [first, second]), timeout=60, interval=0.2)
    assert _states(stack, [first, second]) == {
        first: ("succeeded", None),
        second: ("succeeded", None),
    }
    assert recorder.applied["u1"] == [1, 2]
    assert downstream.effects == {first: 1, second: 1}
    assert first in downstream.lookups  # reconciled, found, not sent again


def test_a_dead_letter_blocks_its_lane_until_replayed(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """In acceptance order (`block`): the third update is refused for good and dead-lettered;
    the three after it wait parked (no request, no attempt spent) while another object's lane
    goes on; replaying the head, once fixed, applies it and then the rest, in order."""
    stack, routes = protected
    _routes(routes, downstream.url)
    _started(stack)
    recorder = Recorder(downstream, delay=0.0)
    recorder.refuse.add(3)
    keys = [_accepted(stack, recorder, "ledger.entry", "acct-1", n) for n in range(1, 7)]
    wait_until(lambda: _states(stack, [keys[2]])[keys[2]][0] == "failed_final", timeout=30)
    other = _accepted(stack, recorder, "ledger.entry", "acct-2", 1)
    wait_until(lambda: _settled(stack, [other]), timeout=30)
    time.sleep(2)  # nothing wakes a blocked lane
    rows = query(
        stack.database_url,
        "SELECT status, error_code, attempts FROM idempotency_keys"
        " WHERE idempotency_key = ANY(%s) ORDER BY lane_rank",
        (keys[3:],),
    )
    assert rows == [("pending", "lane_waiting", 0)] * 3
    assert recorder.applied["acct-1"] == [1, 2]
    assert recorder.applied["acct-2"] == [1]
    assert {downstream.effects[k] for k in keys[3:]} == {0}

    recorder.refuse.clear()
    replay(stack, [keys[2]])
    wait_until(lambda: _settled(stack, keys) and downstream.effects[keys[5]] == 1, timeout=30)
    assert recorder.applied["acct-1"] == [1, 2, 3, 4, 5, 6]
    assert [downstream.effects[k] for k in keys] == [1] * 6
    assert recorder.overlaps("acct-1") == 0


def test_discarding_a_blocking_dead_letter_lets_the_lane_go_on(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """Discarding the head's dead letter releases the lane (the head stays unapplied)."""
    stack, routes = protected
    _routes(routes, downstream.url)
    _started(stack)
    recorder = Recorder(downstream, delay=0.0)
    recorder.refuse.add(1)
    keys = [_accepted(stack, recorder, "ledger.entry", "acct-9", n) for n in range(1, 4)]
    wait_until(lambda: _states(stack, [keys[0]])[keys[0]][0] == "failed_final", timeout=30)
    (dead_id,) = query(
        stack.database_url, "SELECT id FROM dead_letters WHERE idempotency_key = %s", (keys[0],)
    )[0]
    with stack.client() as client:
        discarded = client.post(
            f"/v1/dead-letters/{dead_id}/discard",
            json={"reason": "entered by hand"},
            headers={**AUTH, "X-Operator": "ops-ada"},
        )
    assert discarded.status_code == 200, discarded.text
    wait_until(lambda: downstream.effects[keys[2]] == 1, timeout=30)
    assert recorder.applied["acct-9"] == [2, 3]


def test_skip_goes_on_past_a_dead_letter(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """`lane_on_failure = "skip"`: the refused update is dead-lettered and the lane goes on."""
    stack, routes = protected
    _routes(routes, downstream.url)
    _started(stack)
    recorder = Recorder(downstream, delay=0.0)
    recorder.refuse.add(2)
    keys = [_accepted(stack, recorder, "feed.item", "f-1", n) for n in range(1, 5)]
    wait_until(lambda: _settled(stack, keys), timeout=30)
    assert recorder.applied["f-1"] == [1, 3, 4]
    assert [s for s, _ in _states(stack, keys).values()].count("failed_final") == 1


def test_a_worker_killed_mid_lane_loses_nothing_and_reorders_nothing(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """The worker is SIGKILLed while the fourth update of a lane is applied and its answer
    held: after the lease runs out a new worker reconciles it (found, not sent again) and the
    lane goes on; every update applied once, in acceptance order."""
    stack, routes = protected
    _routes(routes, downstream.url)
    _started(stack, concurrency=2, sweeper=True)  # it re-drives the killed worker's key
    recorder = Recorder(downstream, delay=0.0)
    hold = threading.Event()
    plain = recorder.reply

    def holding(key: str, number: int) -> Reply:
        reply = plain(key, number)
        if reply.status == 201 and recorder.applied["acct-k"][-1:] == [4] and number == 1:
            return Reply(201, hold=hold)
        return reply

    downstream.behaviour = holding
    keys = [_accepted(stack, recorder, "ledger.entry", "acct-k", n) for n in range(1, 9)]
    wait_until(lambda: downstream.effects[keys[3]] == 1, timeout=30)
    stack.stop("worker", signal.SIGKILL)
    hold.set()
    stack.start_worker(concurrency=2)
    wait_until(lambda: _settled(stack, keys), timeout=60, interval=0.3)
    assert recorder.applied["acct-k"] == list(range(1, 9))
    assert [downstream.effects[k] for k in keys] == [1] * 8
    assert [s for s, _ in _states(stack, keys).values()] == ["succeeded"] * 8


def test_a_replayed_old_version_is_superseded_not_applied(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """Under supersede with `skip`: v1 is refused and dead-lettered, v2 applied; replaying v1
    after the cause is fixed records it superseded (by 2) and sends nothing."""
    stack, routes = protected
    _routes(routes, downstream.url)
    _started(stack)
    recorder = Recorder(downstream, delay=0.0)
    recorder.refuse.add(1)
    first = _accepted(stack, recorder, "profile.updated", "p1", 1)
    wait_until(lambda: _settled(stack, [first]), timeout=30)
    second = _accepted(stack, recorder, "profile.updated", "p1", 2)
    wait_until(lambda: _settled(stack, [second]), timeout=30)
    recorder.refuse.clear()
    requests = len(downstream.requests)
    replay(stack, [first])
    wait_until(lambda: _states(stack, [first])[first][0] == "superseded", timeout=30)
    assert _states(stack, [first])[first] == ("superseded", "2")
    assert len(downstream.requests) == requests
    assert recorder.applied["p1"] == [2]


def test_a_paused_route_keeps_its_lanes_in_order_through_resume(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """Events of an ordered route arrive while it is paused: each lane's head waits for the
    route (`route_paused`), the rest for their lane (`lane_waiting`), none spends an attempt;
    on resume each object's updates apply one at a time in acceptance order."""
    stack, routes = protected
    _routes(routes, downstream.url)
    _started(stack)
    recorder = Recorder(downstream, delay=0.05)
    headers = {**AUTH, "X-Operator": "ops-ada"}
    with stack.client() as client:
        assert (
            client.post(
                "/v1/routes/ledger/pause", json={"reason": "CRM upgrade"}, headers=headers
            ).status_code
            == 200
        )
    keys = [_accepted(stack, recorder, "ledger.entry", f"acct-p{n % 2}", n) for n in range(1, 13)]
    wait_until(
        lambda: (
            query(
                stack.database_url,
                "SELECT error_code, count(*), sum(attempts) FROM idempotency_keys"
                " WHERE route = 'ledger' AND status = 'pending' GROUP BY 1 ORDER BY 1",
            )
            == [("lane_waiting", 10, 0), ("route_paused", 2, 0)]
        ),
        timeout=30,
    )
    assert downstream.requests == []
    with stack.client() as client:
        assert client.post("/v1/routes/ledger/resume", headers=headers).status_code == 200
    wait_until(lambda: _settled(stack, keys), timeout=60, interval=0.3)
    assert recorder.applied["acct-p1"] == [1, 3, 5, 7, 9, 11]
    assert recorder.applied["acct-p0"] == [2, 4, 6, 8, 10, 12]
    assert recorder.overlaps("acct-p0") == recorder.overlaps("acct-p1") == 0
    assert [downstream.effects[k] for k in keys] == [1] * 12


def _provider(stack: Stack, source: str, body: dict[str, Any], headers: dict[str, str]) -> str:
    raw = json.dumps(body).encode()
    stamp = int(time.time())
    if source == "stripe":
        headers = {"Stripe-Signature": sign_stripe(PROVIDER_SECRETS["stripe"][1], stamp, raw)}
    else:
        headers = {
            **headers,
            "X-Shopify-Hmac-Sha256": sign_shopify(PROVIDER_SECRETS["shopify"][1], raw),
        }
    with httpx.Client(base_url=stack.url, timeout=15) as client:
        answer = client.post(
            f"/v1/webhooks/{source}",
            content=raw,
            headers={**headers, "content-type": "application/json"},
        )
    assert answer.status_code in (200, 202), answer.text
    key: str = answer.json()["key"]
    return key


def test_provider_webhooks_order_by_their_own_fields(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """The lane pointer reads the provider's payload and the version is the provider's own:
    Stripe's `created` (an integer) and Shopify's `updated_at` (a timestamp). A newer update
    applied first makes the older one, delivered later, superseded."""
    stack, routes = protected
    _routes(routes, downstream.url)
    _started(stack)
    seen: list[tuple[str, Any]] = []

    def record(key: str, number: int) -> Reply:
        with downstream.lock:
            body = next(r["body"] for r in reversed(downstream.requests) if r["key"] == key)
        seen.append((body.get("type", "shopify"), body.get("created", body.get("updated_at"))))
        return Reply(201)

    downstream.behaviour = record

    def invoice(event_id: str, created: int) -> dict[str, Any]:
        return {
            "id": event_id,
            "type": "invoice.paid",
            "created": created,
            "data": {"object": {"customer": "cus_1"}},
        }

    newer = _provider(stack, "stripe", invoice("evt_2", 1_765_000_200), {})
    wait_until(lambda: _settled(stack, [newer]), timeout=30)
    older = _provider(stack, "stripe", invoice("evt_1", 1_765_000_100), {})
    wait_until(lambda: _settled(stack, [older]), timeout=30)
    assert _states(stack, [older])[older] == ("superseded", "1765000200")

    def customer(webhook_id: str, updated_at: str) -> tuple[dict[str, Any], dict[str, str]]:
        body = {"id": 42, "updated_at": updated_at, "email": "ada@example.com"}
        return body, {"X-Shopify-Webhook-Id": webhook_id, "X-Shopify-Topic": "customers/update"}

    late = _provider(stack, "shopify", *customer("w-2", "2026-12-01T11:00:00+01:00"))
    wait_until(lambda: _settled(stack, [late]), timeout=30)
    early = _provider(stack, "shopify", *customer("w-1", "2026-12-01T09:59:59Z"))
    wait_until(lambda: _settled(stack, [early]), timeout=30)
    assert _states(stack, [early])[early] == ("superseded", "2026-12-01T11:00:00+01:00")
    assert downstream.effects == {newer: 1, late: 1}
    assert seen == [("invoice.paid", 1_765_000_200), ("shopify", "2026-12-01T11:00:00+01:00")]


# Events an ordered route cannot place: (event type, version, payload, the 422's error code).
UNPLACEABLE: list[tuple[str, Any, dict[str, Any], str]] = [
    ("contact.updated", 3, {"contact": {"name": "no id"}}, "lane_missing"),
    ("contact.updated", 3, {"contact": {"id": {"nested": 1}}}, "lane_missing"),
    ("contact.updated", 3, {"contact": {"id": "c9\u202e"}}, "lane_invalid"),
    ("contact.updated", 3, {"contact": {"id": "c9\x1b[2J"}}, "lane_invalid"),
    ("contact.updated", None, {"contact": {"id": "c9"}}, "version_required"),
    ("contact.updated", "v3", {"contact": {"id": "c9"}}, "version_invalid"),
    ("stamped.updated", "2026-12-01 10:00", {"contact": {"id": "c9"}}, "version_invalid"),
    ("stamped.updated", "2026-12-01", {"contact": {"id": "c9"}}, "version_invalid"),
    # A timestamp further ahead of the receiver's clock than the route's bound (an hour).
    ("stamped.updated", "2999-01-01T00:00:00Z", {"contact": {"id": "c9"}}, "version_ahead"),
]


def test_an_event_an_ordered_route_cannot_place_is_refused_with_nothing_stored(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """Each event of `UNPLACEABLE` is answered 422 with its code, and none is stored (one
    receiver answers them all)."""
    stack, routes = protected
    _routes(routes, downstream.url)
    stack.start_receiver()
    answers = []
    with stack.client() as client:
        # An id of its own each, as if alone: no answer can be another's duplicate.
        for index, (event_type, version, payload, _) in enumerate(UNPLACEABLE):
            body: dict[str, Any] = {
                "source": "crm",
                "event_type": event_type,
                "external_id": f"x-{index}",
                "payload": payload,
            }
            if version is not None:
                body["version"] = version
            answer = client.post("/v1/events", json=body)
            answers.append((event_type, version, answer.status_code, answer.json().get("error")))
    assert answers == [(t, v, 422, code) for t, v, _, code in UNPLACEABLE]
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]
