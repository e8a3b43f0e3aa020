"""Acting settings: what the worker does with a key, shared by routes and destinations.

A route that acts itself carries them (`outbox.core.routes.Route`), and so does each destination
of a fan-out route (`outbox.core.routes.Destination`): a delivery to a destination is a key of
its own, and the worker runs it with the destination's settings, found by the label the key
was stored with.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    model_validator,
)

from outbox.core import standard_webhooks, strength

# Keys live 30 days by default: longer than any provider's redelivery window we know of.
DEFAULT_TTL_SECONDS = 30 * 86_400


class ActionSettings(BaseModel):
    """What acts on an event and how: the action, its retries, limits, circuit and lanes.

    A `[[routes]]` table that acts itself is one (`Route`); so is each `[[destinations]]` table
    a fan-out route delivers to (`Destination`). The worker reads only these settings, by the
    label a key was stored with."""

    # A URL or a secret may be among the input: an error names the field, never its value.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    name: str = ""
    action: Literal["noop", "http", "python"]
    # What answers the route's requests: `n8n` reads n8n's own answers (worker/errors.py): a
    # 404 "webhook is not registered" is transient for `n8n_unregistered_grace_seconds` after
    # the key's first failure (n8n answers so while a workflow is being re-published and while
    # it starts: five minutes covers both), then permanent.
    kind: Literal["generic", "n8n"] = "generic"
    n8n_unregistered_grace_seconds: float = Field(default=300.0, gt=0, le=86_400)

    # `http` action.
    url: str | None = None
    method: Literal["POST", "PUT", "PATCH"] = "POST"
    headers: dict[str, str] = Field(default_factory=dict)
    connect_timeout_seconds: float = Field(default=5.0, gt=0)
    read_timeout_seconds: float = Field(default=10.0, gt=0)
    # RFC 6901 pointer into the response JSON naming the downstream's id for the effect.
    external_ref_pointer: str | None = None
    # Asked before acting again after an uncertain outcome: a GET whose 200 means "the effect
    # exists" and 404 "it does not". `{key}` and `{external_id}` are filled in, URL-encoded.
    reconcile_url: str | None = None
    # Where the reference is in the reconcile answer; defaults to external_ref_pointer.
    reconcile_external_ref_pointer: str | None = None
    # Standard Webhooks secrets (`whsec_` + base64, usually "${ENV}"): every request the worker
    # sends on this route (action and reconcile) is signed with each, so the downstream can
    # tell the gateway from a stranger. Several during a rotation. Kept as SecretStr: a
    # route's repr, dump or validation error never shows them.
    signing_secret: SecretStr | None = None
    signing_secrets: list[SecretStr] = Field(default_factory=list)

    # Added to a request's connect plus read timeout (or a python action's time limit) for how
    # long it may still reach the downstream after its attempt gave up on it: a slow link or a
    # busy server applies it late. No one else may act on the key before that
    # (docs/explanation/architecture.md, "The in-flight rule").
    in_flight_margin_seconds: float = Field(default=2.0, ge=0, le=600)

    # The hard limit of one attempt's action, whatever the action: past it the attempt is
    # uncertain, its lease is given up and its late result is fenced out. Unset: three leases
    # (LEASE_SECONDS x 3), long enough for any call the lease keeper renews for, short enough
    # that a hung action frees its key within minutes.
    timeout_seconds: float | None = Field(default=None, gt=0)

    # `python` action: "package.module:function".
    function: str | None = None
    # An exception the function did not raise on purpose: retried (a blip) or not (a bug).
    unexpected_error: Literal["transient", "permanent"] = "transient"

    # Retry budget for transient failures.
    max_attempts: int = Field(default=8, ge=1)
    backoff_base_seconds: float = Field(default=1.0, gt=0)
    backoff_cap_seconds: float = Field(default=300.0, gt=0)
    # A request that never reached anything that could act (a refused connection, a name that
    # does not resolve, a TLS handshake that failed, n8n's "webhook not registered") spends no
    # attempt; its key asks again after half of this to all of it, so a downstream that comes
    # back from a restart or a deploy is noticed within seconds (worker/errors.py, `not_sent`).
    not_sent_retry_seconds: float = Field(default=5.0, gt=0, le=300)
    # Stop retrying six hours after the first failure: long enough to ride out a downstream's
    # restart, deploy or outage with nothing spent (above), short enough that a person looks
    # the same day. Sent failures end sooner, at `max_attempts`.
    retry_deadline_seconds: float = Field(default=21_600.0, gt=0)

    # Protecting the downstream (see docs/explanation/architecture.md, "Routes under load"), shared
    # by every worker process and machine through PostgreSQL. Unset limits mean none.
    # Attempts running at once for this route, across all workers.
    max_in_flight: int | None = Field(default=None, ge=1, le=1000)
    # Requests per second, evenly spaced; `burst` of them may go at once after a quiet spell.
    rate_per_second: float | None = Field(default=None, gt=0, le=10_000)
    burst: int = Field(default=1, ge=1, le=10_000)
    # The circuit breaker judges the route by its recent calls, never one key by itself (see
    # docs/explanation/reliability.md). It opens when, over the last `circuit_window_seconds`, at
    # least `circuit_minimum_calls` calls reached the downstream and `circuit_failure_rate` of them
    # failed transiently, from three different keys or more; or at once on a 429/503 whose
    # Retry-After is longer than backoff_cap_seconds. After the cool-down it is half-open:
    # `circuit_half_open_calls` trial calls from different keys; one answer closes it, that
    # many failures re-open it with the cool-down doubled (up to the cap; reset on close).
    # Half of the calls failing over 30 s, with 20 calls at least: a blip, a slow spell or one
    # key the downstream always refuses stays well below it; an outage reaches it within a
    # few seconds at any real traffic.
    circuit_failure_rate: float = Field(default=0.5, gt=0, le=1)
    circuit_minimum_calls: int = Field(
        default=20,
        ge=1,
        # The earlier name (it counted failures in a row); read as the minimum of calls.
        validation_alias=AliasChoices("circuit_minimum_calls", "circuit_failure_threshold"),
    )
    circuit_window_seconds: float = Field(default=30.0, gt=0, le=3600)
    # Three trials: one key the downstream refuses cannot keep the circuit open by itself.
    circuit_half_open_calls: int = Field(default=3, ge=1, le=100)
    # Ten seconds: short enough that a blip is over in one round of trials, long enough to
    # spare a downstream that is restarting; five minutes at most, like the backoff cap.
    circuit_cooldown_seconds: float = Field(default=10.0, gt=0)
    circuit_cooldown_cap_seconds: float = Field(default=300.0, gt=0)

    # Ordering lanes (docs/explanation/architecture.md, "Lanes"). `order_by` names each event's
    # lane: a JSON pointer into the payload ("/contact/id") or "external_id". Events of one lane are
    # acted on one at a time, in lane order: their version with `versions = "supersede"`
    # (compared as `version_format`: integers, or RFC 3339 timestamps), else the order of
    # acceptance. Under supersede a version not newer than the lane's applied one, or older
    # than one waiting, is recorded `superseded` and never acted on. `lane_on_failure`: a
    # dead letter holds its lane until it is replayed or discarded (`block`), or the lane goes
    # on (`skip`); one whose effect is unknown holds it under both (the in-flight rule).
    order_by: str | None = None
    versions: Literal["supersede"] | None = None
    version_format: Literal["integer", "timestamp"] = "integer"
    lane_on_failure: Literal["block", "skip"] = "block"
    # How far ahead of the receiver's clock a timestamp version may be (422 `version_ahead`
    # past it): an hour is far beyond the clock skew of honest senders, while a version dated
    # years ahead would supersede every later update of its object. Integer versions have no
    # clock; their lanes belong to their source (outbox/ingest/lanes.py).
    max_version_ahead_seconds: float = Field(default=3600.0, gt=0)
    # The most of a downstream's answer a worker reads (worker/actions/http.py): 1 MiB holds
    # any CRM's answer many times over, and 128 attempts in flight then hold at most 128 MiB
    # of a worker's 1 GB, whatever a hostile or broken downstream sends.
    max_response_bytes: int = Field(default=1_048_576, ge=1024, le=256 * 1_048_576)

    @model_validator(mode="after")
    def _action_has_its_settings(self) -> ActionSettings:
        if self.action == "http" and not self.url:
            raise ValueError("an http route needs `url`")
        if self.action == "python" and (not self.function or ":" not in self.function):
            raise ValueError('a python route needs `function = "package.module:function"`')
        for pointer in (self.external_ref_pointer, self.reconcile_external_ref_pointer):
            if pointer is not None and not (pointer == "" or pointer.startswith("/")):
                raise ValueError('`external_ref_pointer` is a JSON pointer such as "/id"')
        if self.reconcile_url is not None and self.action != "http":
            raise ValueError("`reconcile_url` belongs to an http route")
        if self.kind == "n8n" and self.action != "http":
            raise ValueError('`kind = "n8n"` belongs to an http route')
        if self.all_signing_secrets and self.action != "http":
            raise ValueError("`signing_secret` belongs to an http route")
        for secret in self.all_signing_secrets:
            reason = strength.standard_weakness(secret)
            if reason:
                raise ValueError(
                    f"route {self.label!r}: a `signing_secret` {reason} (Standard Webhooks: "
                    f"whsec_ and the base64 of {strength.MIN_STANDARD_KEY_BYTES} to 64 random "
                    "bytes)"
                )
        if self.order_by is not None and not (
            self.order_by == "external_id" or self.order_by.startswith("/")
        ):
            raise ValueError('`order_by` is a JSON pointer such as "/contact/id", or "external_id"')
        if self.order_by is None and (
            self.versions is not None
            or "version_format" in self.model_fields_set
            or "lane_on_failure" in self.model_fields_set
            or "max_version_ahead_seconds" in self.model_fields_set
        ):
            raise ValueError(
                "`versions`, `version_format`, `lane_on_failure` and "
                "`max_version_ahead_seconds` need `order_by`"
            )
        if self.circuit_cooldown_cap_seconds < self.circuit_cooldown_seconds:
            raise ValueError("`circuit_cooldown_cap_seconds` must be >= `circuit_cooldown_seconds`")
        return self

    @property
    def all_signing_secrets(self) -> tuple[str, ...]:
        """The signing secrets in file order, each once (`signing_secret` first)."""
        given = ([self.signing_secret] if self.signing_secret else []) + self.signing_secrets
        return tuple(dict.fromkeys(secret.get_secret_value() for secret in given))

    @property
    def signing_keys(self) -> tuple[bytes, ...]:
        """The key bytes outbound requests are signed with; empty: requests go unsigned."""
        return tuple(standard_webhooks.decode_secret(s) for s in self.all_signing_secrets)

    @property
    def action_timeout_seconds(self) -> float:
        """The longest an http call can take (connect plus read); 0 for other actions."""
        if self.action != "http":
            return 0.0
        return self.connect_timeout_seconds + self.read_timeout_seconds

    @property
    def label(self) -> str:
        """The name logs, metrics and keys use."""
        return self.name

    @property
    def lane_ttl_seconds(self) -> float:
        """How long an idle lane's state is kept: as long as the keys that used it may be
        (a destination's deliveries live as long as their route's keys: 30 days unless the
        route says otherwise, and a lane's row also lives as long as its last key)."""
        return DEFAULT_TTL_SECONDS


ACTION_FIELDS: frozenset[str] = frozenset(ActionSettings.model_fields) - {"name"}
"""The settings a fan-out route leaves to its destinations."""
