"""Generated hostile strings in every field and header of each endpoint that takes a sender's
input, through the real receiver: lone surrogates, control characters, CR/LF, NUL, bidi
overrides and non-ASCII text. Whatever is sent, the answer is never a 5xx; a 4xx is a problem
document with a code, and after a 4xx nothing more is stored than before.

The OpenAPI fuzz run (test_fuzz.py) generates valid Unicode only; these strategies are the
ones it cannot produce."""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

import httpx
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from outbox.ingest.provider_signatures import sign_standard, sign_stripe
from outbox.ingest.signatures import sign_v2
from tests.support import AUTH, PROVIDER_SECRETS, WEBHOOK_SECRET, Stack, query

# The pieces that have broken gateways: lone surrogates (both halves, either case of the
# escape), C0 and C1 controls, line and paragraph separators, a bidi override, non-ASCII.
HOSTILE = [
    "\ud800",
    "\udfff",
    "\udbff\udbff",
    "\x00",
    "\r\n",
    "\n",
    "\r",
    "\t",
    "\x1b[2J",
    "\x7f",
    "\x85",
    "\x9b",
    "\u2028",
    "\u202e",
    "\ufeff",
    "é",
    "日本",
    "😀",
    " ",
]
hostile = st.lists(
    st.one_of(st.sampled_from(HOSTILE), st.text(max_size=4)), min_size=1, max_size=4
).map("".join)
# Header values as bytes (what the wire carries): the client refuses CR, LF and NUL itself.
header_value = st.lists(
    st.one_of(st.sampled_from([b"\t", b"\x1b", b"\x7f", b"\xe9", b"\xff", b" "]), st.binary()),
    min_size=1,
    max_size=4,
).map(b"".join)

FUZZ = settings(
    max_examples=15,
    deadline=None,
    # One stack for the test: each example counts rows before and after itself.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# uvicorn's answer to a request its parser refuses (a control byte in a header value).
SERVER_REFUSAL = "Invalid HTTP request received."
COUNTS = (
    "SELECT (SELECT count(*) FROM idempotency_keys), (SELECT count(*) FROM events),"
    " (SELECT count(*) FROM outbox), (SELECT count(*) FROM replays),"
    " (SELECT count(*) FROM route_state WHERE paused)"
)


def _json(document: Any) -> bytes:
    # ensure_ascii (the default) writes a lone surrogate as its escape, as a sender would.
    return json.dumps(document).encode("ascii")


def _path(text: str) -> str:
    """`text` as one percent-encoded path segment (a surrogate as its would-be UTF-8 bytes)."""
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


def _send(
    stack: Stack, method: str, path: str, body: bytes | None, headers: dict[str, Any]
) -> None:
    """Send the request and hold the answer to the rules in the module docstring."""
    before = query(stack.database_url, COUNTS)
    try:
        with stack.client() as client:
            answer = client.request(
                method,
                path,
                content=body,
                headers={"content-type": "application/json", **headers},
            )
    except httpx.LocalProtocolError:
        reject()  # the client would not send it; no server ever sees it
    assert answer.status_code < 500, (path, answer.status_code, answer.text)
    if answer.text == SERVER_REFUSAL:
        # The HTTP server's parser refused a control byte in a header: the app never saw it.
        assert answer.status_code == 400
    elif answer.status_code >= 400:
        assert query(stack.database_url, COUNTS) == before, answer.text
        if answer.status_code == 409 and answer.headers["content-type"] == "application/json":
            # The claims API's documented states for an IF node (lease_lost, in_progress).
            assert answer.json()["status"], answer.text
            return
        assert answer.headers["content-type"] == "application/problem+json", answer.text
        assert answer.json()["error"], answer.text


ENVELOPE_MEMBERS = [
    "source",
    "event_type",
    "external_id",
    "version",
    "correlation_id",
    "workflow",
    "execution_id",
]


@FUZZ
@given(
    member=st.sampled_from(ENVELOPE_MEMBERS),
    value=hostile,
    payload_key=hostile,
    payload_value=hostile,
    signed=st.booleans(),
)
def test_events_envelope_members_and_payload(
    stack: Stack, member: str, value: str, payload_key: str, payload_value: str, signed: bool
) -> None:
    """Any member, any payload key or value: never a 5xx, nothing stored on a 4xx."""
    document = {
        "source": "signed" if signed else "webform",
        "event_type": "crm.lead.created",
        "external_id": "fuzz-1",
        "payload": {payload_key: payload_value, "n": [payload_value]},
        member: value,
    }
    body = _json(document)
    headers = {}
    if signed:
        stamp = int(time.time())
        headers = {
            "X-Idem-Timestamp": str(stamp),
            "X-Idem-Signature": sign_v2(WEBHOOK_SECRET, stamp, "", body),
        }
    _send(stack, "POST", "/v1/events", body, headers)


@FUZZ
@given(
    name=st.sampled_from(["Idempotency-Key", "X-Idem-Signature", "X-Idem-Timestamp"]),
    value=header_value,
    signed=st.booleans(),
)
def test_events_headers(stack: Stack, name: str, value: bytes, signed: bool) -> None:
    """The key and signature headers with any bytes: never a 5xx, nothing stored on a 4xx."""
    body = _json(
        {
            "source": "signed" if signed else "webform",
            "event_type": "crm.lead.created",
            "external_id": "fuzz-h",
            "payload": {},
        }
    )
    stamp = int(time.time())
    headers: dict[str, Any] = {
        "X-Idem-Timestamp": str(stamp),
        "X-Idem-Signature": sign_v2(WEBHOOK_SECRET, stamp, "", body),
        name: value,
    }
    _send(stack, "POST", "/v1/events", body, headers)


@FUZZ
@given(
    where=st.sampled_from(["type", "data.id", "data.name", "key", "webhook-id", "path"]),
    value=hostile,
)
def test_signed_provider_webhook_fields(stack: Stack, where: str, value: str) -> None:
    """A correctly signed Standard Webhooks delivery with a hostile event type, body value,
    member name, message id or source path: never a 5xx, nothing stored on a 4xx."""
    document: dict[str, Any] = {"type": "invoice.paid", "data": {"id": "in_1", "name": "x"}}
    message_id = "msg_fuzz"
    source = "acme"
    if where == "type":
        document["type"] = value
    elif where.startswith("data."):
        document["data"][where.removeprefix("data.")] = value
    elif where == "key":
        document["data"][value] = 1
    elif where == "webhook-id":
        message_id = value
    else:
        source = value
    body = _json(document)
    stamp = int(time.time())
    try:
        message_id.encode("latin-1")
    except UnicodeEncodeError:
        reject()  # not a header value any client can send
    headers = {
        "webhook-id": message_id.encode("latin-1"),
        "webhook-timestamp": str(stamp),
        "webhook-signature": sign_standard(PROVIDER_SECRETS["acme"][1], message_id, stamp, body),
    }
    _send(stack, "POST", f"/v1/webhooks/{_path(source)}", body, headers)


@FUZZ
@given(value=header_value, document=st.dictionaries(hostile, hostile, max_size=2))
def test_provider_signature_header_and_body(
    stack: Stack, value: bytes, document: dict[str, str]
) -> None:
    """Stripe's signature header with any bytes, over a body of hostile members: never a
    5xx; a body that is signed but not keyable is a 4xx with nothing stored."""
    body = _json({"id": "evt_fuzz", "type": "payment_intent.succeeded", **document})
    for signature in (value, sign_stripe(PROVIDER_SECRETS["stripe"][1], int(time.time()), body)):
        _send(stack, "POST", "/v1/webhooks/stripe", body, {"Stripe-Signature": signature})


CLAIM_MEMBERS = ["key", "correlation_id", "workflow", "payload", "lease_seconds", "member"]


@FUZZ
@given(member=st.sampled_from(CLAIM_MEMBERS), value=hostile, dedupe=st.booleans())
def test_claims_and_dedupe_members(stack: Stack, member: str, value: str, dedupe: bool) -> None:
    """A claim or a dedupe with any member hostile (or a hostile member name): never a 5xx,
    nothing stored on a 4xx."""
    document: dict[str, Any] = {"key": "fuzz-claim"}
    if dedupe:
        document["ttl_seconds"] = 60
    if member == "payload":
        document["payload"] = {value: value}
    elif member == "member":
        document[value] = 1
    else:
        document[member] = value
    path = "/v1/claims/dedupe" if dedupe else "/v1/claims"
    _send(stack, "POST", path, _json(document), {})


@FUZZ
@given(
    action=st.sampled_from(["heartbeat", "complete", "fail"]),
    key=hostile,
    field=st.sampled_from(["lease_token", "result", "external_ref", "error_code", "detail"]),
    value=hostile,
)
def test_claim_steps_path_and_body(
    stack: Stack, action: str, key: str, field: str, value: str
) -> None:
    """A claim's next step with a hostile key in the path or a hostile body member: never a
    5xx, nothing changed on a 4xx."""
    document: dict[str, Any] = {"lease_token": "t"}
    if action == "fail":
        document.update(error_code="e", retryable=True)
    document[field] = {value: value} if field == "result" else value
    _send(stack, "POST", f"/v1/claims/{_path(key)}/{action}", _json(document), {})


@FUZZ
@given(
    field=st.sampled_from(["keys", "event_type", "source", "since", "statuses", "operator"]),
    value=hostile,
    header=header_value,
)
def test_operator_replay_and_pause(stack: Stack, field: str, value: str, header: bytes) -> None:
    """A replay dry run with a hostile filter, a pause with a hostile reason, and any bytes in
    X-Operator: never a 5xx, nothing recorded or paused on a 4xx."""
    operator = {**AUTH, "X-Operator": header if field == "operator" else b"ops"}
    replay = {field: [value] if field in ("keys", "statuses") else value}
    if field == "operator":
        replay = {"statuses": ["failed_final"]}
    _send(stack, "POST", "/v1/replays", _json(replay), operator)
    _send(stack, "POST", "/v1/routes/crm/pause", _json({"reason": value}), operator)


@FUZZ
@given(name=st.sampled_from(["event_type", "source", "since", "until", "kind"]), value=hostile)
def test_operator_query_parameters(stack: Stack, name: str, value: str) -> None:
    """The dead-letter list's filters with hostile text (percent-encoded): never a 5xx."""
    _send(stack, "GET", f"/v1/dead-letters?{name}={_path(value)}", None, AUTH)
