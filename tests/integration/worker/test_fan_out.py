"""Fan-out on real processes, counted at fake downstreams (one path per destination): an event
delivered to three destinations of which one refuses for good, its replay, duplicates sent
concurrently, a destination down while the others deliver, a paused destination, a provider's
webhook, and a destination added later (a backfill, dry run first).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from typing import Any

import httpx
import pytest

from outbox.core.keys import delivery_key, mask_key
from outbox.core.settings import Settings
from outbox.core.wire import PROCESS_TASK
from outbox.ingest.provider_signatures import sign_stripe
from outbox.relay.publisher import OutboxMessage, create_publisher, publish
from tests.support import (
    AUTH,
    PROVIDER_SECRETS,
    Downstream,
    Reply,
    Stack,
    key_state,
    query,
    run_idem,
    wait_until,
)

DESTINATIONS = ("books", "finance-flow", "notify")


def _send(stack: Stack, external_id: str, **payload: Any) -> httpx.Response:
    body = {
        "source": "billing-app",
        "event_type": "billing.invoice_paid",
        "external_id": external_id,
        "payload": {"invoice": external_id, **payload},
    }
    with stack.client() as client:
        return client.post("/v1/events", json=body)


def _effects(downstream: Downstream, event_key: str) -> dict[str, int]:
    """Effects per destination for one event (each delivery's own Idempotency-Key)."""
    with downstream.lock:
        return {
            name: downstream.effects[delivery_key(event_key, name)]
            for name in (*DESTINATIONS, "archive")
        }


def _state(stack: Stack, key: str) -> dict[str, Any]:
    return key_state(stack, key)


def _settled(stack: Stack, key: str, status: str, timeout: float = 60) -> dict[str, Any]:
    """Wait until the event's status is `status`; fail with its deliveries' states."""
    deadline = time.monotonic() + timeout
    state = _state(stack, key)
    while state["status"] != status:
        assert time.monotonic() < deadline, state
        time.sleep(0.1)
        state = _state(stack, key)
    return state


def _paths(downstream: Downstream, key: str) -> set[str]:
    with downstream.lock:
        return {r["path"] for r in downstream.requests if r["key"] == key}


def test_one_refusing_destination_dead_letters_alone_and_its_replay_sends_only_it(
    stack: Stack, downstream: Downstream
) -> None:
    """Three destinations, `notify` refuses for good: two effects, one dead letter (notify's
    delivery only), the event `partially_failed` with each delivery's result; after the fix,
    a replay of notify's dead letters makes one more effect there and none elsewhere."""
    refusing = threading.Event()
    refusing.set()

    def behaviour(key: str, number: int) -> Reply:
        if key.endswith(" @notify") and refusing.is_set():
            return Reply(422, extra={"error": "channel archived"})
        return Reply(201)

    downstream.behaviour = behaviour
    accepted = _send(stack, "inv-1", amount=120)
    assert accepted.status_code == 202, accepted.text
    event_key = accepted.json()["key"]
    assert [d["destination"] for d in accepted.json()["deliveries"]] == list(DESTINATIONS)

    state = _settled(stack, event_key, "partially_failed")
    by_name = {d["destination"]: d for d in state["deliveries"]}
    assert {n: d["status"] for n, d in by_name.items()} == {
        "books": "succeeded",
        "finance-flow": "succeeded",
        "notify": "failed_final",
    }
    assert by_name["books"]["external_ref"] and by_name["notify"]["error_code"] == "http_422"
    assert _effects(downstream, event_key) == {
        "books": 1,
        "finance-flow": 1,
        "notify": 0,
        "archive": 0,
    }
    # Each destination got its own requests at its own URL, with its own key.
    assert _paths(downstream, delivery_key(event_key, "books")) == {"/books/tasks"}
    assert _paths(downstream, delivery_key(event_key, "notify")) == {"/notify/tasks"}
    dead = query(
        stack.database_url,
        "SELECT k.idempotency_key, k.destination FROM dead_letters d"
        " JOIN idempotency_keys k USING (idempotency_key) WHERE d.resolution = 'open'",
    )
    assert dead == [(delivery_key(event_key, "notify"), "notify")]

    # A duplicate is answered with every destination's result.
    repeat = _send(stack, "inv-1", amount=120)
    assert repeat.status_code == 200 and repeat.headers["idempotent-replayed"] == "true"
    assert repeat.json()["status"] == "partially_failed"
    assert {d["destination"]: d["status"] for d in repeat.json()["deliveries"]} == {
        n: d["status"] for n, d in by_name.items()
    }

    refusing.clear()
    with stack.client() as client:
        dry = client.post(
            "/v1/replays",
            json={"destination": "notify", "statuses": ["failed_final"]},
            headers=AUTH,
        ).json()
        assert dry["to_replay"] == 1, dry
        assert dry["keys"] == [mask_key(delivery_key(event_key, "notify"))], dry
        done = client.post(
            "/v1/replays",
            json={
                "destination": "notify",
                "statuses": ["failed_final"],
                "dry_run": False,
                "confirm": dry["confirm"],
            },
            headers=AUTH,
        )
        assert done.status_code == 200, done.text
    _settled(stack, event_key, "succeeded")
    assert _effects(downstream, event_key) == {
        "books": 1,
        "finance-flow": 1,
        "notify": 1,
        "archive": 0,
    }


def test_concurrent_duplicates_of_twenty_events_make_one_effect_per_destination(
    stack: Stack, downstream: Downstream
) -> None:
    """100 posts, five of each of 20 events, sent concurrently: 20 events, 60 deliveries, one
    effect per (event, destination) and no other request-bearing key."""
    posts = [f"inv-{n % 20}" for n in range(100)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(lambda ext: _send(stack, ext, amount=5), posts))
    assert all(a.status_code in (200, 202) for a in answers), {a.status_code for a in answers}
    event_keys = {a.json()["key"] for a in answers}
    assert len(event_keys) == 20
    assert sum(1 for a in answers if not a.json()["duplicate"]) == 20
    for key in event_keys:
        _settled(stack, key, "succeeded")
    with downstream.lock:
        effects = dict(downstream.effects)
    assert effects == {delivery_key(k, n): 1 for k in event_keys for n in DESTINATIONS}
    counts = query(
        stack.database_url,
        "SELECT status, count(*) FROM idempotency_keys GROUP BY status ORDER BY status",
    )
    assert counts == [("fanned_out", 20), ("succeeded", 60)]


@pytest.mark.parametrize(
    "down_seconds", [pytest.param(5, id="5s"), pytest.param(20, id="20s", marks=pytest.mark.slow)]
)
def test_a_destination_down_delays_no_other(
    stack: Stack, downstream: Downstream, down_seconds: float
) -> None:
    """`notify` answers 503 to everything for `down_seconds` while 10 events arrive: books and
    finance-flow deliver every one while notify is still down (no delivery waits for another);
    once it is back, notify's deliveries succeed (its budget outlasts the outage: retries,
    then its circuit's waits, which spend none), one effect each."""
    started = time.monotonic()
    down = threading.Event()
    down.set()

    def behaviour(key: str, number: int) -> Reply:
        if key.endswith(" @notify") and down.is_set():
            return Reply(503)
        return Reply(201)

    downstream.behaviour = behaviour
    keys = [_send(stack, f"down-{n}").json()["key"] for n in range(10)]

    def healthy_delivered() -> bool:
        with downstream.lock:
            return all(
                downstream.effects[delivery_key(k, n)] == 1
                for k in keys
                for n in ("books", "finance-flow")
            )

    wait_until(healthy_delivered, timeout=30)
    assert down.is_set()
    with downstream.lock:
        assert not any(downstream.effects[delivery_key(k, "notify")] for k in keys)
        assert sum(1 for r in downstream.requests if r["key"].endswith(" @notify")) >= 10
    assert all(_state(stack, k)["status"] == "processing" for k in keys)
    time.sleep(max(0.0, down_seconds - (time.monotonic() - started)))
    down.clear()
    for key in keys:
        # After an outage its circuit may wait out a doubled cool-down before the next trial.
        _settled(stack, key, "succeeded", timeout=120)
    for key in keys:
        assert _effects(downstream, key) == {
            "books": 1,
            "finance-flow": 1,
            "notify": 1,
            "archive": 0,
        }


def test_a_paused_destination_holds_only_its_deliveries(
    stack: Stack, downstream: Downstream
) -> None:
    """Pausing `finance-flow` holds its deliveries (no request) while the other two deliver;
    resuming sends each held one once."""
    with stack.client() as client:
        paused = client.post(
            "/v1/routes/finance-flow/pause", json={"reason": "month-end close"}, headers=AUTH
        )
        assert paused.status_code == 200, paused.text
    try:
        keys = [_send(stack, f"held-{n}").json()["key"] for n in range(5)]

        def others_delivered() -> bool:
            with downstream.lock:
                return all(
                    downstream.effects[delivery_key(k, n)] == 1
                    for k in keys
                    for n in ("books", "notify")
                )

        wait_until(others_delivered, timeout=30)
        with downstream.lock:
            assert not any(r["key"].endswith(" @finance-flow") for r in downstream.requests)
    finally:
        with stack.client() as client:
            resumed = client.post("/v1/routes/finance-flow/resume", headers=AUTH)
            assert resumed.status_code == 200, resumed.text
    for key in keys:
        _settled(stack, key, "succeeded")
        assert _effects(downstream, key)["finance-flow"] == 1


def test_a_provider_webhook_fans_out_once_however_often_it_is_delivered(
    stack: Stack, downstream: Downstream
) -> None:
    """A signed Stripe `charge.refunded`, delivered three times: one event, one effect at each
    of its route's two destinations."""
    secret = PROVIDER_SECRETS["stripe"][1]
    body = json.dumps(
        {"id": "evt_fan_1", "type": "charge.refunded", "data": {"object": {"id": "ch_1"}}}
    ).encode()
    answers = []
    for _ in range(3):
        timestamp = int(time.time())
        with stack.client() as client:
            answers.append(
                client.post(
                    "/v1/webhooks/stripe",
                    content=body,
                    headers={
                        "content-type": "application/json",
                        "stripe-signature": sign_stripe(secret, timestamp, body),
                    },
                )
            )
    assert [a.status_code for a in answers] == [202, 200, 200], answers[0].text
    assert [a.json()["duplicate"] for a in answers] == [False, True, True]
    event_key = answers[0].json()["key"]
    state = _settled(stack, event_key, "succeeded")
    assert [d["destination"] for d in state["deliveries"]] == ["books", "notify"]
    assert _effects(downstream, event_key) == {
        "books": 1,
        "finance-flow": 0,
        "notify": 1,
        "archive": 0,
    }


def test_a_destination_added_later_gets_past_events_by_a_backfill_dry_run_first(
    stack: Stack, downstream: Downstream
) -> None:
    """`idem deliver`: the dry run counts the events of the window that `archive` has not had
    and writes nothing; the run delivers each once; a second run finds none."""
    keys = [_send(stack, f"old-{n}").json()["key"] for n in range(6)]
    for key in keys:
        _settled(stack, key, "succeeded")
    env = stack.env()
    args = ("deliver", "--route", "billing", "--destination", "archive", "--since", "1h")
    dry = run_idem(*args, env=env)
    assert dry.returncode == 0, dry.stderr
    assert "6 events" in dry.stdout and "dry run" in dry.stdout, dry.stdout
    with downstream.lock:
        assert not any(r["key"].endswith(" @archive") for r in downstream.requests)
    done = run_idem(*args, "--execute", env=env)
    assert done.returncode == 0, done.stderr
    assert "6 deliveries added" in done.stdout, done.stdout

    def archived() -> bool:
        with downstream.lock:
            return all(downstream.effects[delivery_key(k, "archive")] == 1 for k in keys)

    wait_until(archived, timeout=30)
    again = run_idem(*args, "--execute", env=env)
    assert again.returncode == 0 and "0 deliveries added" in again.stdout, again.stdout
    for key in keys:
        state = _settled(stack, key, "succeeded")
        assert [d["destination"] for d in state["deliveries"]] == [*DESTINATIONS, "archive"]
        assert _effects(downstream, key) == dict.fromkeys((*DESTINATIONS, "archive"), 1)


def test_a_lane_is_per_destination(stack: Stack, downstream: Downstream) -> None:
    """`accounts` fans out to `ledger-sync` (ordered by account, newest version wins) and
    `books` (unordered). Six versions of one account posted at once, each first refused
    with a 503 by ledger-sync: ledger-sync applies increasing versions ending at the newest,
    the rest superseded there; books acts on every version once; the event's status counts
    a superseded delivery as done."""
    applied: list[int] = []
    lock = threading.Lock()

    def behaviour(key: str, number: int) -> Reply:
        if key.endswith(" @ledger-sync"):
            with downstream.lock:
                body = next(r["body"] for r in reversed(downstream.requests) if r["key"] == key)
            if number == 1:
                return Reply(503)
            with lock:
                applied.append(body["v"])
        return Reply(201)

    downstream.behaviour = behaviour

    def post(version: int) -> httpx.Response:
        body = {
            "source": "ledger-app",
            "event_type": "account.updated",
            "external_id": f"acct-7-v{version}",
            "version": version,
            "payload": {"account": "acct-7", "v": version},
        }
        with stack.client() as client:
            return client.post("/v1/events", json=body)

    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(pool.map(post, [3, 1, 6, 2, 5, 4]))
    assert all(a.status_code == 202 for a in answers), [a.text for a in answers]
    keys = [a.json()["key"] for a in answers]
    for key in keys:
        _settled(stack, key, "succeeded")
    assert applied == sorted(set(applied)) and applied[-1] == 6, applied
    with downstream.lock:
        assert all(downstream.effects[delivery_key(k, "books")] == 1 for k in keys)
    lanes = query(stack.database_url, "SELECT route, lane, applied_version FROM lanes")
    assert lanes == [("ledger-sync", "ledger-app:acct-7", "6")]
    superseded = query(
        stack.database_url,
        "SELECT count(*) FROM idempotency_keys WHERE destination = 'ledger-sync'"
        " AND status = 'superseded'",
    )
    assert superseded == [(6 - len(applied),)]


def test_an_events_deliveries_travel_in_one_message_and_its_copy_makes_no_second_effect(
    stack: Stack, downstream: Downstream
) -> None:
    """The relay sends the three deliveries of an event as one `idem.process_keys` message; the
    worker runs them at once (books' request waits for its siblings' to arrive, which they
    could not if the attempts ran one after another), one effect each. A redelivered copy of
    that message claims nothing and makes no second effect."""
    siblings = {name: threading.Event() for name in DESTINATIONS[1:]}
    waited: dict[str, bool] = {}

    def behaviour(key: str, number: int) -> Reply:
        name = key.rsplit(" @", 1)[-1]
        if name == "books" and number == 1:
            # Within the read timeout (1 s): a sequential worker never sends the others now.
            waited["siblings"] = all(event.wait(0.8) for event in siblings.values())
        elif name in siblings:
            siblings[name].set()
        return Reply(201)

    downstream.behaviour = behaviour
    accepted = _send(stack, "one-message")
    assert accepted.status_code == 202, accepted.text
    event_key = accepted.json()["key"]
    _settled(stack, event_key, "succeeded")
    assert waited == {"siblings": True}
    assert _effects(downstream, event_key) == {**dict.fromkeys(DESTINATIONS, 1), "archive": 0}
    keys = [delivery_key(event_key, name) for name in DESTINATIONS]
    ids = query(
        stack.database_url,
        "SELECT id FROM outbox WHERE idempotency_key = ANY(%(keys)s) ORDER BY id",
        {"keys": keys},
    )
    one_message = '"task_id": "outbox-' + "+".join(str(row[0]) for row in ids) + '"'
    # Each delivery's `attempt.claimed` line is written before its outcome is recorded.
    assert one_message in stack.logs("worker"), "no one message carried the three deliveries"

    # The broker delivers the message again (a copy of it, as after a lost ack).
    settings = Settings(database_url=stack.database_url, broker_url=stack.broker_url)
    copy = [
        OutboxMessage(900_000 + n, key, PROCESS_TASK, "corr-copy", None, event_key)
        for n, key in enumerate(keys)
    ]
    publish(create_publisher(settings), copy, [])
    task_id = "outbox-900000+900001+900002"
    wait_until(
        lambda: any(
            task_id in line and "succeeded" in line for line in stack.logs("worker").splitlines()
        )
    )
    assert _effects(downstream, event_key) == {**dict.fromkeys(DESTINATIONS, 1), "archive": 0}
    with downstream.lock:
        assert sum(1 for r in downstream.requests if r["key"] in keys) == 3
