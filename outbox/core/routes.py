"""Routes: which action protects which event type, read from a TOML file.

An event type matches a route exactly or by glob (`crm.*`); exact routes win, then globs in
file order. The receiver resolves the route at accept time (its TTL sets `expires_at`, and an
event no route accepts is refused before anything is stored); the worker runs its action.
"""

from __future__ import annotations

import fnmatch
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from outbox.core import standard_webhooks, strength
from outbox.core.keys import normalize_text
from outbox.core.notify import NotifyTarget, NotifyTargets
from outbox.core.sources import SCHEME_FIELDS, STANDARD_HOW_TO, SchemeName, Source

__all__ = [
    "DEFAULT_ROUTES",
    "SCHEME_FIELDS",
    "STANDARD_HOW_TO",
    "Route",
    "RouteTable",
    "RoutesError",
    "SchemeName",
    "Source",
    "load_routes",
]

DAY = 86_400
_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


STANDARD_PREFIX = standard_webhooks.PREFIX
"""A Standard Webhooks secret's prefix; the source checks its secrets decode at load."""


def standard_key(secret: str) -> bytes:
    """The key bytes of a Standard Webhooks secret (`whsec_` + base64; the prefix optional).

    Raises ValueError when the rest is not base64, so a mistyped secret fails at start-up."""
    try:
        return standard_webhooks.decode_secret(secret)
    except ValueError as error:
        raise ValueError("a `standard` secret is whsec_ followed by base64") from error


class RoutesError(Exception):
    """The routes file is missing, unreadable or invalid; the message says where."""


class Route(BaseModel):
    """One `[[routes]]` table of the routes file."""

    # A URL or a secret may be among the input: an error names the field, never its value.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    match: Annotated[str, Field(min_length=1)]
    name: str = ""
    action: Literal["noop", "http", "python"]
    # What answers the route's requests: `n8n` reads n8n's own answers (worker/errors.py): a
    # 404 "webhook is not registered" is transient for `n8n_unregistered_grace_seconds` after
    # the key's first failure (n8n answers so while a workflow is being re-published and while
    # it starts: five minutes covers both), then permanent.
    kind: Literal["generic", "n8n"] = "generic"
    n8n_unregistered_grace_seconds: float = Field(default=300.0, gt=0, le=86_400)
    # Keys live 30 days by default: longer than any provider's redelivery window we know of.
    ttl_days: float = Field(default=30, gt=0)
    # External ids keep their case (Stripe ids are case-sensitive); e-mail routes may fold it.
    fold_external_id_case: bool = False

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

    # The hard limit of one attempt's action, whatever the action: past it the attempt is
    # uncertain, its lease is given up and its late result is fenced out. Unset: three leases
    # (LEASE_SECONDS x 3), long enough for any call the lease keeper renews for, short enough
    # that a hung action frees its key within minutes.
    timeout_seconds: float | None = Field(default=None, gt=0)

    # `python` action: "package.module:function".
    function: str | None = None
    # An exception the function did not raise on purpose: retried (a blip) or not (a bug).
    unexpected_error: Literal["transient", "permanent"] = "transient"

    # Who may trigger this route: source names (case does not matter). Unset: any source.
    sources: list[Annotated[str, Field(min_length=1)]] | None = None

    # Contract: events that break it are accepted, quarantined and never acted on.
    required_fields: list[str] = Field(default_factory=list)
    schema_file: Path | None = None

    # Retry budget for transient failures.
    max_attempts: int = Field(default=8, ge=1)
    backoff_base_seconds: float = Field(default=1.0, gt=0)
    backoff_cap_seconds: float = Field(default=300.0, gt=0)
    # Stop retrying an hour after the first failure: past that, a person should look.
    retry_deadline_seconds: float = Field(default=3600.0, gt=0)

    # Protecting the downstream (see docs/architecture.md, "Routes under load"), shared by every
    # worker process and machine through PostgreSQL. Unset limits mean none.
    # Attempts running at once for this route, across all workers.
    max_in_flight: int | None = Field(default=None, ge=1, le=1000)
    # Requests per second, evenly spaced; `burst` of them may go at once after a quiet spell.
    rate_per_second: float | None = Field(default=None, gt=0, le=10_000)
    burst: int = Field(default=1, ge=1, le=10_000)
    # The circuit breaker judges the route by its recent calls, never one key by itself (see
    # docs/reliability.md). It opens when, over the last `circuit_window_seconds`, at least
    # `circuit_minimum_calls` calls reached the downstream and `circuit_failure_rate` of them
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

    # Ordering lanes (docs/architecture.md, "Lanes"). `order_by` names each event's lane: a
    # JSON pointer into the payload ("/contact/id") or "external_id". Events of one lane are
    # acted on one at a time, in lane order: their version with `versions = "supersede"`
    # (compared as `version_format`: integers, or RFC 3339 timestamps), else the order of
    # acceptance. Under supersede a version not newer than the lane's applied one, or older
    # than one waiting, is recorded `superseded` and never acted on. `lane_on_failure`: a
    # dead letter holds its lane until it is replayed or discarded (`block`), or the lane goes
    # on (`skip`).
    order_by: str | None = None
    versions: Literal["supersede"] | None = None
    version_format: Literal["integer", "timestamp"] = "integer"
    lane_on_failure: Literal["block", "skip"] = "block"

    @field_validator("sources")
    @classmethod
    def _normalized_sources(cls, names: list[str] | None) -> list[str] | None:
        return None if names is None else [normalize_text(name).casefold() for name in names]

    @model_validator(mode="after")
    def _action_has_its_settings(self) -> Route:
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
        ):
            raise ValueError("`versions`, `version_format` and `lane_on_failure` need `order_by`")
        if self.circuit_cooldown_cap_seconds < self.circuit_cooldown_seconds:
            raise ValueError("`circuit_cooldown_cap_seconds` must be >= `circuit_cooldown_seconds`")
        if self.schema_file is not None and not self.schema_file.is_file():
            raise ValueError(f"`schema_file` {self.schema_file} does not exist")
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
        """The name logs and metrics use: the given name, else the match pattern."""
        return self.name or self.match

    @property
    def ttl_seconds(self) -> float:
        return self.ttl_days * DAY

    def allows(self, source: str) -> bool:
        """Whether an event of the (normalized) `source` may trigger this route."""
        return self.sources is None or source in self.sources


class RoutesFile(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    routes: list[Route] = Field(min_length=1)
    sources: list[Source] = Field(default_factory=list)
    notify: NotifyTargets = Field(default_factory=list)


class RouteTable:
    """The loaded routes, answering which route an event type takes."""

    def __init__(
        self,
        routes: list[Route],
        sources: list[Source] | None = None,
        notify: list[NotifyTarget] | None = None,
    ) -> None:
        self.routes = routes
        self.notify = notify or []
        self.sources = {s.key: s for s in sources or []}
        self._exact = {r.match.casefold(): r for r in reversed(routes) if not _is_glob(r.match)}
        self._globs = [r for r in routes if _is_glob(r.match)]
        self._by_label = {r.label: r for r in reversed(routes)}

    def resolve(self, event_type: str) -> Route | None:
        """The route for a normalized event type, or None when no route accepts it."""
        exact = self._exact.get(event_type)
        if exact is not None:
            return exact
        for route in self._globs:
            if fnmatch.fnmatchcase(event_type, route.match.casefold()):
                return route
        return None

    def named_event_types(self) -> frozenset[str]:
        """The event types the file names exactly (globs name none): the only ones that may
        become a metric label, since a glob or a catch-all takes any type a sender invents."""
        return frozenset(self._exact)

    def by_label(self, label: str) -> Route | None:
        """The route an accepted key was stored with (keys remember the route's label)."""
        return self._by_label.get(label)


DEFAULT_ROUTES = RouteTable([Route(match="*", name="default-noop", action="noop")])


def load_routes(path: Path | None, *, sources: bool = True) -> RouteTable:
    """Read and check a routes file; with no file every event type goes to `noop`.

    `sources=False` leaves the `[[sources]]` tables unread, their `${...}` included: a process
    that verifies no signature (the worker) runs without the providers' secrets in its
    environment."""
    if path is None:
        return DEFAULT_ROUTES
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RoutesError(f"cannot read routes file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise RoutesError(f"routes file {path} is not UTF-8: {exc.reason}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise RoutesError(f"routes file {path} is not valid TOML: {exc}") from exc
    if not sources:
        raw.pop("sources", None)
    try:
        expanded = _expand_env(raw)
    except RoutesError as exc:
        raise RoutesError(f"routes file {path}: {exc}") from exc
    try:
        parsed = RoutesFile.model_validate(expanded)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise RoutesError(f"routes file {path} is invalid: {problems}") from exc
    return RouteTable(parsed.routes, parsed.sources, parsed.notify)


def _expand_env(value: Any) -> Any:
    """Replace `${NAME}` in strings with the environment's value, so secrets stay out of files."""
    if isinstance(value, str):

        def substitute(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in os.environ:
                raise RoutesError(f"${{{name}}} is referred to but not set in the environment")
            return os.environ[name]

        return _ENV_REFERENCE.sub(substitute, value)
    if isinstance(value, dict):
        return {k: _expand_env(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v) for v in value]
    return value
