"""Who may send what: each source's signature check, and which routes a source may trigger.

Shared by `POST /v1/events` (the source the envelope names) and `POST /v1/webhooks/{source}`
(the source in the path). A route with `sources = [...]` runs only events of those sources; as
a source with a secret must sign every request, a route whose every source has a secret runs
only signed events, whatever other sources post.
"""

from __future__ import annotations

from outbox.core.problems import Problem
from outbox.core.routes import Route, RouteTable, Source
from outbox.core.settings import Settings
from outbox.core.tokens import parse_secrets
from outbox.ingest.provider_signatures import (
    GithubSigner,
    ShopifySigner,
    StandardSigner,
    StripeSigner,
)
from outbox.ingest.signatures import HmacSigner, Signer


def signer_for(source: Source, default_tolerance: int) -> Signer:
    """The signature check a `[[sources]]` table declares."""
    secrets = source.all_secrets
    tolerance = source.tolerance_seconds or default_tolerance
    match source.scheme:
        case "hmac":
            return HmacSigner(secrets, source.signature_header, source.timestamp_header, tolerance)
        case "standard":
            return StandardSigner(secrets, tolerance)
        case "stripe":
            return StripeSigner(secrets, tolerance)
        case "github":
            return GithubSigner(secrets)
        case "shopify":
            return ShopifySigner(secrets)


def sources(settings: Settings, routes: RouteTable) -> dict[str, Source]:
    """Every signing source by normalized name: WEBHOOK_SECRETS (scheme `hmac`), then the
    routes file's `[[sources]]` tables, which win over a name both define."""
    # Built without validation: each process checked WEBHOOK_SECRETS' strength at start
    # (`outbox.core.tokens.check_settings`), and a `Source` would ask for a scheme's format.
    found = {
        name: Source.model_construct(name=name, secrets=list(secrets))
        for name, secrets in parse_secrets(settings.webhook_secrets).items()
    }
    found.update(routes.sources)
    return found


def signers(settings: Settings, known: dict[str, Source]) -> dict[str, Signer]:
    return {
        name: signer_for(source, settings.signature_tolerance_seconds)
        for name, source in known.items()
    }


def route_for(routes: RouteTable, source: str, event_type: str) -> Route:
    """The route an event takes, refused before anything is stored when there is none (422)
    or its source may not trigger it (403)."""
    route = routes.resolve(event_type)
    if route is None:
        raise Problem(422, "no_route", f"No route accepts event type {event_type!r}.")
    if not route.allows(source):
        raise Problem(
            403,
            "source_not_allowed",
            # Names no route: who may send what is the operator's to know, not the sender's.
            "This source may not send events of this type. Nothing was stored.",
        )
    return route
