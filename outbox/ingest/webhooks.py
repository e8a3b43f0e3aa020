"""`POST /v1/webhooks/{source}`: a provider's own request, taken in directly and durably.

Stripe, GitHub, Shopify or any Standard Webhooks sender points at the gateway instead of at an
n8n workflow, so a workflow that is down or busy no longer loses events: the gateway answers
within milliseconds (it never runs the route first) and hands each event to its route once.

The request is checked by the source's scheme over the exact bytes received, then parsed. The
event id and type are read where the source says (a JSON pointer into the body, or a header);
the key is `<source>:webhook:<sha256>` of the source, the event id and the version, so the
provider's retries and manual resends are repeats, answered 200 with the first answer. A repeat
is recognized by the event's identity (source, id, version and type), not by its bytes: a
provider may change per-delivery fields between attempts (Stripe's `pending_webhooks`), and the
body kept is the first delivery's. The stored payload is the provider's body, so the route's
action gets exactly what the provider sent. An `Idempotency-Key` header plays no part here.

The path is public, so its refusals tell a stranger nothing: a source that is not configured,
and a signature that is missing, stale or wrong, all get the same 401 `invalid_signature` (same
body, same headers), after the body was read within the same limit. Which of them it was goes
to the log, for the operator.
"""

# No `from __future__ import annotations`: FastAPI must resolve the signature at definition time.

import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.core import contract, keys
from outbox.core.jsonbody import parse_json, resolve_pointer
from outbox.core.logs import get_logger
from outbox.core.problems import Problem, json_response, problem_responses
from outbox.core.routes import Route, RouteTable, Source
from outbox.core.settings import Settings
from outbox.ingest import admission, fanout, intake, lanes
from outbox.ingest.answers import respond
from outbox.ingest.fastpath import read_body
from outbox.ingest.metrics import EventCounters
from outbox.ingest.signatures import Signer, unauthorized

WEBHOOKS_PATH = "/v1/webhooks/{source}"
# The same bounds as the envelope's members: ids up to 1000 characters, types up to 200.
_LIMITS = {"event_id": 1000, "event_type": 200, "external_id": 1000, "version": 1000}
_HEADER = "header:"

log = get_logger(__name__)


def not_signed_by_source() -> Problem:
    """The one answer to an unknown source and to any signature failure of a known one, so the
    answer does not say which sources are configured or which scheme a source uses."""
    return unauthorized(
        "invalid_signature",
        "The request is not signed by this source (signature missing, stale or not matching).",
    )


def read_field(location: str, document: Any, headers: Mapping[str, str]) -> str | None:
    """The text at `location` ("header:NAME" or a JSON pointer): a non-blank string or an
    integer, normalized; None when it is absent or anything else."""
    if location.startswith(_HEADER):
        value: Any = headers.get(location[len(_HEADER) :].strip().lower())
    else:
        value = resolve_pointer(document, location)
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    return keys.normalize_text(str(value)) or None


def _required(name: str, location: str, document: Any, headers: Mapping[str, str]) -> str:
    value = read_field(location, document, headers)
    if value is None or len(value) > _LIMITS[name]:
        raise Problem(
            400,
            f"missing_{name}",
            f"No {name.replace('_', ' ')} at {location!r}: a non-empty string (at most "
            f"{_LIMITS[name]} characters) or an integer is expected there. Nothing was stored.",
            location=location,
        )
    return value


def provider_event(
    source: Source, headers: Mapping[str, str], body: bytes, routes: RouteTable
) -> tuple[intake.NewEvent, Route]:
    """The event a verified provider request carries, and the route it takes."""
    try:
        document = parse_json(body)
    except keys.NumberOutOfRange as error:
        raise Problem(400, "invalid_json", f"The body cannot be stored: {error}.") from error
    if not isinstance(document, dict):
        raise Problem(400, "invalid_json", "The body is not a JSON object.")
    event_id = _required("event_id", source.event_id_at, document, headers)
    event_type = _required("event_type", source.event_type_at, document, headers).casefold()
    if not event_type.isprintable():
        # It reaches log lines and a metric label (outbox.ingest.envelope says the same).
        raise Problem(
            400,
            "invalid_event_type",
            f"The event type at {source.event_type_at!r} holds a control, format or "
            "private-use character. Nothing was stored.",
            location=source.event_type_at,
        )
    external_id = event_id
    if source.external_id is not None:
        external_id = read_field(source.external_id, document, headers) or event_id
    version = None
    if source.version is not None:
        version = read_field(source.version, document, headers)
    route = admission.route_for(routes, source.key, event_type)
    stored_version = None if version is None else version[: _LIMITS["version"]]
    where = lanes.place(
        route,
        document,
        external_id[: _LIMITS["external_id"]],
        stored_version,
        source=source.key,
        shared=route.sources is not None,
    )
    key = keys.derive_key(source.key, "webhook", event_id, version)
    stored_external_id = external_id[: _LIMITS["external_id"]]
    event = intake.NewEvent(
        key=key,
        payload_hash=keys.event_hash(source.key, event_type, event_id, version, "null"),
        correlation_id=uuid.uuid4().hex,
        source=source.key,
        event_type=event_type,
        external_id=external_id[: _LIMITS["external_id"]],
        version=stored_version,
        payload_json=keys.canonical_json(document),
        route=route.label,
        ttl_seconds=route.ttl_seconds,
        workflow_name=None,
        execution_id=None,
        contract_violations=tuple(contract.violations(route, document)),
        lane=None if where is None else where.lane,
        lane_rank=None if where is None else where.rank,
        deliveries=fanout.plan(
            routes, route, key, document, stored_external_id, stored_version, source.key
        ),
    )
    return event, route


SourcePath = Annotated[str, Path(min_length=1, max_length=200, examples=["stripe"])]


WebhookHandler = Callable[[str, Request], Awaitable[JSONResponse]]


def webhook_ingest(
    settings: Settings,
    routes: RouteTable,
    known: dict[str, Source],
    signers: dict[str, Signer],
    engine: Callable[[], AsyncEngine],
    database: Callable[[Any], Any],
    metrics: EventCounters,
) -> WebhookHandler:
    """The provider endpoint's handler; `database(awaitable)` maps an outage to a 503. The
    receiver's app calls it ahead of the framework (outbox/ingest/fastpath.py)."""

    async def post_webhook(source: SourcePath, request: Request) -> JSONResponse:
        """Take a provider's signed webhook as it was sent; repeats answer 200."""
        body = await read_body(request, settings.max_body_bytes)
        name = keys.normalize_text(source).casefold()
        config = known.get(name)
        if config is None:
            log.info("webhook.refused", source=None, reason="source_not_found")
            raise not_signed_by_source()
        try:
            signers[name].verify(request.headers, body)
        except Problem as refused:
            log.info("webhook.refused", source=config.key, reason=refused.error)
            raise not_signed_by_source() from None
        event, _ = provider_event(config, request.headers, body, routes)
        outcome = await database(intake.accept(engine(), event))
        return respond(outcome, event, metrics, repeat_status=200)

    return post_webhook


def webhooks_router(handler: WebhookHandler) -> APIRouter:
    """The endpoint as declared for OpenAPI (and for requests the shortcut does not take)."""
    router = APIRouter(tags=["webhooks"])
    router.add_api_route(
        WEBHOOKS_PATH,
        handler,
        methods=["POST"],
        status_code=202,
        responses={
            200: json_response("A repeat of a known event (a provider's retry): the first answer"),
            202: json_response("Accepted: a new event, committed with its outbox row"),
            **problem_responses(400, 401, 403, 413, 422, 503),
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"type": "object"}}},
            }
        },
    )
    return router
