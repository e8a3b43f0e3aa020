"""The operator API on the shared stack: auth, dead-letter filters, replay handshake, stats,
metrics and readiness. Dead letters come from real failures at the fake downstream."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from outbox.store.ports import free_port
from tests.support import (
    AUTH,
    Downstream,
    Reply,
    Stack,
    claim,
    envelope,
    query,
    seed_lane_key,
    wait_until,
)


def _fail_permanently(
    stack: Stack,
    downstream: Downstream,
    ids: list[str],
    event_type: str = "plain.lead",
    **extra: Any,
) -> list[str]:
    """Post events whose action answers 422, and wait for their dead letters."""
    downstream.behaviour = lambda key, n: Reply(422)
    keys = []
    with stack.client() as client:
        for external_id in ids:
            answer = client.post("/v1/events", json=envelope(external_id, event_type, **extra))
            keys.append(answer.json()["key"])
    wait_until(
        lambda: (
            query(
                stack.database_url,
                "SELECT count(*) FROM dead_letters WHERE idempotency_key = ANY(%s)",
                (keys,),
            )
            == [(len(keys),)]
        ),
        timeout=30,
    )
    return keys


def _get(stack: Stack, path: str, **params: Any) -> httpx.Response:
    with stack.client() as client:
        return client.get(path, params=params, headers=AUTH)


def _post(stack: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    with stack.client() as client:
        return client.post(path, json=body, headers={**AUTH, "X-Operator": "ops-alice"})


@pytest.mark.parametrize(
    ("headers", "status", "error"),
    [
        ({}, 401, "unauthorized"),
        ({"Authorization": "Bearer wrong"}, 401, "unauthorized"),
        ({"Authorization": "Basic dGVzdDp0ZXN0"}, 401, "unauthorized"),
        (AUTH, 200, None),
    ],
    ids=["no-token", "wrong-token", "wrong-scheme", "right-token"],
)
def test_operator_endpoints_need_the_bearer_token(
    stack: Stack, headers: dict[str, str], status: int, error: str | None
) -> None:
    """Without the right bearer token every operator endpoint answers 401."""
    with stack.client() as client:
        for path in ("/v1/dead-letters", "/v1/stats"):
            answer = client.get(path, headers=headers)
            assert answer.status_code == status, answer.text
            if error:
                assert answer.json()["error"] == error
                assert answer.headers["www-authenticate"].startswith("Bearer")
        replay = client.post("/v1/replays", json={"statuses": ["failed_final"]}, headers=headers)
        assert replay.status_code == status


def test_operator_api_is_disabled_without_a_token(
    stack: Stack, routes_file: Path, tmp_path: Path
) -> None:
    """With OPERATOR_TOKEN unset the operator endpoints answer 503, never open."""
    closed = Stack(
        stack.database_url,
        stack.broker_url,
        routes_file,
        tmp_path,
        extra_env={"OPERATOR_TOKEN": ""},
    )
    closed.start_receiver()
    try:
        with closed.client() as client:
            answer = client.get("/v1/dead-letters", headers=AUTH)
            anonymous = client.get("/v1/stats")
    finally:
        closed.stop_all()
    assert answer.status_code == 503 and answer.json()["error"] == "operator_api_disabled"
    assert anonymous.status_code == 503


def test_dead_letter_filters_and_pagination(stack: Stack, downstream: Downstream) -> None:
    """Every filter narrows the list, and the cursor walks it page by page without repeats."""
    permanent = _fail_permanently(stack, downstream, ["f1", "f2", "f3"])
    other_source = _fail_permanently(stack, downstream, ["g1"], source="shop")
    with stack.client() as client:
        quarantined = client.post(
            "/v1/events",
            json={
                "source": "webform",
                "event_type": "strict.lead",
                "external_id": "q1",
                "payload": {"email": "x@example.com"},
            },
        ).json()["key"]
    every = _get(stack, "/v1/dead-letters").json()["items"]
    assert {d["key"] for d in every} == {*permanent, *other_source, quarantined}

    def keys_for(**params: Any) -> set[str]:
        answer = _get(stack, "/v1/dead-letters", **params)
        assert answer.status_code == 200, answer.text
        return {d["key"] for d in answer.json()["items"]}

    assert keys_for(kind="quarantined") == {quarantined}
    assert keys_for(kind="permanent") == {*permanent, *other_source}
    assert keys_for(event_type="plain.*") == {*permanent, *other_source}
    assert keys_for(event_type="strict.l?ad") == {quarantined}
    assert keys_for(source="shop") == set(other_source)
    assert keys_for(status="open") == {*permanent, *other_source, quarantined}
    assert keys_for(status="discarded") == set()
    assert keys_for(since="1h") == {*permanent, *other_source, quarantined}
    assert keys_for(until="1h") == set()
    assert keys_for(since="2020-01-01T00:00:00Z", until="2999-01-01") == keys_for()
    assert _get(stack, "/v1/dead-letters", since="yesterday").status_code == 422

    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2}
        if cursor:
            params["cursor"] = cursor
        page = _get(stack, "/v1/dead-letters", **params).json()
        seen += [d["key"] for d in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == sorted({*permanent, *other_source, quarantined})
    assert len(seen) == len(set(seen))


def test_dead_letter_detail_masks_secrets_and_shows_the_last_error(
    stack: Stack, downstream: Downstream
) -> None:
    """The detail shows the event, the history and the last error, with secrets masked."""
    downstream.behaviour = lambda key, n: Reply(422)
    body = envelope("secret-1", "plain.lead")
    body["payload"]["password"] = "hunter2"
    body["payload"]["api_token"] = "tok-123"
    with stack.client() as client:
        key = client.post("/v1/events", json=body).json()["key"]
    wait_until(lambda: _get(stack, "/v1/dead-letters").json()["items"])
    item = _get(stack, "/v1/dead-letters").json()["items"][0]
    detail = _get(stack, f"/v1/dead-letters/{item['id']}")
    assert detail.status_code == 200
    shown = detail.json()
    assert shown["key"] == key
    assert shown["payload"]["password"] == "[redacted]"
    assert shown["payload"]["api_token"] == "[redacted]"
    assert shown["payload"]["name"] == "Ada"
    assert "hunter2" not in detail.text and "tok-123" not in detail.text
    assert shown["last_error"]["error_code"] == "http_422"
    assert [h["kind"] for h in shown["history"]] == ["permanent"]
    assert _get(stack, "/v1/dead-letters/999999").status_code == 404


def test_discard_closes_an_open_dead_letter_once(stack: Stack, downstream: Downstream) -> None:
    """Discarding records who and why; a second discard is refused with 409."""
    _fail_permanently(stack, downstream, ["d1"])
    item = _get(stack, "/v1/dead-letters").json()["items"][0]
    first = _post(stack, f"/v1/dead-letters/{item['id']}/discard", {"reason": "test data"})
    again = _post(stack, f"/v1/dead-letters/{item['id']}/discard", {"reason": "again"})
    empty = _post(stack, f"/v1/dead-letters/{item['id']}/discard", {"reason": ""})
    assert first.status_code == 200
    assert again.status_code == 409 and again.json()["error"] == "dead_letter_not_open"
    assert empty.status_code == 422
    assert query(
        stack.database_url, "SELECT resolution, resolved_by, resolution_note FROM dead_letters"
    ) == [("discarded", "ops-alice", "test data")]


def test_replay_needs_a_dry_run_and_replays_exactly_that_set(
    stack: Stack, downstream: Downstream
) -> None:
    """Dry run, then confirm: the keys succeed once the cause is fixed, their dead letters are
    marked replayed, an audit row is written; a second replay touches nothing."""
    keys = _fail_permanently(stack, downstream, ["r1", "r2"])
    # The cause is fixed before the next event is posted: the worker may act on it at once.
    downstream.behaviour = None
    with stack.client() as client:
        done = client.post("/v1/events", json=envelope("ok-1", "plain.lead"))
    ok_key = done.json()["key"]
    request = {"statuses": ["failed_final"], "event_type": "plain.*"}
    report = _post(stack, "/v1/replays", request).json()
    assert report["dry_run"] is True
    assert report["matched"] == 2 and report["to_replay"] == 2
    assert report["by_event_type"] == {"plain.lead": 2}
    assert list(report["by_target"]) == [f"http 127.0.0.1:{downstream.port}"]
    assert query(
        stack.database_url, "SELECT count(*) FROM idempotency_keys WHERE status = 'failed_final'"
    ) == [(2,)]

    executed = _post(
        stack, "/v1/replays", {**request, "dry_run": False, "confirm": report["confirm"]}
    )
    assert executed.status_code == 200, executed.text
    assert executed.json()["replay_id"] >= 1
    wait_until(
        lambda: (
            query(
                stack.database_url,
                "SELECT count(*) FROM idempotency_keys WHERE status = 'succeeded'",
            )
            == [(3,)]
        ),
        timeout=30,
    )
    assert downstream.effects == {keys[0]: 1, keys[1]: 1, ok_key: 1}
    assert query(
        stack.database_url, "SELECT DISTINCT resolution, resolved_by FROM dead_letters"
    ) == [("replayed", "ops-alice")]
    assert query(stack.database_url, "SELECT requested_by, key_count FROM replays") == [
        ("ops-alice", 2)
    ]

    by_keys = {"keys": [*keys, ok_key]}
    second = _post(stack, "/v1/replays", by_keys).json()
    assert second["to_replay"] == 0
    assert {s["reason"] for s in second["skipped"]} == {"already succeeded"}
    confirmed = _post(
        stack, "/v1/replays", {**by_keys, "dry_run": False, "confirm": second["confirm"]}
    )
    assert confirmed.status_code == 200 and confirmed.json()["to_replay"] == 0
    assert downstream.effects == {keys[0]: 1, keys[1]: 1, ok_key: 1}


def test_a_stale_confirm_token_gets_409_and_a_fresh_report(
    stack: Stack, downstream: Downstream
) -> None:
    """When the set changed after the dry run, nothing is replayed and the answer carries the
    new report."""
    _fail_permanently(stack, downstream, ["s1"])
    request = {"statuses": ["failed_final"]}
    token = _post(stack, "/v1/replays", request).json()["confirm"]
    _fail_permanently(stack, downstream, ["s2"])
    stale = _post(stack, "/v1/replays", {**request, "dry_run": False, "confirm": token})
    assert stale.status_code == 409
    assert stale.json()["error"] == "replay_set_changed"
    assert stale.json()["report"]["to_replay"] == 2
    assert query(
        stack.database_url, "SELECT count(*) FROM idempotency_keys WHERE status = 'failed_final'"
    ) == [(2,)]
    assert query(stack.database_url, "SELECT count(*) FROM replays") == [(0,)]


def _material(filter_document: dict[str, Any], keys: list[str]) -> bytes:
    """What a confirm token binds: the filter and the sorted keys, as canonical JSON."""
    document = {"filter": filter_document, "keys": sorted(keys)}
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def test_a_confirm_token_made_without_a_dry_run_is_refused(
    stack: Stack, downstream: Downstream
) -> None:
    """A token computed from the filter and the keys alone (the unkeyed hash anyone can make)
    or signed with another secret gets 409 replay_set_changed and replays nothing; the dry
    run's token for the same set replays it."""
    keys = _fail_permanently(stack, downstream, ["h1"])
    downstream.behaviour = None
    request = {"statuses": ["failed_final"]}
    material = _material({"statuses": ["failed_final"], "limit": 100}, keys)
    forged = [
        "rp1_" + hashlib.sha256(material).hexdigest()[:40],
        "rp2_" + hmac.new(b"guessed", material, hashlib.sha256).hexdigest()[:40],
    ]
    for token in forged:
        refused = _post(stack, "/v1/replays", {**request, "dry_run": False, "confirm": token})
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"] == "replay_set_changed"
        assert refused.json()["report"]["confirm"] not in forged
    assert query(stack.database_url, "SELECT status FROM idempotency_keys") == [("failed_final",)]
    assert query(stack.database_url, "SELECT count(*) FROM replays") == [(0,)]
    assert query(stack.database_url, "SELECT resolution FROM dead_letters") == [("open",)]

    token = _post(stack, "/v1/replays", request).json()["confirm"]
    executed = _post(stack, "/v1/replays", {**request, "dry_run": False, "confirm": token})
    assert executed.status_code == 200, executed.text
    wait_until(
        lambda: (
            query(stack.database_url, "SELECT status FROM idempotency_keys") == [("succeeded",)]
        ),
        timeout=30,
    )
    assert downstream.effects == {keys[0]: 1}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "(body)"),
        ({"limit": 5}, "(body)"),
        ({"statuses": ["succeeded"]}, "statuses"),
        ({"statuses": ["pending"]}, "statuses"),
        ({"statuses": ["failed_final"], "limit": 100_001}, "limit"),
        ({"statuses": ["failed_final"], "dry_run": False}, "(body)"),
        ({"event_type": "x", "since": "someday"}, "(body)"),
    ],
    ids=[
        "empty",
        "limit-only",
        "succeeded",
        "pending",
        "limit-too-high",
        "no-confirm",
        "bad-since",
    ],
)
def test_replay_refuses_unsafe_filters(stack: Stack, body: dict[str, Any], field: str) -> None:
    """A filter that names nothing, a status that may not be replayed, a limit over 100 000 or an
    execution without its token is refused with 422."""
    answer = _post(stack, "/v1/replays", body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"] == "invalid_request"


def test_processing_keys_are_replayable_only_once_their_lease_expired(
    stack: Stack, downstream: Downstream
) -> None:
    """A processing key with a live lease is skipped as in flight; with an expired lease it is
    replayed (and fenced: its old holder can no longer write)."""
    with stack.client() as client:
        key = client.post("/v1/events", json=envelope("p1")).json()["key"]
    wait_until(
        lambda: query(stack.database_url, "SELECT status FROM idempotency_keys") == [("succeeded",)]
    )
    query(
        stack.database_url,
        "UPDATE idempotency_keys SET status = 'processing', "
        "locked_until = now() + interval '1 hour', fence = 7",
    )
    live = _post(stack, "/v1/replays", {"statuses": ["processing"]}).json()
    assert live["to_replay"] == 0
    assert live["skipped"][0]["reason"] == "in flight (lease live)"
    query(
        stack.database_url, "UPDATE idempotency_keys SET locked_until = now() - interval '1 second'"
    )
    expired = _post(stack, "/v1/replays", {"statuses": ["processing"]}).json()
    assert expired["to_replay"] == 1
    _post(
        stack,
        "/v1/replays",
        {"statuses": ["processing"], "dry_run": False, "confirm": expired["confirm"]},
    )
    state = wait_until(
        lambda: [
            r
            for r in query(
                stack.database_url,
                "SELECT status, fence, result->>'reconciled' FROM idempotency_keys",
            )
            if r[0] == "succeeded"
        ],
        timeout=30,
    )
    assert state[0][1] == 9  # 7, +1 by the replay, +1 by the new claim
    assert state[0][2] == "true", "the replayed processing key was reconciled first"
    assert downstream.effects == {key: 1}


def test_stats_count_what_the_database_holds(stack: Stack, downstream: Downstream) -> None:
    """Stats report keys by status, open dead letters by kind and duplicates blocked, with a
    claim the claims API refused counted under `claims`, not under the worker."""
    _fail_permanently(stack, downstream, ["x1", "x2"])
    downstream.behaviour = None
    with stack.client() as client:
        for _ in range(3):
            client.post("/v1/events", json=envelope("x3"))
    assert claim(stack, "held-by-a-workflow").status_code == 201
    assert claim(stack, "held-by-a-workflow").json()["status"] == "in_progress"
    wait_until(lambda: _get(stack, "/v1/stats").json()["keys_by_status"]["succeeded"] == 1)
    numbers = _get(stack, "/v1/stats").json()
    assert numbers["keys_by_status"]["failed_final"] == 2
    assert numbers["open_dead_letters"] == {
        "permanent": 2,
        "retries_exhausted": 0,
        "quarantined": 0,
    }
    assert numbers["duplicates_blocked"] == {"receiver": 2, "worker": 0, "claims": 1}
    assert numbers["outbox"]["due"] == 0
    assert numbers["processing"]["count"] == 1  # the claim a workflow holds


def _metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "") + r" (\S+)"
    match = re.search(r"^" + pattern + "$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_metrics_after_a_scripted_run(stack: Stack, downstream: Downstream) -> None:
    """After three successes, one permanent failure, one duplicate and one conflict, the
    receiver's and the worker's metrics say exactly that."""
    worker_url = f"http://127.0.0.1:{stack.metrics_ports['worker']}/metrics"
    before = httpx.get(worker_url, timeout=5).text
    receiver_before = httpx.get(f"{stack.url}/metrics", timeout=5).text
    downstream.behaviour = None
    with stack.client() as client:
        for i in range(3):
            client.post("/v1/events", json=envelope(f"m{i}"))
        client.post("/v1/events", json=envelope("m0"))
        conflict = envelope("m0")
        conflict["payload"]["name"] = "Other"
        client.post("/v1/events", json=conflict)
    wait_until(
        lambda: (
            query(
                stack.database_url,
                "SELECT count(*) FROM idempotency_keys WHERE status = 'succeeded'",
            )
            == [(3,)]
        )
    )
    _fail_permanently(stack, downstream, ["m-bad"], event_type="plain.lead")
    receiver = httpx.get(f"{stack.url}/metrics", timeout=5).text
    after = wait_until(
        lambda: (
            (t := httpx.get(worker_url, timeout=5).text)
            and _metric(t, "idem_attempts_total", outcome="dead_letter", error_code="http_422")
            > _metric(before, "idem_attempts_total", outcome="dead_letter", error_code="http_422")
            and t
        )
    )

    def delta(name: str, text: str, old: str, **labels: str) -> float:
        return _metric(text, name, **labels) - _metric(old, name, **labels)

    # crm.lead.created and plain.lead are taken by globs (crm.*, plain.*): counted as `other`.
    assert delta("idem_events_accepted_total", receiver, receiver_before, event_type="other") == 4
    assert delta("idem_events_duplicate_total", receiver, receiver_before) == 1
    assert delta("idem_payload_conflicts_total", receiver, receiver_before) == 1
    assert _metric(receiver, "idem_keys", status="succeeded") == 3
    assert _metric(receiver, "idem_keys", status="failed_final") == 1
    assert _metric(receiver, "idem_dead_letters_open", kind="permanent") == 1
    assert _metric(receiver, "idem_database_up") == 1
    assert delta("idem_attempts_total", after, before, outcome="succeeded", error_code="") == 3
    assert (
        delta("idem_attempts_total", after, before, outcome="dead_letter", error_code="http_422")
        == 1
    )
    assert delta("idem_action_seconds_count", after, before, route="crm") == 3


def test_superseded_keys_are_counted_and_their_dead_letters_filtered(stack: Stack) -> None:
    """`/v1/stats` and `/metrics` count superseded keys, and `/v1/dead-letters` filters on a
    dead letter a newer version closed."""
    db = stack.database_url
    keys = [
        seed_lane_key(db, f"c-v{n}", "superseded", lane="c", rank=n, superseded_by="9")
        for n in (1, 2)
    ]
    query(
        db,
        "INSERT INTO dead_letters (idempotency_key, kind, error_code, attempts, first_failed_at,"
        " last_failed_at, resolution, resolved_by, resolved_at)"
        " VALUES (%s, 'permanent', 'http_422', 1, now(), now(), 'superseded', 'lane', now())",
        (keys[0],),
    )
    numbers = _get(stack, "/v1/stats").json()
    assert numbers["keys_by_status"]["superseded"] == 2
    assert (
        _metric(httpx.get(f"{stack.url}/metrics", timeout=5).text, "idem_keys", status="superseded")
        == 2
    )
    listed = _get(stack, "/v1/dead-letters", status="superseded").json()["items"]
    assert [(i["key"], i["status"], i["resolved_by"]) for i in listed] == [
        (keys[0], "superseded", "lane")
    ]
    assert _get(stack, "/v1/dead-letters", status="open").json()["items"] == []


def test_readiness_says_ready_or_not_and_logs_why(
    stack: Stack, routes_file: Path, tmp_path: Path
) -> None:
    """/readyz is 200 when database, schema and broker are fine, 503 when the broker is
    unreachable; either way the answer says ready or not and nothing else (no check names,
    error classes or addresses), while the receiver's log names the broker; /healthz stays 200."""
    with stack.client() as client:
        ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"ready": True}
    orphan = Stack(stack.database_url, f"redis://127.0.0.1:{free_port()}/0", routes_file, tmp_path)
    orphan.start_receiver()
    try:
        with orphan.client() as client:
            not_ready = client.get("/readyz")
            alive = client.get("/healthz")
    finally:
        orphan.stop_all()
    assert not_ready.status_code == 503
    assert not_ready.json() == {"ready": False}
    assert alive.status_code == 200
    lines = orphan.logs("receiver").splitlines()
    probes = [json.loads(line) for line in lines if "readyz" in line]
    assert {"event": "readyz.not_ready", "failed": ["broker"]}.items() <= probes[-1].items()


# It empties or counts inside Redis.
@pytest.mark.brokers("redis")
def test_a_flood_of_readyz_costs_one_broker_connection_and_a_check_a_second(
    private_stack: Stack,
) -> None:
    """200 probes from 16 clients at once: Redis (the test's own server) accepts no new
    connection for them, the probe's one named connection is reused, and Redis answers at most
    one PING per second of the flood (plus one), not one per probe."""
    private_stack.start_receiver()
    broker: redis.Redis[Any] = redis.Redis.from_url(private_stack.broker_url)
    with private_stack.client() as client:
        assert client.get("/readyz").status_code == 200

    def counts() -> tuple[int, int]:
        stats = broker.info("stats")
        pings = broker.info("commandstats").get("cmdstat_ping", {}).get("calls", 0)
        return int(stats["total_connections_received"]), int(pings)

    try:
        connections_before, pings_before = counts()
        started = time.monotonic()
        with private_stack.client() as client, ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda _: client.get("/readyz").status_code, range(200)))
        elapsed = time.monotonic() - started
        connections_after, pings_after = counts()
        named = [c for c in broker.client_list() if c.get("name") == "idem-readyz"]
    finally:
        broker.close()
    assert answers == [200] * 200
    assert connections_after - connections_before == 0
    assert len(named) == 1
    assert pings_after - pings_before <= math.ceil(elapsed) + 1
