"""The event path end to end: receiver, relay and worker processes on real PostgreSQL and Redis."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.support import Downstream, Stack, envelope, query, wait_until


def _succeeded(stack: Stack, key: str) -> dict[str, object] | None:
    with stack.client() as client:
        body = client.get(f"/v1/events/{key}").json()
    return body if body.get("status") == "succeeded" else None


@pytest.mark.brokers
def test_same_envelope_twice_runs_the_action_once(stack: Stack, downstream: Downstream) -> None:
    """A repeat after success gets the first result and correlation id, and no second effect."""
    with stack.client() as client:
        first = client.post("/v1/events", json=envelope("lead-1", correlation_id="corr-first"))
        assert first.status_code == 202
        assert first.json()["duplicate"] is False
        key = first.json()["key"]
        done = wait_until(lambda: _succeeded(stack, key))
        second = client.post("/v1/events", json=envelope("lead-1", correlation_id="corr-second"))
    assert second.status_code == 200
    assert second.headers["idempotent-replayed"] == "true"
    body = second.json()
    assert body["duplicate"] is True
    assert body["status"] == "succeeded"
    assert body["correlation_id"] == "corr-first"
    assert body["external_ref"] == done["external_ref"] == "task-1"
    assert body["result"]["status_code"] == 201
    assert downstream.effects == {key: 1}
    assert query(stack.database_url, "SELECT count(*) FROM outbox") == [(1,)]
    assert query(stack.database_url, "SELECT duplicate_count FROM idempotency_keys") == [(1,)]


@pytest.mark.brokers(slow=("rabbitmq",))
def test_fifty_identical_envelopes_at_once_run_one_action(
    stack: Stack, downstream: Downstream
) -> None:
    """Fifty concurrent deliveries of one event give one outbox row and one side effect."""

    def post(_: int) -> httpx.Response:
        with stack.client() as client:
            return client.post("/v1/events", json=envelope("lead-storm"))

    with concurrent.futures.ThreadPoolExecutor(max_workers=50) as pool:
        answers = list(pool.map(post, range(50)))
    assert {a.status_code for a in answers} <= {200, 202}
    assert sum(1 for a in answers if a.json()["duplicate"] is False) == 1
    key = answers[0].json()["key"]
    assert {a.json()["key"] for a in answers} == {key}
    wait_until(lambda: _succeeded(stack, key))
    assert query(stack.database_url, "SELECT count(*) FROM outbox") == [(1,)]
    assert query(stack.database_url, "SELECT duplicate_count FROM idempotency_keys") == [(49,)]
    assert downstream.effects == {key: 1}


def test_replayed_answer_while_pending_is_202(stack: Stack) -> None:
    """A repeat before the worker finished says so with 202 and the replay header."""
    stack_env = {
        "source": "shop",
        "event_type": "order.created",
        "external_id": "o-1",
        "payload": {"total": 3},
    }
    with stack.client() as client:
        # The worker may or may not have finished by the repeat: the status code must match
        # whichever state the answer reports (202 in flight, 200 finished).
        first = client.post("/v1/events", json=stack_env)
        second = client.post("/v1/events", json=stack_env)
    assert first.status_code == 202
    assert second.headers["idempotent-replayed"] == "true"
    assert second.json()["duplicate"] is True
    expected = 200 if second.json()["status"] == "succeeded" else 202
    assert second.status_code == expected


def test_same_key_different_payload_is_refused(stack: Stack, downstream: Downstream) -> None:
    """A reused key with another payload gets 422 and the original stays as it was."""
    with stack.client() as client:
        first = client.post("/v1/events", json=envelope("lead-2"))
        key = first.json()["key"]
        wait_until(lambda: _succeeded(stack, key))
        other = envelope("lead-2")
        other["payload"]["name"] = "Grace"
        conflict = client.post("/v1/events", json=other)
        after = client.get(f"/v1/events/{key}").json()
    assert conflict.status_code == 422
    assert conflict.headers["content-type"] == "application/problem+json"
    assert conflict.json()["error"] == "idempotency_key_reused"
    assert query(stack.database_url, "SELECT payload->>'name' FROM events") == [("Ada",)]
    assert query(stack.database_url, "SELECT count(*) FROM outbox") == [(1,)]
    assert after["status"] == "succeeded" and after["duplicate_count"] == 0
    assert downstream.effects == {key: 1}


def test_idempotency_key_header_replaces_the_derived_key(
    stack: Stack, downstream: Downstream
) -> None:
    """With an Idempotency-Key header, that key is used, whatever the envelope's ids are: in
    the source's namespace (`webform:evt_42`), which is also what the action sends on."""
    with stack.client() as client:
        a = client.post("/v1/events", json=envelope("x-1"), headers={"Idempotency-Key": "evt_42"})
        b = client.post("/v1/events", json=envelope("x-1"), headers={"Idempotency-Key": "evt_42"})
    assert a.json()["key"] == "webform:evt_42"
    assert b.json()["duplicate"] is True
    wait_until(lambda: _succeeded(stack, "webform:evt_42"))
    assert downstream.effects == {"webform:evt_42": 1}
    assert downstream.requests[0]["headers"]["Idempotency-Key"] == "webform:evt_42"


@pytest.mark.brokers
def test_many_events_end_to_end_through_the_http_action(
    stack: Stack, downstream: Downstream
) -> None:
    """Every distinct event reaches the downstream exactly once, with its key and reference."""
    keys = []
    with stack.client() as client:
        for i in range(30):
            for _ in range(2):
                answer = client.post("/v1/events", json=envelope(f"bulk-{i}"))
                assert answer.status_code in (200, 202)
            keys.append(answer.json()["key"])
    wait_until(
        lambda: (
            query(
                stack.database_url,
                "SELECT count(*) FROM idempotency_keys WHERE status = 'succeeded'",
            )
            == [(30,)]
        ),
        timeout=60,
    )
    assert downstream.effects == dict.fromkeys(keys, 1)
    refs = query(stack.database_url, "SELECT external_ref FROM idempotency_keys")
    assert len({r[0] for r in refs}) == 30 and all(r[0].startswith("task-") for r in refs)
    assert query(stack.database_url, "SELECT count(*) FROM outbox WHERE published_at IS NULL") == [
        (0,)
    ]


def test_unknown_key_is_404(stack: Stack) -> None:
    """Looking up a key nobody sent answers 404 with a problem document."""
    with stack.client() as client:
        answer = client.get("/v1/events/webform:crm.lead.created:nope")
    assert answer.status_code == 404
    assert answer.json()["error"] == "key_not_found"


def test_a_repeat_of_a_superseded_event_says_which_version_won(
    stack: Stack, downstream: Downstream
) -> None:
    """A repeat of a key its lane superseded is answered 200 as `superseded` with the version
    that won, and the key's page shows its lane and that version; other keys show neither."""
    with stack.client() as client:
        first = client.post("/v1/events", json=envelope("contact-1", version="2"))
        key = first.json()["key"]
        wait_until(lambda: _succeeded(stack, key))
        # As the lane step leaves a key a newer version overtook (the worker side is not
        # what this test drives).
        query(
            stack.database_url,
            "UPDATE idempotency_keys SET status = 'superseded', superseded_by = '5',"
            " lane = 'contact-1', lane_rank = 2 WHERE idempotency_key = %s",
            (key,),
        )
        repeat = client.post("/v1/events", json=envelope("contact-1", version="2"))
        shown = client.get(f"/v1/events/{key}").json()
        plain = client.post("/v1/events", json=envelope("contact-2")).json()["key"]
        plain_shown = client.get(f"/v1/events/{plain}").json()
    assert repeat.status_code == 200
    assert repeat.headers["idempotent-replayed"] == "true"
    body = repeat.json()
    assert (body["status"], body["duplicate"], body["superseded_by"]) == ("superseded", True, "5")
    assert (shown["status"], shown["lane"], shown["superseded_by"]) == (
        "superseded",
        "contact-1",
        "5",
    )
    assert "lane" not in plain_shown and "superseded_by" not in plain_shown
    assert downstream.effects[key] == 1
