"""The cases: each drives a workflow through n8n's production webhook URL, as a provider (or a
chat user) would, and counts the tasks the fake CRM created for its business event.

Every case wants exactly one task per business event. A case marked `uncertain` depends on the
claims contract where a claim answers `uncertain` and `/fail` takes `effect`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import psycopg

from outbox.core import standard_webhooks
from tests.n8n_e2e.n8n import WebhookRun, executions, webhook_runs
from tests.n8n_e2e.world import (
    CONTACTS_SECRET,
    CONTACTS_SOURCE,
    SIGNING_SECRET,
    SOURCE,
    TRIGGER_PATH,
    TRIGGER_READ_TIMEOUT_SECONDS,
    World,
)
from tests.support import CLAIMS_TOKEN, Reply, libpq, wait_until

POST_EVENT_PATH = "idem-events"
CLAIM_PATH = "idem-crm-follow-up"
# 04: the same story with the Idem node (n8n-nodes-idem) in place of HTTP Request + IF nodes.
NODE_PATH = "idem-crm-follow-up-node"
# 05: the node's Claim -> Heartbeat -> Complete with the default key, lease token and Busy settings.
HEARTBEAT_PATH = "idem-crm-heartbeat-node"
# 06: Webhook -> the node's Send Event with its default payload (the webhook's body).
SEND_EVENT_PATH = "idem-events-node"
# 08: Webhook -> the node's Dedupe -> New: CRM task / Seen: respond seen.
DEDUPE_PATH = "idem-crm-dedupe-node"
# What a provider's duplicate may wait for an answer while the first run is busy (issue 24).
DUPLICATE_ANSWER_SECONDS = 6.0
# A request to n8n waits for the whole workflow, Retry On Fail waits included (3 tries, 2 s).
PROVIDER_TIMEOUT_SECONDS = 90.0


@dataclass
class Outcome:
    name: str
    passed: bool = True
    tasks: int = 0
    wanted: int = 1
    notes: list[str] = field(default_factory=list)

    def check(self, condition: bool, note: str) -> None:
        """Record `note`; a false condition fails the case (and marks the note)."""
        self.notes.append(note if condition else f"{note} [FAILED]")
        self.passed = self.passed and condition

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return f"{verdict} {self.name:<44} tasks={self.tasks} (want {self.wanted}); " + "; ".join(
            self.notes
        )


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[World, Outcome], None]
    # Needs the claims contract with `uncertain` and `/fail` `effect`.
    uncertain: bool = False


def _event(kind: str) -> dict[str, Any]:
    event_id = f"evt-{kind}-{uuid.uuid4().hex[:8]}"
    return {
        "id": event_id,
        "type": "crm.lead.created",
        "data": {"email": f"{event_id}@Example.com ", "name": "Ada"},
    }


def deliver(
    world: World, path: str, event: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    """One delivery of the provider's webhook, with its raw JSON body (and extra `headers`)."""
    return httpx.post(
        world.webhook(path),
        content=json.dumps(event),
        headers={"content-type": "application/json", **(headers or {})},
        timeout=PROVIDER_TIMEOUT_SECONDS,
    )


def deliver_twice_at_once(world: World, path: str, event: dict[str, Any]) -> list[httpx.Response]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda _: deliver(world, path, event), range(2)))


def tasks(world: World, marker: str) -> int:
    """Tasks the fake CRM created for keys that contain `marker` (the business event's id)."""
    with world.crm.lock:
        return sum(count for key, count in world.crm.effects.items() if marker in key)


def lose_first_answer(world: World, marker: str) -> None:
    """The CRM creates the first task for `marker` and then drops the connection unanswered."""

    def behaviour(key: str, number: int) -> Reply:
        if marker in key and number == 1:
            return Reply(status=201, commit=True, drop=True)
        return Reply()

    world.crm.behaviour = behaviour


def slow_first_answer(world: World, marker: str, seconds: float) -> None:
    def behaviour(key: str, number: int) -> Reply:
        if marker in key and number == 1:
            return Reply(status=201, delay=seconds)
        return Reply()

    world.crm.behaviour = behaviour


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:200]


def _answer(response: httpx.Response) -> str:
    body = _body(response)
    if isinstance(body, dict):
        brief = {k: body[k] for k in ("status", "error", "duplicate") if k in body}
        return f"{response.status_code} {json.dumps(brief, sort_keys=True)}"
    return f"{response.status_code} {body!r}"


def _gateway_key(event: dict[str, Any]) -> str:
    return f"{SOURCE}:{event['id']}"


def _wait_succeeded(world: World, key: str) -> bool:
    try:
        wait_until(lambda: world.key_status(key) == "succeeded", timeout=60)
    except AssertionError:
        return False
    return True


def deliver_while_down(world: World, path: str, event: dict[str, Any], outcome: Outcome) -> None:
    """One delivery with the gateway unreachable: the provider must get 503 and Retry-After."""
    world.gateway_down()
    try:
        down = deliver(world, path, event)
    finally:
        world.gateway_up()
    outcome.check(
        down.status_code == 503 and bool(down.headers.get("retry-after")),
        f"gateway down -> {_answer(down)} Retry-After={down.headers.get('retry-after')}",
    )


def check_found_by_lookup(outcome: Outcome, response: httpx.Response, label: str) -> None:
    """The run completed with the task the CRM lookup found, instead of creating one."""
    body = _body(response)
    found = body.get("found_by_lookup") if isinstance(body, dict) else None
    outcome.check(
        response.status_code == 200 and found is True,
        f"{label} -> {_answer(response)} found_by_lookup={found}",
    )


# ------------------------------------------------------------------ 01: POST /v1/events


def gateway_first_and_redelivery(world: World, outcome: Outcome) -> None:
    event = _event("gw-first")
    first = deliver(world, POST_EVENT_PATH, event)
    body = _body(first)
    outcome.check(
        first.status_code == 200 and isinstance(body, dict) and body.get("duplicate") is False,
        f"first delivery -> {_answer(first)}",
    )
    outcome.check(_wait_succeeded(world, _gateway_key(event)), "gateway key succeeded")
    again = deliver(world, POST_EVENT_PATH, event)
    body = _body(again)
    outcome.check(
        again.status_code == 200 and isinstance(body, dict) and body.get("duplicate") is True,
        f"redelivery -> {_answer(again)}",
    )
    outcome.tasks = tasks(world, event["id"])


def gateway_at_once(world: World, outcome: Outcome) -> None:
    event = _event("gw-twice")
    answers = deliver_twice_at_once(world, POST_EVENT_PATH, event)
    outcome.check(
        all(a.status_code == 200 for a in answers),
        "both deliveries -> " + ", ".join(_answer(a) for a in answers),
    )
    outcome.check(_wait_succeeded(world, _gateway_key(event)), "gateway key succeeded")
    outcome.tasks = tasks(world, event["id"])


def gateway_lost_answer(world: World, outcome: Outcome) -> None:
    event = _event("gw-lost")
    lose_first_answer(world, event["id"])
    first = deliver(world, POST_EVENT_PATH, event)
    outcome.check(first.status_code == 200, f"provider got {_answer(first)}")
    outcome.check(_wait_succeeded(world, _gateway_key(event)), "worker reconciled, key succeeded")
    with world.crm.lock:
        posts = sum(1 for r in world.crm.requests if event["id"] in r["key"])
    outcome.notes.append(f"CRM saw {posts} create request(s)")
    outcome.tasks = tasks(world, event["id"])


def gateway_down(world: World, outcome: Outcome) -> None:
    event = _event("gw-down")
    deliver_while_down(world, POST_EVENT_PATH, event, outcome)
    outcome.check(world.key_status(_gateway_key(event)) is None, "nothing stored while down")
    redeliver_until_done(world, event, outcome, "redelivery")


def redeliver_until_done(world: World, event: dict[str, Any], outcome: Outcome, label: str) -> None:
    """Deliver `event` to 01 again: accepted, and the gateway's worker finishes its key."""
    again = deliver(world, POST_EVENT_PATH, event)
    outcome.check(again.status_code == 200, f"{label} -> {_answer(again)}")
    outcome.check(_wait_succeeded(world, _gateway_key(event)), "gateway key succeeded")
    outcome.tasks = tasks(world, event["id"])


def gateway_bad_signature(world: World, outcome: Outcome) -> None:
    event = _event("gw-badsig")
    world.gateway_up(rotated=True)
    try:
        refused = deliver(world, POST_EVENT_PATH, event)
    finally:
        world.gateway_up()
    body = _body(refused)
    outcome.check(
        refused.status_code == 401
        and isinstance(body, dict)
        and body.get("error") == "invalid_signature",
        f"secret rotated at the gateway -> {_answer(refused)}",
    )
    outcome.check(world.key_status(_gateway_key(event)) is None, "nothing stored")
    outcome.check(tasks(world, event["id"]) == 0, "no task while refused")
    redeliver_until_done(world, event, outcome, "after the fix, redelivery")


# ------------------------------------------------------------------ 02: claims


def claims_first_and_redelivery(world: World, outcome: Outcome, path: str = CLAIM_PATH) -> None:
    event = _event("cl-first")
    first = deliver(world, path, event)
    outcome.check(first.status_code == 200, f"first delivery -> {_answer(first)}")
    again = deliver(world, path, event)
    body = _body(again)
    outcome.check(
        again.status_code == 200
        and isinstance(body, dict)
        and body.get("status") == "already_succeeded"
        and bool(body.get("external_ref"))
        and again.headers.get("idempotent-replayed") == "true",
        f"redelivery -> {_answer(again)} external_ref="
        f"{body.get('external_ref') if isinstance(body, dict) else None}",
    )
    outcome.tasks = tasks(world, event["id"])


def claims_at_once(world: World, outcome: Outcome, path: str = CLAIM_PATH) -> None:
    event = _event("cl-twice")
    # The first CRM call takes a while, so the second delivery finds the claim held.
    slow_first_answer(world, event["id"], seconds=3)
    answers = deliver_twice_at_once(world, path, event)
    outcome.check(
        sorted(a.status_code for a in answers) == [200, 200],
        "both deliveries -> " + ", ".join(_answer(a) for a in answers),
    )
    outcome.tasks = tasks(world, event["id"])


def claims_lost_answer(world: World, outcome: Outcome, path: str = CLAIM_PATH) -> None:
    event = _event("cl-lost")
    lose_first_answer(world, event["id"])
    first = deliver(world, path, event)
    outcome.check(
        first.status_code == 503 and bool(first.headers.get("retry-after")),
        f"CRM answer lost -> {_answer(first)}",
    )
    check_found_by_lookup(outcome, deliver(world, path, event), "redelivery")
    outcome.tasks = tasks(world, event["id"])


def claims_crashed_run(world: World, outcome: Outcome, path: str = CLAIM_PATH) -> None:
    """An earlier run claimed, created the task, and died before completing."""
    event = _event("cl-crash")
    key = f"n8n:crm-follow-up:{event['id']}"
    email = event["data"]["email"].strip().lower()
    with httpx.Client(
        base_url=world.stack.url,
        headers={"authorization": f"Bearer {CLAIMS_TOKEN}"},
        timeout=15,
    ) as gateway:
        held = gateway.post(
            "/v1/claims",
            json={
                "key": key,
                "payload": {"event_id": event["id"], "lead_email": email},
                "lease_seconds": 1,
                "workflow": "crashed run",
            },
        )
        outcome.check(held.status_code == 201, f"earlier run claimed -> {held.status_code}")
        created = httpx.post(
            f"{world.crm.url}/api/tasks", json={"title": "x"}, headers={"idempotency-key": key}
        )
        outcome.check(created.status_code == 201, "earlier run created the task, then died")
    # Let the earlier run's lease of 1 s run out (setup, not a measurement).
    time.sleep(2)
    delivered = deliver(world, path, event)
    check_found_by_lookup(outcome, delivered, "delivery after the crash")
    outcome.tasks = tasks(world, event["id"])


def claims_gateway_down(world: World, outcome: Outcome, path: str = CLAIM_PATH) -> None:
    event = _event("cl-down")
    deliver_while_down(world, path, event, outcome)
    outcome.check(tasks(world, event["id"]) == 0, "no task while down")
    again = deliver(world, path, event)
    outcome.check(again.status_code == 200, f"redelivery -> {_answer(again)}")
    outcome.tasks = tasks(world, event["id"])


# ------------------------------------------------------------------ 03: the agent's tool


def _chat(world: World, message: str) -> httpx.Response:
    webhook_id = next(
        node["webhookId"]
        for workflow in world.workflows.values()
        for node in workflow["nodes"]
        if node["type"] == "@n8n/n8n-nodes-langchain.chatTrigger"
    )
    return httpx.post(
        world.webhook(f"{webhook_id}/chat"),
        json={"action": "sendMessage", "sessionId": uuid.uuid4().hex, "chatInput": message},
        timeout=PROVIDER_TIMEOUT_SECONDS,
    )


def agent_repeated_call(world: World, outcome: Outcome) -> None:
    lead = f"lead-{uuid.uuid4().hex[:8]}@example.com"
    world.model.reset()
    answer = _chat(world, f"Schedule a follow-up call with {lead} on 2030-01-15.")
    outcome.check(answer.status_code == 200, f"chat -> {answer.status_code}")
    names = world.model.tool_names()
    outcome.check(names == {"create_follow_up_task"}, f"tool offered as {sorted(names)}")
    results = [r.get("status") for r in world.model.tool_results()]
    outcome.check(results == ["created", "already_succeeded"], f"tool answered {results}")
    outcome.tasks = tasks(world, lead)


def agent_lost_answer(world: World, outcome: Outcome) -> None:
    lead = f"lead-{uuid.uuid4().hex[:8]}@example.com"
    world.model.reset()
    lose_first_answer(world, lead)
    answer = _chat(world, f"Schedule a follow-up call with {lead} on 2030-01-16.")
    outcome.check(answer.status_code == 200, f"chat -> {answer.status_code}")
    results = world.model.tool_results()
    statuses = [r.get("status") for r in results]
    outcome.check(statuses == ["failed", "created"], f"tool answered {statuses}")
    outcome.tasks = tasks(world, lead)


# ------------------------------------------------------------------ 05: heartbeat, Busy defaults


def _claim_key(event: dict[str, Any]) -> str:
    """The key 04 and 05 claim (their Config's CLAIM_KEY)."""
    return f"n8n:crm-follow-up:{event['id']}"


def node_heartbeat_defaults(world: World, outcome: Outcome) -> None:
    """Claim -> Heartbeat -> Complete, Heartbeat and Complete with their default key and lease
    token: the claim's key and lease token survive Heartbeat, so Complete records the task."""
    event = _event("hb-first")
    first = deliver(world, HEARTBEAT_PATH, event)
    body = _body(first)
    outcome.check(
        first.status_code == 200 and isinstance(body, dict) and body.get("status") == "succeeded",
        f"first delivery -> {_answer(first)}",
    )
    status = world.key_status(_claim_key(event))
    outcome.check(status == "succeeded", f"gateway key {status}")
    again = deliver(world, HEARTBEAT_PATH, event)
    body = _body(again)
    outcome.check(
        again.status_code == 200
        and isinstance(body, dict)
        and body.get("status") == "already_succeeded"
        and again.headers.get("idempotent-replayed") == "true",
        f"redelivery -> {_answer(again)}",
    )
    outcome.tasks = tasks(world, event["id"])


def _crm_saw(world: World, marker: str) -> bool:
    with world.crm.lock:
        return any(marker in r["key"] for r in world.crm.requests)


def node_duplicate_during_slow_run(world: World, outcome: Outcome) -> None:
    """A duplicate arrives while the first run's CRM call takes 5 s; Claim's default Busy wait
    (2 rounds of at most 2 s) answers it within DUPLICATE_ANSWER_SECONDS."""
    event = _event("hb-busy")
    slow_first_answer(world, event["id"], seconds=5)
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(deliver, world, HEARTBEAT_PATH, event)
        # The second delivery starts once the first run holds the claim and is in the CRM call.
        wait_until(lambda: _crm_saw(world, event["id"]), timeout=30)
        started = time.monotonic()
        duplicate = deliver(world, HEARTBEAT_PATH, event)
        took = time.monotonic() - started
        first = running.result()
    outcome.check(
        took <= DUPLICATE_ANSWER_SECONDS and duplicate.status_code in (200, 503),
        f"duplicate -> {_answer(duplicate)} Retry-After={duplicate.headers.get('retry-after')}"
        f" in {took:.1f} s (at most {DUPLICATE_ANSWER_SECONDS:.0f} s)",
    )
    outcome.check(first.status_code == 200, f"first delivery -> {_answer(first)}")
    again = deliver(world, HEARTBEAT_PATH, event)
    body = _body(again)
    outcome.check(
        again.status_code == 200
        and isinstance(body, dict)
        and body.get("status") == "already_succeeded",
        f"redelivery after the run -> {_answer(again)}",
    )
    outcome.tasks = tasks(world, event["id"])


# ------------------------------------------------------------------ 06: Send Event


def node_send_event_changing_headers(world: World, outcome: Outcome) -> None:
    """The provider delivers one body twice with other delivery headers (request id, signature):
    Send Event's default payload is the body, so the second is a duplicate, not a refusal."""
    event = _event("se-headers")
    answers = []
    for attempt in (1, 2):
        headers = {
            "x-request-id": uuid.uuid4().hex,
            "x-provider-signature": f"t={int(time.time())},v1={uuid.uuid4().hex}",
            "x-delivery-attempt": str(attempt),
        }
        answers.append(deliver(world, SEND_EVENT_PATH, event, headers))
    first, again = answers
    body = _body(first)
    outcome.check(
        first.status_code == 200 and isinstance(body, dict) and body.get("duplicate") is False,
        f"first delivery -> {_answer(first)}",
    )
    body = _body(again)
    outcome.check(
        again.status_code == 200 and isinstance(body, dict) and body.get("duplicate") is True,
        f"redelivery, other headers -> {_answer(again)}",
    )
    outcome.check("idempotency_key_reused" not in again.text, "no idempotency_key_reused refusal")
    outcome.check(_wait_succeeded(world, _gateway_key(event)), "gateway key succeeded")
    with psycopg.connect(libpq(world.stack.database_url), autocommit=True) as conn:
        payloads = [
            row[0]
            for row in conn.execute(
                "SELECT payload FROM events WHERE external_id = %s", (event["id"],)
            ).fetchall()
        ]
    outcome.check(len(payloads) == 1, f"{len(payloads)} gateway event(s)")
    outcome.check(
        payloads[:1] == [event], "its payload is the provider's body (no delivery headers)"
    )
    outcome.tasks = tasks(world, event["id"])


# ------------------------------------------------------------------ 07: the Idem Trigger

TRIGGER_WORKFLOW_ID = "idemTriggerCrm01"
TRIGGER_CRM_SECONDS = 5.0


def post_gateway_event(
    world: World, event: dict[str, Any], event_type: str = "trigger.lead.created"
) -> httpx.Response:
    """The provider's event straight to the gateway (signed v2 as `webform`), event type
    `trigger.*` by default: the `trigger` route sends it to 07's Idem Trigger."""
    key = _gateway_key(event)
    body = json.dumps(
        {
            "source": SOURCE,
            "event_type": event_type,
            "external_id": event["id"],
            "payload": event["data"],
        }
    )
    timestamp = int(time.time())
    digest = hmac.new(
        SIGNING_SECRET.encode(), f"{timestamp}.{key}.{body}".encode(), hashlib.sha256
    ).hexdigest()
    return to_gateway(
        world,
        "/v1/events",
        body.encode(),
        {
            "idempotency-key": key,
            "x-idem-timestamp": str(timestamp),
            "x-idem-signature": f"v2={digest}",
        },
    )


def to_gateway(world: World, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    """A signed JSON request straight to the gateway's receiver (not through n8n's proxy)."""
    return httpx.post(
        f"http://127.0.0.1:{world.stack.port}{path}",
        content=body,
        headers={"content-type": "application/json", **headers},
        timeout=30,
    )


def _attempts(world: World, key: str) -> int | None:
    with psycopg.connect(libpq(world.stack.database_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT attempts FROM idempotency_keys WHERE idempotency_key = %s", (key,)
        ).fetchone()
    return None if row is None else int(row[0])


def trigger_slow_workflow(world: World, outcome: Outcome) -> None:
    """The CRM call takes 5 s, the route's read timeout is 3 s: the gateway's re-sends are
    answered in_progress by the trigger while the one execution runs, then with its result."""
    event = _event("trigger-slow")
    slow_first_answer(world, event["id"], TRIGGER_CRM_SECONDS)
    before = executions(world.n8n.home, TRIGGER_WORKFLOW_ID)
    started = time.monotonic()
    accepted = post_gateway_event(world, event)
    outcome.check(accepted.status_code == 202, f"event -> {_answer(accepted)}")
    key = _gateway_key(event)
    done = _wait_succeeded(world, key)
    took = time.monotonic() - started
    outcome.check(
        done,
        f"gateway key {world.key_status(key)} in {took:.1f} s"
        f" (read timeout {TRIGGER_READ_TIMEOUT_SECONDS} s, CRM {TRIGGER_CRM_SECONDS:.0f} s),"
        f" attempts {_attempts(world, key)}",
    )
    with world.crm.lock:
        sent = sum(1 for r in world.crm.requests if event["id"] in r["key"])
    outcome.check(sent == 1, f"the CRM saw {sent} create request(s)")
    time.sleep(1)
    started_executions = executions(world.n8n.home, TRIGGER_WORKFLOW_ID) - before
    outcome.check(started_executions == 1, f"{started_executions} execution(s) started")
    outcome.tasks = tasks(world, event["id"])


def trigger_bad_signature(world: World, outcome: Outcome) -> None:
    """A POST to the trigger's URL signed with another secret: 401, no execution, no task."""
    event = _event("trigger-forged")
    outcome.wanted = 0
    body = json.dumps(event["data"]).encode()
    key = _gateway_key(event)
    timestamp = str(int(time.time()))
    forged = "whsec_" + base64.b64encode(b"not-the-route-signing-secret-32b").decode()
    mac = hmac.new(
        base64.b64decode(forged.removeprefix("whsec_")),
        f"{key}.{timestamp}.".encode() + body,
        hashlib.sha256,
    )
    before = executions(world.n8n.home, TRIGGER_WORKFLOW_ID)
    answers = []
    for headers in (
        {"webhook-signature": "v1," + base64.b64encode(mac.digest()).decode()},
        {},  # no signature at all
    ):
        answers.append(
            httpx.post(
                world.webhook(TRIGGER_PATH),
                content=body,
                headers={
                    "content-type": "application/json",
                    "webhook-id": key,
                    "webhook-timestamp": timestamp,
                    **headers,
                },
                timeout=30,
            )
        )
    wrong, missing = answers
    outcome.check(wrong.status_code == 401, f"wrong signature -> {_answer(wrong)}")
    outcome.check(missing.status_code == 401, f"no signature -> {_answer(missing)}")
    time.sleep(1)
    started_executions = executions(world.n8n.home, TRIGGER_WORKFLOW_ID) - before
    outcome.check(started_executions == 0, f"{started_executions} execution(s) started")
    outcome.tasks = tasks(world, event["id"])


BURST_EVENTS = 10


def trigger_republished_during_burst(world: World, outcome: Outcome) -> None:
    """Ten events to the trigger's route while its workflow is unpublished and published again
    in the running n8n (as a user does in the editor): n8n answers 404 "not registered"
    meanwhile, the `kind = "n8n"` route waits it out, every event is delivered once."""
    events = [_event(f"trigger-burst{n}") for n in range(BURST_EVENTS)]
    outcome.wanted = BURST_EVENTS
    accepted = []
    world.n8n.unpublish_live(TRIGGER_WORKFLOW_ID)
    try:
        for number, event in enumerate(events):
            accepted.append(post_gateway_event(world, event).status_code)
            if number == BURST_EVENTS // 2:
                time.sleep(2)
            time.sleep(0.2)
    finally:
        world.n8n.publish_live(TRIGGER_WORKFLOW_ID)
    outcome.check(accepted == [202] * BURST_EVENTS, f"events -> {sorted(set(accepted))}")
    outcome.check(
        all(_wait_succeeded(world, _gateway_key(event)) for event in events),
        "every gateway key "
        + ",".join(sorted({str(world.key_status(_gateway_key(e))) for e in events})),
    )
    with psycopg.connect(libpq(world.stack.database_url), autocommit=True) as conn:
        (dead,) = conn.execute(
            "SELECT count(*) FROM dead_letters WHERE idempotency_key = ANY(%s)",
            ([_gateway_key(e) for e in events],),
        ).fetchone()
    outcome.check(dead == 0, f"{dead} dead letter(s)")
    not_registered = sum(1 for event in events if (_attempts(world, _gateway_key(event)) or 0) > 1)
    outcome.notes.append(f"{not_registered} event(s) sent again after n8n's 404")
    outcome.tasks = sum(1 for event in events if tasks(world, event["id"]) == 1)
    outcome.check(all(tasks(world, event["id"]) == 1 for event in events), "one task per event")


# ------------------------------------------------------------------ 08: the node's Dedupe


def node_dedupe_at_once(world: World, outcome: Outcome) -> None:
    """The same item delivered twice at once to a workflow whose Dedupe decides: one execution
    goes New and creates the task, the other goes Seen; a later redelivery is Seen too."""
    event = _event("node-dedupe")
    answers = deliver_twice_at_once(world, DEDUPE_PATH, event)
    statuses = sorted(
        str(body.get("status")) if isinstance(body := _body(a), dict) else "?" for a in answers
    )
    outcome.check(
        [a.status_code for a in answers] == [200, 200] and statuses == ["new", "seen"],
        "two at once -> " + ", ".join(_answer(a) for a in answers),
    )
    again = deliver(world, DEDUPE_PATH, event)
    body = _body(again)
    outcome.check(
        again.status_code == 200 and isinstance(body, dict) and body.get("status") == "seen",
        f"redelivery -> {_answer(again)}",
    )
    outcome.check(
        world.key_status(f"n8n:crm-dedupe:{event['id']}") == "succeeded",
        "dedupe key succeeded (a mark, no lease)",
    )
    outcome.tasks = tasks(world, event["id"])


# ------------------------------------------------------------------ 09: a lane per contact

CONTACTS_WORKFLOW_ID = "idemContactLane1"
CONTACT_VERSIONS = 20
SECOND_CONTACT_VERSIONS = 8
# The CRM sends them in bursts; each burst settles at the gateway before the next.
CONTACT_BURSTS = 4
# Deliveries in flight at once: a provider's parallel senders and redeliveries.
CONTACT_SENDERS = 8
LANE_TERMINAL = {"succeeded", "superseded"}
# Executions n8n has finished (a running one has not recorded its outcome yet).
N8N_FINISHED = {"success", "error", "crashed", "canceled"}


def post_contact_update(world: World, contact_id: str, version: int) -> httpx.Response:
    """The CRM's `contact.updated` webhook for one version of a contact, signed (Standard
    Webhooks) as the source `crm`, straight to the gateway's `/v1/webhooks/crm`."""
    body = json.dumps(
        {
            "type": "contact.updated",
            "contact": {
                "id": contact_id,
                "version": version,
                "email": f"{contact_id}@example.com",
                "name": f"Ada v{version}",
            },
        }
    ).encode()
    message_id = f"msg_{contact_id}_v{version}"
    timestamp = int(time.time())
    keys = [standard_webhooks.decode_secret(CONTACTS_SECRET)]
    return to_gateway(
        world,
        f"/v1/webhooks/{CONTACTS_SOURCE}",
        body,
        {
            "webhook-id": message_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": standard_webhooks.signature_header(
                keys, message_id, timestamp, body
            ),
        },
    )


def _contact_keys(world: World, contacts: list[str]) -> list[tuple[str, int, str, str | None]]:
    """(contact, version, status, superseded_by) of every gateway key of these contacts."""
    with psycopg.connect(libpq(world.stack.database_url), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT e.payload #>> '{contact,id}', (e.payload #>> '{contact,version}')::int,"
            " k.status, k.superseded_by"
            " FROM events e JOIN idempotency_keys k USING (idempotency_key)"
            " WHERE e.payload #>> '{contact,id}' = ANY(%s)",
            (contacts,),
        ).fetchall()
    return [(str(c), int(v), str(s), None if b is None else str(b)) for c, v, s, b in rows]


def _applied(run: WebhookRun) -> tuple[str, int]:
    """The contact and version an execution of 09 wrote (its Webhook's body)."""
    contact = run.body["contact"] if isinstance(run.body, dict) else {}
    return str(contact.get("id")), int(contact.get("version", -1))


@dataclass(frozen=True)
class Bursts:
    """The CRM's deliveries (contact, version) in bursts, and what they must come to."""

    sent: list[list[tuple[str, int]]]
    # The lowest of each burst's slice but the last's, sent in the next burst instead: by
    # then a newer version of its contact was applied, so it must end superseded.
    late: set[tuple[str, int]]
    # The newest of each burst's slice: nothing newer exists until the next burst, so it must
    # be applied.
    newest: set[tuple[str, int]]


def contact_bursts(versions: dict[str, int], bursts: int) -> Bursts:
    """Every contact's versions in `bursts` slices in order, each burst shuffled, the lowest of
    each slice but the last delivered late (a redelivery overtaken by newer updates)."""
    late: list[tuple[str, int]] = []
    sent, stragglers, newest = [], set(), set()
    for number in range(bursts):
        burst = list(late)
        late = []
        for contact, count in versions.items():
            size = count // bursts
            chunk = [(contact, v) for v in range(number * size + 1, (number + 1) * size + 1)]
            newest.add(chunk[-1])
            if number < bursts - 1:
                late.append(chunk.pop(0))
            burst.extend(chunk)
        stragglers.update(late)
        random.Random(26 + number).shuffle(burst)
        sent.append(burst)
    return Bursts(sent, stragglers, newest)


def contact_updates_in_order(world: World, outcome: Outcome) -> None:
    """20 versions of one contact and 8 of another, in four bursts shuffled and sent 8 at once
    by the CRM, a straggler of each burst late in the next: the lane route hands 09 one version
    of a contact at a time, in version order, and supersedes the stale ones. n8n's executions
    per contact apply strictly increasing versions, each burst's newest among them, ending at
    the highest; every key is succeeded or superseded (the stragglers superseded); no version
    runs twice."""
    run = uuid.uuid4().hex[:8]
    versions = {f"contact-{run}-a": CONTACT_VERSIONS, f"contact-{run}-b": SECOND_CONTACT_VERSIONS}
    contacts = list(versions)
    bursts = contact_bursts(versions, CONTACT_BURSTS)
    deliveries = [one for burst in bursts.sent for one in burst]
    before = {r.id for r in webhook_runs(world.n8n.home, CONTACTS_WORKFLOW_ID)}
    codes: Counter[int] = Counter()
    rows: list[tuple[str, int, str, str | None]] = []
    sent = 0
    for burst in bursts.sent:
        with ThreadPoolExecutor(max_workers=CONTACT_SENDERS) as pool:
            answers = pool.map(lambda d: post_contact_update(world, *d), burst)
            codes.update(a.status_code for a in answers)
        sent += len(burst)

        # The next burst comes once the gateway has settled this one.
        def settled(sent: int = sent) -> list[tuple[str, int, str, str | None]] | None:
            rows = _contact_keys(world, contacts)
            done = len(rows) == sent and all(r[2] in LANE_TERMINAL for r in rows)
            return rows if done else None

        try:
            rows = wait_until(settled, timeout=120, interval=0.5)
        except AssertionError:
            rows = _contact_keys(world, contacts)
            break
    outcome.check(
        all(200 <= code < 300 for code in codes),
        f"{len(deliveries)} deliveries in {len(bursts.sent)} bursts, {CONTACT_SENDERS} at once"
        f" -> {dict(codes)}",
    )
    statuses = Counter(status for _, _, status, _ in rows)
    outcome.check(
        len(rows) == len(deliveries) and set(statuses) <= LANE_TERMINAL,
        f"gateway keys {dict(sorted(statuses.items()))}",
    )
    unexplained = [v for _, v, s, by in rows if s == "superseded" and not by]
    outcome.check(not unexplained, "every superseded key names the version that superseded it")
    ended = {(c, v): s for c, v, s, _ in rows}
    applied_late = sorted(one for one in bursts.late if ended.get(one) != "superseded")
    outcome.check(
        not applied_late, f"the {len(bursts.late)} late stragglers superseded (not: {applied_late})"
    )
    succeeded = {
        c: sorted(v for contact, v, s, _ in rows if contact == c and s == "succeeded")
        for c in contacts
    }
    wanted = sum(len(found) for found in succeeded.values())

    def ours() -> list[WebhookRun]:
        """This case's executions of 09, in the order n8n started them."""
        return [
            r
            for r in webhook_runs(world.n8n.home, CONTACTS_WORKFLOW_ID)
            if r.id not in before and _applied(r)[0] in versions
        ]

    # n8n records an execution's end just after its Respond node answered the gateway.
    def finished() -> list[WebhookRun] | None:
        runs = ours()
        done = len(runs) >= wanted and all(r.status in N8N_FINISHED for r in runs)
        return runs if done else None

    try:
        runs = wait_until(finished, timeout=60, interval=0.5)
    except AssertionError:
        runs = ours()
    failed = [r.id for r in runs if r.status != "success"]
    outcome.check(not failed, f"{len(runs)} execution(s) of 09, not successful: {failed}")
    for label, contact in zip("ab", contacts, strict=True):
        applied = [v for c, v in map(_applied, runs) if c == contact]
        newest = sorted(v for c, v in bursts.newest if c == contact)
        outcome.check(
            applied == sorted(set(applied))
            and applied[-1:] == [versions[contact]]
            and set(newest) <= set(applied),
            f"n8n applied contact {label} in the order {applied} (each burst's newest {newest})",
        )
        outcome.check(
            sorted(applied) == succeeded[contact],
            f"contact {label}: one execution per succeeded key ({len(applied)}), none for the"
            " superseded",
        )
        with world.crm.lock:
            written = [
                int(r["body"]["version"]) for r in world.crm.requests if contact in r["path"]
            ]
        outcome.check(written == applied, f"contact {label}: the CRM got the same writes")
    outcome.wanted = wanted
    with world.crm.lock:
        outcome.tasks = sum(
            1 for r in world.crm.requests if any(contact in r["path"] for contact in contacts)
        )


CASES = [
    Case("01 gateway: first delivery + redelivery", gateway_first_and_redelivery),
    Case("01 gateway: two deliveries at once", gateway_at_once),
    Case("01 gateway: CRM answer lost", gateway_lost_answer),
    Case("01 gateway: down, then redelivered", gateway_down),
    Case("01 gateway: bad signature, then fixed", gateway_bad_signature),
    Case("02 claims: first delivery + redelivery", claims_first_and_redelivery),
    Case("02 claims: two deliveries at once", claims_at_once),
    Case("02 claims: CRM answer lost", claims_lost_answer, uncertain=True),
    Case("02 claims: crashed earlier run", claims_crashed_run, uncertain=True),
    Case("02 claims: gateway down, then redelivered", claims_gateway_down),
    Case("03 agent: tool called twice", agent_repeated_call),
    Case("03 agent: CRM answer lost, tool called twice", agent_lost_answer, uncertain=True),
    Case(
        "04 node: first delivery + redelivery", partial(claims_first_and_redelivery, path=NODE_PATH)
    ),
    Case("04 node: two deliveries at once", partial(claims_at_once, path=NODE_PATH)),
    Case("04 node: CRM answer lost", partial(claims_lost_answer, path=NODE_PATH), uncertain=True),
    Case(
        "04 node: crashed earlier run", partial(claims_crashed_run, path=NODE_PATH), uncertain=True
    ),
    Case("04 node: gateway down, then redelivered", partial(claims_gateway_down, path=NODE_PATH)),
    Case("05 node: Claim → Heartbeat → Complete with defaults", node_heartbeat_defaults),
    Case(
        "05 node: a duplicate during a 5 s run answers within 6 s", node_duplicate_during_slow_run
    ),
    Case(
        "06 node: Send Event after a Webhook with changing delivery headers",
        node_send_event_changing_headers,
    ),
    Case("07 trigger: slow workflow", trigger_slow_workflow),
    Case("07 trigger: bad signature", trigger_bad_signature),
    Case("07 trigger: re-published during a burst", trigger_republished_during_burst),
    Case("08 node: Dedupe, two executions at once", node_dedupe_at_once),
    Case("09 lanes: a contact's 20 versions shuffled, applied in order", contact_updates_in_order),
]


def run_case(world: World, case: Case) -> Outcome:
    outcome = Outcome(case.name)
    world.crm.behaviour = None
    try:
        case.run(world, outcome)
    except Exception as error:  # a broken case is a failed case, reported with the rest
        outcome.check(False, f"{type(error).__name__}: {error}")
    finally:
        world.crm.behaviour = None
    outcome.check(outcome.tasks == outcome.wanted, f"{outcome.tasks} task(s)")
    return outcome
