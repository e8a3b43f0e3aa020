"""The soak's workflows: the claims share of the events, each delivery run the way a correct
n8n workflow uses /v1/claims when it makes the CRM call itself.

One run of a delivery:

    claim ─201─▶ uncertain? ─yes─▶ look the task up at the CRM ─found─▶ /complete (via lookup)
      │                                  │ not found
      │                     └──no────────┴─▶ create the task ─201─▶ /complete (via create)
      │                                                        │ (or crash: no answer at all)
      │                                                        ├─ no answer ─▶ /fail effect unknown
      │                                                        ├─ 503, 429 ─▶ /fail effect none
      │                                                        └─ 4xx ──────▶ /fail final, none
      ├─200 already_succeeded: done       ├─409 failed_final: done
      └─409 in_progress: claim again after Retry-After

A run that ends without a final answer (a retryable failure, a crash, a lost lease, an outage)
is delivered again later, as a provider redelivers an execution that did not answer 2xx: every
key is driven until it is final. A run never writes to the CRM with less than
`ACT_MARGIN_SECONDS` of its lease left by its own clock (counted from before the claim was
sent, so never longer than the database's lease); it heartbeats first, as the gateway's worker
fences itself. Every request carries the workflow's marker header, so the CRM can tell a
workflow's request from the gateway worker's.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from tests.chaos import plan
from tests.chaos.client import Scheduler
from tests.chaos.crm import ACTOR_HEADER, WORKFLOW, FakeCrm
from tests.chaos.plan import Delivery, PlannedEvent

# The CRM call's timeouts, as in the routes: a slow answer (2.5 s) is a lost one.
CRM_TIMEOUT = httpx.Timeout(1.0, connect=1.0)
# A CRM write starts only with this much lease left: the request reaches the CRM well inside
# it (connect timeout 1 s, plus room for a loaded machine).
ACT_MARGIN_SECONDS = 1.5
# How long /complete and /fail are retried in the same run through an outage (the soak's
# PostgreSQL is down for about 5 s) before the run gives up and the delivery comes again.
FINISH_PATIENCE_SECONDS = 15.0
# A delivery run this many times without a final answer is given up (the key then shows up
# unfinished in the checks): a bound on a loop, never reached when the gateway works.
MAX_RUNS = 80


@dataclass(frozen=True)
class Done:
    """The run got a final answer: the provider stops delivering."""

    how: str


@dataclass(frozen=True)
class Again:
    """No final answer: the provider delivers again after `delay` seconds."""

    delay: float
    why: str


@dataclass
class Call:
    """One request a workflow made to /v1/claims."""

    event: int
    endpoint: str  # claim | heartbeat | complete | fail
    started: float
    elapsed: float
    status: int | None  # None: no HTTP answer
    error: str = ""
    answer: str | None = None  # the body's `status`, or a problem's `error`
    uncertain: bool | None = None
    reclaimed: bool | None = None


@dataclass
class Ledger:
    """What the workflows did and saw, for the checks."""

    calls: list[Call] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)  # how runs ended
    final: dict[int, str] = field(default_factory=dict)  # delivery id -> Done.how
    completed_via: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    # key -> (error_code, retryable, effect) of every accepted /fail
    declared: dict[str, list[tuple[str, bool, str]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    abandoned: set[str] = field(default_factory=set)
    # key -> ("complete", via) or ("fail", (error_code, retryable, effect)) of every /complete
    # or /fail whose answer was lost (no answer, or a 503 after which it was not accepted
    # again): it may have landed. A later claim that finds the key final tells that it did.
    unconfirmed: dict[str, list[tuple[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    # (check, detail) for what a workflow saw that breaks the contract
    problems: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def problem(self, check: str, detail: str) -> None:
        with self.lock:
            self.problems.append((check, detail))

    def outcome(self, how: str) -> None:
        with self.lock:
            self.outcomes[how] += 1

    def confirm(self, key: str, endpoint: str) -> None:
        """The key was found final (`complete`: succeeded, `fail`: failed_final) although no
        such call of ours was answered 200: the one whose answer was lost landed. Only a
        workflow finishes a claims key, so it was one of ours (the first of them, if several:
        the later ones met a finished key)."""
        with self.lock:
            lost = [detail for kind, detail in self.unconfirmed.pop(key, []) if kind == endpoint]
            if endpoint == "complete" and lost and not self.completed_via[key]:
                self.completed_via[key].append(lost[0])
            final = [d for d in lost if endpoint == "fail" and not d[1]]
            declared = self.declared[key]
            if final and (not declared or declared[-1][1]):
                declared.append(final[0])


class Workflows(Scheduler):
    """Runs the claims deliveries: each is a workflow run against the receiver's /v1/claims
    (with the bearer `token`) and the fake CRM under `/wf/<collection>`."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        crm: FakeCrm,
        deliveries: list[Delivery],
        token: str,
        seed: int,
        threads: int = 12,
    ) -> None:
        super().__init__(deliveries, threads, "workflow", base_url)
        self.crm = crm
        self.headers = {"Authorization": f"Bearer {token}"}
        self.ledger = Ledger()
        self.runs: Counter[int] = Counter()  # delivery id -> runs so far
        self.known: dict[int, threading.Event] = {
            d.event.index: threading.Event() for d in deliveries
        }
        self._crashed: set[str] = set()
        self._crash_lock = threading.Lock()
        self._rng = random.Random(f"workflows:{seed}")

    # -- the provider's side: deliver, and deliver again until a final answer ---------------

    def deliver(self, delivery_id: int) -> None:
        delivery = self.deliveries[delivery_id]
        if delivery.kind == plan.CONFLICT and not self.known[delivery.event.index].is_set():
            # The other payload must come second, or it would be the first payload.
            self.requeue(delivery_id, 1.0)
            return
        self.runs[delivery_id] += 1
        try:
            outcome = self._run(delivery.event, delivery.body)
        except Exception as error:  # a bug of the soak is reported, never a silent stop
            self.ledger.problem("workflow_crashed", f"event {delivery.event.index}: {error!r}")
            outcome = Done(f"soak_error:{type(error).__name__}")
        if isinstance(outcome, Again) and self.runs[delivery_id] < MAX_RUNS:
            self.ledger.outcome(outcome.why)
            self.requeue(delivery_id, outcome.delay)
            return
        how = outcome.how if isinstance(outcome, Done) else f"gave_up:{outcome.why}"
        self.ledger.outcome(how)
        self.ledger.final[delivery_id] = how
        self.finished(delivery_id)

    # -- one workflow run -------------------------------------------------------------------

    def _run(self, event: PlannedEvent, body: dict[str, Any]) -> Done | Again:
        before_claim = time.monotonic()
        status, answer, headers = self._call(event, "claim", "", body)
        if status is None or status == 503:
            return Again(_retry_after(headers), "claim_unanswered")
        state = _state(answer)
        if status in (200, 201, 409) or state == "idempotency_key_reused":
            self.known[event.index].set()
        if status == 200 and state == "already_succeeded":
            self.ledger.confirm(event.key, "complete")
            return Done("already_succeeded")
        if status == 409 and state == "in_progress":
            return Again(_retry_after(headers), "in_progress")
        if status == 409 and state in ("failed_final", "quarantined"):
            self.ledger.confirm(event.key, "fail")
            return Done(str(state))
        if status == 422 and state == "idempotency_key_reused":
            return Done("conflict_refused")
        if status != 201:
            self.ledger.problem("unexpected_claim_answer", f"{event.key}: {status} {state}")
            return Done(f"unexpected:{status}:{state}")

        token = str(answer["lease_token"])
        deadline = before_claim + event.lease_seconds
        uncertain = answer.get("uncertain")
        if not isinstance(uncertain, bool):
            self.ledger.problem(
                "claim_without_uncertain_flag", f"{event.key}: 201 {sorted(answer)}"
            )
            uncertain = True  # look before acting, whatever the answer left out
        effects = self.crm.effects_of(event.key)
        if not uncertain and effects:
            self.ledger.problem(
                "claim_not_uncertain",
                f"{event.key}: 201 uncertain=false (attempt {answer.get('attempt')},"
                f" reclaimed={answer.get('reclaimed')}) with {effects} effect(s) at the CRM",
            )

        if uncertain:
            found = self._lookup(event)
            if found is None:
                return self._fail(event, token, "crm_lookup_failed", True, "unknown")
            if found:
                return self._complete(event, token, found, "lookup")

        for _ in range(3):
            if time.monotonic() < deadline - ACT_MARGIN_SECONDS:
                return self._create(event, token)
            renewed = self._heartbeat(event, token)
            if renewed is None:
                break
            deadline = renewed
        # The lease may be gone, or too short to act in: acting now could race its next holder.
        return Again(1.0, "lease_short_before_act")

    def _create(self, event: PlannedEvent, token: str) -> Done | Again:
        collection = plan.COLLECTIONS[event.event_type]
        crm = self.client(self.crm.url, timeout=CRM_TIMEOUT)
        try:
            response = crm.post(
                f"/wf/{collection}",
                json=event.payload,
                headers={"Idempotency-Key": event.key, ACTOR_HEADER: WORKFLOW},
            )
        except httpx.HTTPError as error:
            # Sent, maybe done: the answer is lost.
            self.drop_client(self.crm.url)
            return self._fail(event, token, f"crm_{type(error).__name__}", True, "unknown")
        code = response.status_code
        if code == 201:
            ref = str(response.json()["id"])
            if event.abandon and self._crash_once(event.key):
                # The workflow's process dies here: no /complete, no /fail. The lease runs
                # out and a later delivery reclaims the key, uncertain.
                return Again(event.lease_seconds + self._rng.uniform(0.5, 3.0), "abandoned")
            return self._complete(event, token, ref, "create")
        if code in (429, 503):
            return self._fail(event, token, f"crm_{code}", True, "none", _retry_after(response))
        if 400 <= code < 500:
            return self._fail(event, token, f"crm_{code}", False, "none")
        # 500, 502, 504: the CRM may have done it.
        return self._fail(event, token, f"crm_{code}", True, "unknown")

    def _crash_once(self, key: str) -> bool:
        with self._crash_lock:
            if key in self._crashed:
                return False
            self._crashed.add(key)
            self.ledger.abandoned.add(key)
            return True

    def _lookup(self, event: PlannedEvent) -> str | None:
        """The task's id when the CRM has it, "" when it has not, None when it did not say."""
        collection = plan.COLLECTIONS[event.event_type]
        crm = self.client(self.crm.url, timeout=CRM_TIMEOUT)
        try:
            response = crm.get(
                f"/wf/{collection}/by-key/{quote(event.key, safe='')}",
                headers={ACTOR_HEADER: WORKFLOW},
            )
        except httpx.HTTPError:
            self.drop_client(self.crm.url)
            return None
        if response.status_code == 200:
            return str(response.json()["id"])
        return "" if response.status_code == 404 else None

    # -- the claims API ---------------------------------------------------------------------

    def _heartbeat(self, event: PlannedEvent, token: str) -> float | None:
        """Extend the lease by a full term; the new deadline by our clock (counted from
        before the request, so never past the database's), None when it was not renewed."""
        sent = time.monotonic()
        status, _, _ = self._call(
            event,
            "heartbeat",
            "/heartbeat",
            {"lease_token": token, "lease_seconds": event.lease_seconds},
        )
        return sent + event.lease_seconds if status == 200 else None

    def _complete(self, event: PlannedEvent, token: str, ref: str, via: str) -> Done | Again:
        body = {"lease_token": token, "result": {"task_id": ref, "via": via}, "external_ref": ref}
        status, answer, lost = self._finish(event, "complete", body)
        if lost and status != 200:
            with self.ledger.lock:
                self.ledger.unconfirmed[event.key].append(("complete", via))
        if status == 200:
            with self.ledger.lock:
                self.ledger.completed_via[event.key].append(via)
            return Done(f"completed_via_{via}")
        # lease_lost (another run holds the key, or this one's answer was lost and it is done):
        # the next delivery finds out which.
        return Again(1.0, f"complete_{answer or status}")

    def _fail(
        self,
        event: PlannedEvent,
        token: str,
        error_code: str,
        retryable: bool,
        effect: str,
        delay: float = 1.0,
    ) -> Done | Again:
        body = {
            "lease_token": token,
            "error_code": error_code,
            "retryable": retryable,
            "detail": f"CRM call: {error_code}",
            "effect": effect,
        }
        status, answer, lost = self._finish(event, "fail", body)
        if lost and status != 200:
            with self.ledger.lock:
                self.ledger.unconfirmed[event.key].append(("fail", (error_code, retryable, effect)))
        if status == 200:
            with self.ledger.lock:
                self.ledger.declared[event.key].append((error_code, retryable, effect))
            if not retryable:
                return Done("failed_final")
            # The provider's backoff before it delivers the failed execution again.
            return Again(max(delay, self._rng.uniform(0.5, 2.0)), "failed_retryable")
        return Again(1.0, f"fail_{answer or status}")

    def _finish(
        self, event: PlannedEvent, endpoint: str, body: dict[str, Any]
    ) -> tuple[int | None, str | None, bool]:
        """/complete or /fail, retried through an outage (503, no answer) for a while; the
        last answer, and whether an earlier one was lost (the call may have landed: a 503 can
        come from a receiver whose database answer went missing after it committed)."""
        give_up = time.monotonic() + FINISH_PATIENCE_SECONDS
        lost = False
        while True:
            status, answer, headers = self._call(event, endpoint, f"/{endpoint}", body)
            if status is None or status == 503:
                lost = True
            if (status is not None and status != 503) or time.monotonic() > give_up:
                return status, _state(answer), lost
            time.sleep(_retry_after(headers))

    def _call(
        self, event: PlannedEvent, endpoint: str, suffix: str, body: dict[str, Any]
    ) -> tuple[int | None, dict[str, Any], httpx.Headers]:
        """POST to the claims API; (status or None, JSON body, headers), recorded."""
        path = "/v1/claims" + (f"/{quote(event.key, safe='')}{suffix}" if suffix else "")
        started = self.now()
        call = Call(event.index, endpoint, started, 0.0, None)
        self.ledger.calls.append(call)
        base_url = self.receiver()
        try:
            response = self.client(base_url).post(path, json=body, headers=self.headers)
        except httpx.HTTPError as error:
            call.elapsed = self.now() - started
            call.error = type(error).__name__
            self.drop_client(base_url)
            return None, {}, httpx.Headers()
        call.elapsed = self.now() - started
        call.status = response.status_code
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        if not isinstance(answer, dict):
            answer = {}
        call.answer = _state(answer)
        call.uncertain = answer.get("uncertain")
        call.reclaimed = answer.get("reclaimed")
        return response.status_code, answer, response.headers


def _retry_after(source: httpx.Response | httpx.Headers) -> float:
    """Retry-After in seconds (delta-seconds; the receiver sends no dates), else 1."""
    headers = source.headers if isinstance(source, httpx.Response) else source
    try:
        return max(0.2, float(headers.get("retry-after") or 1))
    except ValueError:
        return 1.0


def _state(answer: dict[str, Any]) -> str | None:
    """What an answer says: a problem's machine code (`error`; its `status` is the HTTP
    code), else the claims API's `status`."""
    value = answer.get("error") or answer.get("status")
    return str(value) if value is not None else None
