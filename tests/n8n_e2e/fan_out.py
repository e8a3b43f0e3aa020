"""10: one signed Stripe `invoice.paid`, three deliveries (the route `stripe-invoice-paid` of
examples/routes.toml): the CRM, examples/n8n/10 (the finance workflow, which books the invoice
in a ledger) and the chat notifier. The fake downstream plays the CRM (`/crm/tasks`), the ledger
(`/finance/api/ledger/entries`, called by the workflow) and the notifier (`/slack/notify`); each
delivery's requests carry its own key, `<event key> @<destination>`, as Idempotency-Key. n8n's
executions of 10 are read from its sqlite.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import psycopg

from outbox.core.keys import delivery_key, derive_key
from outbox.ingest.provider_signatures import sign_stripe
from tests.n8n_e2e.cases import N8N_FINISHED, Case, Outcome, to_gateway
from tests.n8n_e2e.n8n import WebhookRun, webhook_runs
from tests.n8n_e2e.world import STRIPE_SECRET, STRIPE_SOURCE, World
from tests.support import AUTH, CLAIMS_TOKEN, Reply, libpq, wait_until

INVOICE_WORKFLOW_ID = "idemInvoicePaid1"
DESTINATIONS = ("crm", "finance-flow", "slack")
# Where each destination's requests arrive at the fake downstream (the ledger for finance-flow:
# the workflow writes there with the delivery's key).
PATHS = {"crm": "/crm/", "finance-flow": "/finance/", "slack": "/slack/"}
SETTLE_SECONDS = 90


def stripe_event(pending_webhooks: int = 3) -> dict[str, Any]:
    """A Stripe `invoice.paid` event as Stripe posts it (the fields 10 reads, and a few more)."""
    tag = uuid.uuid4().hex[:12]
    return {
        "id": f"evt_{tag}",
        "object": "event",
        "type": "invoice.paid",
        "created": int(time.time()),
        "livemode": False,
        # Stripe counts this down between deliveries: the same event, other bytes.
        "pending_webhooks": pending_webhooks,
        "data": {
            "object": {
                "id": f"in_{tag}",
                "object": "invoice",
                "customer": f"cus_{tag}",
                "amount_paid": 4900,
                "currency": "eur",
                "status": "paid",
            }
        },
    }


def post_stripe(world: World, event: dict[str, Any]) -> httpx.Response:
    """One delivery of the event by Stripe to the gateway's `/v1/webhooks/stripe`, signed."""
    body = json.dumps(event).encode()
    signature = sign_stripe(STRIPE_SECRET, int(time.time()), body)
    return to_gateway(world, f"/v1/webhooks/{STRIPE_SOURCE}", body, {"stripe-signature": signature})


def event_state(world: World, key: str) -> dict[str, Any]:
    """`GET /v1/events/{key}`: the event's status (its deliveries') and its `deliveries`."""
    answer = httpx.get(
        f"{world.stack.url}/v1/events/{key}",
        headers={"authorization": f"Bearer {CLAIMS_TOKEN}"},
        timeout=15,
    )
    answer.raise_for_status()
    state: dict[str, Any] = answer.json()
    return state


def settled(world: World, key: str, status: str) -> tuple[bool, dict[str, Any]]:
    """Wait until the event's status is `status`; whether it got there, and its last state."""
    try:
        state = wait_until(
            lambda: (s := event_state(world, key))["status"] == status and s,
            timeout=SETTLE_SECONDS,
            interval=0.25,
        )
    except AssertionError:
        return False, event_state(world, key)
    return True, state


def by_destination(state: dict[str, Any], member: str = "status") -> dict[str, Any]:
    return {d["destination"]: d.get(member) for d in state.get("deliveries", [])}


def requests_at(world: World, event_key: str) -> dict[str, int]:
    """Requests each destination's downstream received for this event (its delivery's key)."""
    with world.crm.lock:
        return {
            name: sum(
                1
                for r in world.crm.requests
                if r["key"] == delivery_key(event_key, name) and r["path"].startswith(PATHS[name])
            )
            for name in DESTINATIONS
        }


def effects_at(world: World, event_key: str) -> dict[str, int]:
    with world.crm.lock:
        return {name: world.crm.effects[delivery_key(event_key, name)] for name in DESTINATIONS}


def finance_runs(world: World, event: dict[str, Any], at_least: int) -> list[WebhookRun]:
    """10's executions for this event (its Webhook got the Stripe event), once `at_least` of them
    have finished (n8n records an execution's end just after its Respond node answered)."""

    def ours() -> list[WebhookRun]:
        return [
            run
            for run in webhook_runs(world.n8n.home, INVOICE_WORKFLOW_ID)
            if isinstance(run.body, dict) and run.body.get("id") == event["id"]
        ]

    def finished() -> list[WebhookRun] | None:
        runs = ours()
        done = len(runs) >= at_least and all(r.status in N8N_FINISHED for r in runs)
        return runs if done else None

    try:
        found: list[WebhookRun] = wait_until(finished, timeout=30, interval=0.5)
    except AssertionError:
        return ours()
    return found


def dead_letters(world: World, event_key: str) -> list[tuple[str, str, str]]:
    """(key, destination, resolution) of every dead letter of the event's deliveries."""
    with psycopg.connect(libpq(world.stack.database_url), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT k.idempotency_key, k.destination, d.resolution FROM dead_letters d"
            " JOIN idempotency_keys k USING (idempotency_key) WHERE k.event_key = %s"
            " ORDER BY d.id",
            (event_key,),
        ).fetchall()
    return [(str(key), str(destination), str(resolution)) for key, destination, resolution in rows]


def _brief(answer: httpx.Response) -> str:
    try:
        body = answer.json()
    except ValueError:
        return f"{answer.status_code} {answer.text[:200]!r}"
    brief = {k: body[k] for k in ("status", "duplicate", "error") if k in body}
    return f"{answer.status_code} {json.dumps(brief, sort_keys=True)}"


def _listed(answer: httpx.Response) -> list[tuple[str, str]]:
    """(destination, key) of the deliveries an answer lists."""
    deliveries = answer.json().get("deliveries", []) if answer.status_code < 300 else []
    return [(d["destination"], d["key"]) for d in deliveries]


def fan_out_once_per_destination(world: World, outcome: Outcome) -> None:
    """Stripe delivers the event, redelivers it at once (other bytes: `pending_webhooks`) and
    again once it is done: one gateway event, three deliveries listed in every answer, one
    request and one effect at each destination, one execution of 10."""
    event = stripe_event()
    first = post_stripe(world, event)
    outcome.check(first.status_code == 202, f"first delivery -> {_brief(first)}")
    key = first.json()["key"]
    wanted = [(name, delivery_key(key, name)) for name in DESTINATIONS]
    outcome.check(_listed(first) == wanted, f"deliveries listed {[d for d, _ in _listed(first)]}")
    again = post_stripe(world, {**event, "pending_webhooks": 2})
    outcome.check(
        again.status_code in (200, 202)
        and again.json().get("duplicate") is True
        and _listed(again) == wanted,
        f"redelivery while in flight -> {_brief(again)}",
    )
    done, state = settled(world, key, "succeeded")
    outcome.check(done, f"event {state['status']}, deliveries {by_destination(state)}")
    late = post_stripe(world, {**event, "pending_webhooks": 1})
    body = late.json() if late.status_code < 300 else {}
    outcome.check(
        late.status_code == 200
        and body.get("status") == "succeeded"
        and by_destination(body) == dict.fromkeys(DESTINATIONS, "succeeded"),
        f"redelivery after -> {_brief(late)}, deliveries {by_destination(body)}",
    )
    refs = by_destination(state, "external_ref")
    with world.crm.lock:
        ledger_entry = world.crm.refs.get(delivery_key(key, "finance-flow"))
    outcome.check(
        refs["finance-flow"] == ledger_entry and bool(refs["crm"]),
        f"external refs {refs} (10 answered its ledger entry {ledger_entry})",
    )
    runs = finance_runs(world, event, at_least=1)
    outcome.check(
        [r.status for r in runs] == ["success"],
        f"{len(runs)} execution(s) of 10: {runs and runs[0].status}",
    )
    received = requests_at(world, key)
    outcome.check(received == dict.fromkeys(DESTINATIONS, 1), f"requests {received}")
    effects = effects_at(world, key)
    outcome.check(effects == dict.fromkeys(DESTINATIONS, 1), f"effects {effects}")
    outcome.tasks = effects["crm"]


def _replay(world: World, keys: list[str], destination: str) -> tuple[int, httpx.Response]:
    """`POST /v1/replays` for these keys of one destination: the dry run, then its execution.
    What the dry run would replay, and the execution's answer."""
    filters = {"destination": destination, "keys": keys, "statuses": ["failed_final"]}
    with httpx.Client(base_url=world.stack.url, headers=AUTH, timeout=30) as client:
        dry = client.post("/v1/replays", json=filters).json()
        done = client.post(
            "/v1/replays", json={**filters, "dry_run": False, "confirm": dry.get("confirm")}
        )
    return int(dry.get("to_replay", -1)), done


def ledger_refusing(world: World, key: str) -> Callable[[], None]:
    """The ledger refuses 10's booking for this delivery key (422) until the returned fix."""
    refusing = threading.Event()
    refusing.set()

    def behaviour(request_key: str, number: int) -> Reply:
        if request_key == key and refusing.is_set():
            return Reply(422, extra={"error": "account_unknown", "detail": "no ledger account"})
        return Reply()

    world.crm.behaviour = behaviour
    return refusing.clear


def fan_out_workflow_fails_for_good(world: World, outcome: Outcome) -> None:
    """The ledger refuses the booking (422) and 10 answers so: the CRM and the notifier still
    get the event once each, the event ends `partially_failed`, one dead letter (the
    finance-flow delivery's); a Stripe redelivery is answered with it and starts nothing; after
    the fix, a replay of that destination's delivery runs 10 once more, and nothing else."""
    event = stripe_event()
    # The gateway's key of a provider's event: its source, "webhook" and the event's id.
    key = derive_key(STRIPE_SOURCE, "webhook", event["id"])
    fix = ledger_refusing(world, delivery_key(key, "finance-flow"))
    first = post_stripe(world, event)
    outcome.check(
        first.status_code == 202 and first.json().get("key") == key, f"delivery -> {_brief(first)}"
    )
    done, state = settled(world, key, "partially_failed")
    statuses, errors = by_destination(state), by_destination(state, "error_code")
    outcome.check(
        done
        and statuses == {"crm": "succeeded", "finance-flow": "failed_final", "slack": "succeeded"}
        and errors["finance-flow"] == "http_422",
        f"event {state['status']}, deliveries {statuses}, finance-flow {errors['finance-flow']}",
    )
    dead = dead_letters(world, key)
    outcome.check(
        dead == [(delivery_key(key, "finance-flow"), "finance-flow", "open")],
        f"dead letters {[(d, r) for _, d, r in dead]}",
    )
    again = post_stripe(world, {**event, "pending_webhooks": 2})
    outcome.check(
        again.status_code == 200 and again.json().get("status") == "partially_failed",
        f"Stripe redelivery -> {_brief(again)}",
    )
    before = finance_runs(world, event, at_least=1)
    outcome.check(len(before) == 1, f"{len(before)} execution(s) of 10 before the replay")
    fix()
    to_replay, replayed = _replay(world, [delivery_key(key, "finance-flow")], "finance-flow")
    outcome.check(
        to_replay == 1 and replayed.status_code == 200,
        f"replay of finance-flow: dry run {to_replay} key(s), then {replayed.status_code}",
    )
    done, state = settled(world, key, "succeeded")
    outcome.check(done, f"after the replay: event {state['status']}, {by_destination(state)}")
    after = finance_runs(world, event, at_least=2)
    outcome.check(
        len(after) == 2 and all(r.status == "success" for r in after),
        f"{len(after)} execution(s) of 10 in all (one more)",
    )
    received, effects = requests_at(world, key), effects_at(world, key)
    outcome.check(
        received == {"crm": 1, "finance-flow": 2, "slack": 1},
        f"requests {received} (the ledger: the refused booking and the replayed one)",
    )
    outcome.check(effects == dict.fromkeys(DESTINATIONS, 1), f"effects {effects}")
    outcome.check(
        [r for _, _, r in dead_letters(world, key)] == ["replayed"], "the dead letter replayed"
    )
    outcome.tasks = effects["crm"]


CASES = [
    Case(
        "10 fan-out: invoice.paid + redeliveries, once per destination",
        fan_out_once_per_destination,
    ),
    Case("10 fan-out: n8n workflow fails for good, its replay", fan_out_workflow_fails_for_good),
]
