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
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from outbox.core import standard_webhooks
from outbox.core.actions import ACTION_FIELDS, ActionSettings
from outbox.core.keys import normalize_text
from outbox.core.notify import NotifyTarget, NotifyTargets
from outbox.core.sources import SCHEME_FIELDS, STANDARD_HOW_TO, SchemeName, Source

__all__ = [
    "DEFAULT_ROUTES",
    "SCHEME_FIELDS",
    "STANDARD_HOW_TO",
    "ActionSettings",
    "Destination",
    "Route",
    "RouteTable",
    "RoutesError",
    "SchemeName",
    "Source",
    "load_routes",
]

DAY = 86_400
# Deliveries per event: each is a key, a task and an attempt log of its own.
MAX_FAN_OUT = 16
# A destination's name is in every delivery's key and in metric labels: short and plain.
DESTINATION_NAME = r"^[a-z0-9][a-z0-9._-]{0,63}$"
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


class Route(ActionSettings):
    """One `[[routes]]` table of the routes file: which events it takes, and either how it acts
    or (`fan_out`) the destinations each of its events is delivered to."""

    match: Annotated[str, Field(min_length=1)]
    # Keys live 30 days by default: longer than any provider's redelivery window we know of.
    ttl_days: float = Field(default=30, gt=0)
    # External ids keep their case (Stripe ids are case-sensitive); e-mail routes may fold it.
    fold_external_id_case: bool = False

    # Who may trigger this route: source names (case does not matter). Unset: any source.
    sources: list[Annotated[str, Field(min_length=1)]] | None = None

    # Contract: events that break it are accepted, quarantined and never acted on.
    required_fields: list[str] = Field(default_factory=list)
    schema_file: Path | None = None

    # Fan-out: the `[[destinations]]` each event of this route is delivered to, each delivery
    # a key of its own (docs/explanation/architecture.md, "Fan-out"). The route then only matches,
    # checks and keeps keys; how to act is each destination's.
    fan_out: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, max_length=MAX_FAN_OUT
    )

    @model_validator(mode="before")
    @classmethod
    def _fan_out_leaves_acting_to_destinations(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("fan_out") is None:
            return data
        acting = sorted(ACTION_FIELDS & set(data))
        if acting:
            raise ValueError(
                f"{', '.join(f'`{name}`' for name in acting)}: a fan-out route only matches and "
                "names its destinations; how to act belongs in each `[[destinations]]` table"
            )
        return {**data, "action": "noop"}

    @field_validator("sources")
    @classmethod
    def _normalized_sources(cls, names: list[str] | None) -> list[str] | None:
        return None if names is None else [normalize_text(name).casefold() for name in names]

    @field_validator("fan_out")
    @classmethod
    def _each_destination_once(cls, names: list[str] | None) -> list[str] | None:
        if names is not None and len(set(names)) != len(names):
            raise ValueError("`fan_out` names a destination twice")
        return names

    @model_validator(mode="after")
    def _schema_file_exists(self) -> Route:
        if self.schema_file is not None and not self.schema_file.is_file():
            raise ValueError(f"`schema_file` {self.schema_file} does not exist")
        return self

    @property
    def label(self) -> str:
        """The name logs and metrics use: the given name, else the match pattern."""
        return self.name or self.match

    @property
    def ttl_seconds(self) -> float:
        return self.ttl_days * DAY

    @property
    def lane_ttl_seconds(self) -> float:
        return self.ttl_seconds

    def allows(self, source: str) -> bool:
        """Whether an event of the (normalized) `source` may trigger this route."""
        return self.sources is None or source in self.sources


class Destination(ActionSettings):
    """One `[[destinations]]` table: a downstream that fan-out routes deliver to, by name. Its
    name is the label its deliveries are stored, limited, paused and counted under."""

    name: Annotated[str, Field(pattern=DESTINATION_NAME)]


class RoutesFile(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    routes: list[Route] = Field(min_length=1)
    destinations: list[Destination] = Field(default_factory=list)
    sources: list[Source] = Field(default_factory=list)
    notify: NotifyTargets = Field(default_factory=list)


class RouteTable:
    """The loaded routes, answering which route an event type takes."""

    def __init__(
        self,
        routes: list[Route],
        sources: list[Source] | None = None,
        notify: list[NotifyTarget] | None = None,
        destinations: list[Destination] | None = None,
    ) -> None:
        self.routes = routes
        self.destinations = {d.name: d for d in destinations or []}
        self.notify = notify or []
        self.sources = {s.key: s for s in sources or []}
        self._exact = {r.match.casefold(): r for r in reversed(routes) if not _is_glob(r.match)}
        self._globs = [r for r in routes if _is_glob(r.match)]
        self._by_label: dict[str, ActionSettings] = {r.label: r for r in reversed(routes)}
        self._by_label.update(self.destinations)

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

    def by_label(self, label: str) -> ActionSettings | None:
        """What acts on a key stored with this label (keys remember it): its route, or the
        destination of a delivery."""
        return self._by_label.get(label)

    def acting(self) -> list[ActionSettings]:
        """Every route that acts itself, then every destination: what a worker may run."""
        return [r for r in self.routes if r.fan_out is None] + list(self.destinations.values())

    def open_superseding(self) -> list[str]:
        """The routes (by label) open to any source whose lanes supersede, themselves or
        through a fan-out destination: each source's lanes are its own there, so sources
        that speak of the same objects do not supersede each other's updates until the route
        names them in `sources`."""
        return [
            route.label
            for route in self.routes
            if route.sources is None
            and any(s.versions == "supersede" for s in [route, *self.destinations_of(route)])
        ]

    def destinations_of(self, route: Route) -> list[Destination]:
        """The destinations a fan-out route delivers to, in its order; empty for another."""
        return [self.destinations[name] for name in route.fan_out or ()]


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
    problem = _fan_out_problem(parsed.routes, parsed.destinations)
    if problem:
        raise RoutesError(f"routes file {path} is invalid: {problem}")
    return RouteTable(parsed.routes, parsed.sources, parsed.notify, parsed.destinations)


def _fan_out_problem(routes: list[Route], destinations: list[Destination]) -> str | None:
    """What makes the routes and destinations disagree, or None. Labels share one namespace:
    a key's label finds its settings, a pause or a circuit its keys."""
    names = [d.name for d in destinations]
    if len(set(names)) != len(names):
        return "two `[[destinations]]` have the same name"
    labels = {r.label for r in routes}
    for name in names:
        if name in labels:
            return f"destination {name!r} has the name of a route"
    for route in routes:
        for name in route.fan_out or ():
            if name not in names:
                return f"route {route.label!r}: `fan_out` names {name!r}, no `[[destinations]]`"
    return None


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
