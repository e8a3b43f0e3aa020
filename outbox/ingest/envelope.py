"""The event envelope callers post, and how it becomes an idempotency key and payload hash."""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator
from pydantic_core import PydanticCustomError

from outbox.core import keys
from outbox.core.labels import Label, LabelOrNumber

Text = Annotated[StrictStr, Field(min_length=1, max_length=200)]
Identifier = StrictStr | StrictInt


class Envelope(BaseModel):
    """`POST /v1/events` body. Unknown members are refused so a typo cannot pass unnoticed."""

    model_config = ConfigDict(extra="forbid")

    source: Text
    event_type: Text
    external_id: Identifier
    version: Identifier | None = None
    payload: dict[str, Any]
    # Visible ASCII, at most 200 characters: they travel in headers (outbox.core.labels).
    correlation_id: Label | None = None
    workflow: Label | None = None
    execution_id: LabelOrNumber | None = None

    @field_validator("source", "event_type")
    @classmethod
    def _printable_name(cls, value: str) -> str:
        # Both reach log lines and the event type a metric label: once normalized (every run
        # of whitespace, CR/LF included, is one space), no control, format or private-use
        # character may be left (an escape sequence, a NUL, a bidi override). Any script is
        # fine: they never travel in a header.
        text = keys.normalize_text(value)
        if not text:
            raise ValueError("must contain a non-space character")
        if not text.isprintable():
            raise PydanticCustomError(
                "name_not_printable",
                "must be printable text: no control, format or private-use characters",
            )
        return value

    @field_validator("external_id", "version")
    @classmethod
    def _bounded_identifier(cls, value: str | int | None) -> str | int | None:
        if isinstance(value, str) and not (1 <= len(value) <= 1000):
            raise ValueError("must be 1 to 1000 characters")
        if isinstance(value, str) and not keys.normalize_text(value):
            raise ValueError("must contain a non-space character")
        return value

    @cached_property
    def normalized_source(self) -> str:
        return keys.normalize_text(self.source).casefold()

    @cached_property
    def normalized_event_type(self) -> str:
        return keys.normalize_text(self.event_type).casefold()

    @cached_property
    def payload_json(self) -> str:
        """The payload's canonical JSON: hashed, and stored as it is (jsonb keeps no order)."""
        return keys.canonical_json(self.payload)

    def derived_key(self, *, fold_external_id_case: bool) -> str:
        """The key built from the envelope's parts (used when no Idempotency-Key is sent)."""
        return keys.derive_key(
            self.source,
            self.event_type,
            str(self.external_id),
            None if self.version is None else str(self.version),
            fold_external_id_case=fold_external_id_case,
        )

    def payload_hash(self, *, fold_external_id_case: bool = False) -> str:
        """What a repeat must match: the business content, not per-delivery metadata.

        The ids are hashed in the same normalized form the key is derived from, so two
        spellings of one event (padding, a time zone, a folded e-mail) are one payload. The
        correlation id, workflow and execution id change from one delivery to the next (an
        n8n re-run has a new execution id) and are left out on purpose.
        """
        external_id = keys.normalize_part(str(self.external_id))
        if fold_external_id_case:
            external_id = external_id.casefold()
        version = None if self.version is None else keys.normalize_part(str(self.version))
        return keys.event_hash(
            self.normalized_source,
            self.normalized_event_type,
            external_id,
            version or None,
            self.payload_json,
        )
