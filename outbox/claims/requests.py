"""What `/v1/claims` accepts: each endpoint's body, checked before anything is stored (a
workflow's key by the gateway's client-key rules, JSON without NaN or Infinity, a lane's
version readable), so a bad request is a 422 with nothing half written.
"""

# No `from __future__ import annotations`: FastAPI must resolve the models at definition time.

import math
from typing import Annotated, Any

from fastapi import Path
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from outbox.claims import finish, lanes
from outbox.core import keys
from outbox.core.labels import Label
from outbox.core.problems import Problem

Seconds = Annotated[int, Field(ge=1, le=3600)]


def _finite(value: Any) -> Any:
    """Refuse NaN and Infinity anywhere in a value: Python's JSON parser reads them, but they
    are not JSON, cannot be hashed canonically nor stored as jsonb (the event path refuses them
    the same way)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError("NaN and Infinity are not JSON")
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return value


# Any JSON value, without the non-standard constants.
JsonValue = Annotated[Any, AfterValidator(_finite)]


def _client_key(value: str) -> str:
    try:
        return keys.validate_client_key(value)
    except keys.InvalidKey as error:
        raise ValueError(str(error)) from error


# A key a workflow names: the gateway's rules for client keys (outbox.core.keys).
ClientKey = Annotated[str, Field(min_length=1, max_length=255), AfterValidator(_client_key)]


class ClaimRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: ClientKey
    payload: JsonValue = None
    lease_seconds: Seconds | None = None
    # Visible ASCII, at most 200 characters: they travel in headers (outbox.core.labels).
    correlation_id: Label | None = None
    workflow: Label | None = None
    # The business object the effect is about: claims of one lane hold it one at a time. Also
    # a label: printable ASCII, 1 to 200 characters (outbox.core.labels).
    lane: Label | None = None
    # An integer or an RFC 3339 timestamp (outbox.claims.lanes); read by the endpoint, so that
    # any value that is not one is the one answer `version_invalid`.
    version: JsonValue = None

    @field_validator("payload")
    @classmethod
    def _finite_payload(cls, value: Any) -> Any:
        return keys.require_finite(value)


def lane_version(body: ClaimRequest) -> lanes.Version | None:
    """The claim's version, parsed; a Problem when it names one it may not."""
    if body.version is None:
        return None
    if body.lane is None:
        raise Problem(
            422, "lane_required", "A version is compared within a lane: name the `lane` too."
        )
    try:
        if not isinstance(body.version, int | str):
            raise lanes.InvalidVersion("a version is an integer or an RFC 3339 timestamp")
        return lanes.parse_version(body.version)
    except lanes.InvalidVersion as error:
        raise Problem(422, "version_invalid", str(error)) from error


class HeartbeatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_token: str = Field(min_length=1, max_length=200)
    lease_seconds: Seconds | None = None


class CompleteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_token: str = Field(min_length=1, max_length=200)
    result: JsonValue = None
    external_ref: str | None = Field(default=None, max_length=500)

    @field_validator("result")
    @classmethod
    def _finite_result(cls, value: Any) -> Any:
        return keys.require_finite(value)


class FailRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_token: str = Field(min_length=1, max_length=200)
    error_code: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.:-]+$")
    retryable: bool
    detail: str = Field(default="", max_length=10_000)
    # Whether the side effect may exist: `none` only when the workflow knows nothing was done
    # (the downstream refused, or the request never left). Unknown makes the key uncertain.
    effect: finish.Effect = "unknown"


class DedupeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: ClientKey
    # One second to a year: how long the key counts as seen.
    ttl_seconds: int = Field(ge=1, le=31_536_000)
    correlation_id: Label | None = None
    workflow: Label | None = None


# The key in a path: held to the same rules, so a CR/LF or a control character never reaches
# the log line that names the key (masked) or the store.
KeyPath = Annotated[str, Path(min_length=1, max_length=255), AfterValidator(_client_key)]
