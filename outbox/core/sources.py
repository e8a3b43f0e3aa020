"""Webhook sources: a `[[sources]]` table of the routes file names a provider that must sign
its requests, how (its scheme), and where its events' id, type, external id and version are
when it posts to `/v1/webhooks/{name}`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from outbox.core import strength
from outbox.core.keys import normalize_text

STANDARD_HOW_TO = "echo whsec_$(openssl rand -base64 32)"
"""A Standard Webhooks secret of 32 random bytes, from a shell."""


SchemeName = Literal["hmac", "standard", "stripe", "github", "shopify"]

# Where each scheme's providers put the event id and type, unless the source says otherwise.
SCHEME_FIELDS: dict[str, tuple[str, str]] = {
    "hmac": ("/id", "/type"),
    "standard": ("header:webhook-id", "/type"),
    "stripe": ("/id", "/type"),
    "github": ("header:X-GitHub-Delivery", "header:X-GitHub-Event"),
    "shopify": ("header:X-Shopify-Webhook-Id", "header:X-Shopify-Topic"),
}
_HEADER = "header:"


def _check_location(value: str | None, name: str) -> None:
    """A field's place: a JSON pointer into the body ("/data/id") or a header ("header:NAME")."""
    if value is None or value.startswith("/"):
        return
    if value.startswith(_HEADER) and value[len(_HEADER) :].strip():
        return
    raise ValueError(f'`{name}` is a JSON pointer such as "/id" or "header:NAME"')


class Source(BaseModel):
    """A `[[sources]]` table: a webhook source that must sign its requests, and where its
    events' id and type are when it posts to `/v1/webhooks/{name}`."""

    # A URL or a secret may be among the input: an error names the field, never its value.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    name: Annotated[str, Field(min_length=1)]
    scheme: SchemeName = "hmac"
    # One secret, or several (a rotation: every one is accepted until it is removed).
    # Each as strong as `outbox.core.strength` asks (a `standard` one judged on its key).
    secret: str | None = None
    secrets: list[str] = Field(default_factory=list)
    # `hmac` only: the header names.
    signature_header: str = "X-Idem-Signature"
    timestamp_header: str = "X-Idem-Timestamp"
    # Unset: SIGNATURE_TOLERANCE_SECONDS.
    tolerance_seconds: int | None = Field(default=None, ge=1)
    # `/v1/webhooks/{name}`: JSON pointers into the body, or "header:NAME".
    event_id: str | None = None
    event_type: str | None = None
    external_id: str | None = None  # default: the event id
    version: str | None = None

    @model_validator(mode="after")
    def _signs_and_locates(self) -> Source:
        if not self.all_secrets:
            raise ValueError(f"source {self.name!r} needs `secret` or `secrets` (set, not empty)")
        if self.scheme != "hmac" and (
            self.signature_header != "X-Idem-Signature"
            or self.timestamp_header != "X-Idem-Timestamp"
        ):
            raise ValueError("only an `hmac` source names its own signature headers")
        for name in ("event_id", "event_type", "external_id", "version"):
            _check_location(getattr(self, name), name)
        judge = strength.standard_weakness if self.scheme == "standard" else strength.weakness
        for secret in self.all_secrets:
            reason = judge(secret)
            if reason:
                raise ValueError(
                    f"source {self.name!r}: a secret {reason}; make one with: "
                    + (STANDARD_HOW_TO if self.scheme == "standard" else strength.HOW_TO_MAKE_ONE)
                )
        return self

    @property
    def key(self) -> str:
        """The normalized name events and routes refer to."""
        return normalize_text(self.name).casefold()

    @property
    def all_secrets(self) -> tuple[str, ...]:
        found = ([self.secret] if self.secret else []) + self.secrets
        return tuple(dict.fromkeys(found))

    @property
    def event_id_at(self) -> str:
        return self.event_id or SCHEME_FIELDS[self.scheme][0]

    @property
    def event_type_at(self) -> str:
        return self.event_type or SCHEME_FIELDS[self.scheme][1]
