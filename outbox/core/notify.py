"""Notification targets: the routes file's `[[notify]]` tables, and what a notice says.

A target is a URL that hears about the events a person must act on: dead letters (batched, at
most one message per `window_seconds`), a circuit opened or closed, a route paused or resumed,
keys stuck past a threshold, lanes blocked by a dead letter. `format = "slack"` posts a Slack
incoming-webhook body (`text` and one section block); `"json"` posts the notice itself, signed
with Standard Webhooks headers when `secret` is set, so the receiver can tell the gateway from
a stranger. A Slack webhook URL is itself a credential: the URL and the secret are SecretStr,
so no repr, dump or validation error shows them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, model_validator

from outbox.core import standard_webhooks, strength

__all__ = ["CONDITIONS", "Condition", "NotifyTarget", "NotifyTargets", "summary"]

Condition = Literal["dead_letters", "circuit", "pause", "stuck", "blocked_lanes"]
CONDITIONS: tuple[Condition, ...] = ("dead_letters", "circuit", "pause", "stuck", "blocked_lanes")


class NotifyTarget(BaseModel):
    """One `[[notify]]` table of the routes file."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    url: SecretStr
    format: Literal["slack", "json"] = "json"
    # Standard Webhooks secret (`whsec_` + base64, usually "${ENV}") for `json` targets.
    secret: SecretStr | None = None
    on: Annotated[list[Condition], Field(min_length=1)]
    # A minute: a burst of dead letters is one message, and a person still hears within it.
    window_seconds: float = Field(default=60.0, gt=0, le=86_400)
    # `stuck`: tell when at least `stuck_threshold` keys have been untouched for longer than
    # `stuck_after_seconds` (ten minutes: far past any retry or lease of a healthy gateway);
    # `blocked_lanes` uses the same age for the keys parked behind a lane's dead letter.
    stuck_threshold: int = Field(default=1, ge=1, le=10_000)
    stuck_after_seconds: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _checked(self) -> NotifyTarget:
        if not self.url.get_secret_value().startswith(("http://", "https://")):
            raise ValueError(f"notify {self.name!r}: `url` is an http(s) URL")
        if self.secret is not None:
            if self.format != "json":
                raise ValueError(f'notify {self.name!r}: `secret` signs `format = "json"` only')
            reason = strength.standard_weakness(self.secret.get_secret_value())
            if reason:
                raise ValueError(
                    f"notify {self.name!r}: the `secret` {reason} (Standard Webhooks: whsec_ and "
                    f"the base64 of {strength.MIN_STANDARD_KEY_BYTES} to 64 random bytes)"
                )
        if len(set(self.on)) != len(self.on):
            raise ValueError(f"notify {self.name!r}: a condition is named twice in `on`")
        return self

    def wants(self, condition: Condition) -> bool:
        return condition in self.on

    @property
    def signing_key(self) -> bytes | None:
        """The key bytes JSON notices are signed with; None: sent unsigned."""
        if self.secret is None:
            return None
        return standard_webhooks.decode_secret(self.secret.get_secret_value())


def _unique_names(targets: list[NotifyTarget]) -> list[NotifyTarget]:
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise ValueError("two `[[notify]]` tables have the same `name`")
    return targets


NotifyTargets = Annotated[list[NotifyTarget], AfterValidator(_unique_names)]
"""The `[[notify]]` list of a routes file: names unique (a notice names its target)."""


def slack_escaped(value: Any) -> Any:
    """A copy of a JSON value with `&`, `<` and `>` of every string escaped as Slack asks:
    `<!channel>`, `<@U…>` and `<https://…|label>` written by an operator or a sender are then
    shown as text, never turned into a mention or a disguised link."""
    if isinstance(value, str):
        return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    if isinstance(value, dict):
        return {k: slack_escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [slack_escaped(v) for v in value]
    return value


def summary(kind: str, facts: dict[str, Any], *, slack: bool = False) -> str:
    """The one line a person reads (Slack's text, the JSON notice's `text`). For Slack every
    fact is escaped first, so only what this function writes itself could be a link or a
    mention (it writes none today)."""
    if slack:
        facts = slack_escaped(facts)
    match kind:
        case "dead_letters":
            counts = ", ".join(
                f"{c['route']} {c['error_code']} x{c['count']}" for c in facts["counts"]
            )
            keys = ", ".join(facts["keys"])
            return f"{facts['total']} new dead letters ({counts}); first keys: {keys}"
        case "circuit_opened":
            return f"route {facts['route']}: circuit opened ({facts.get('reason') or 'breaker'})"
        case "circuit_closed":
            return f"route {facts['route']}: circuit closed"
        case "pause":
            why = f": {facts['reason']}" if facts.get("reason") else ""
            return f"route {facts['route']} paused by {facts['by']}{why}"
        case "resume":
            return f"route {facts['route']} resumed by {facts['by']}"
        case "stuck":
            if not facts["raised"]:
                return "no more stuck keys"
            return (
                f"{facts['count']} keys stuck for over {facts['older_than_seconds']:g} s;"
                f" first keys: {', '.join(facts['keys'])}"
            )
        case "blocked_lanes":
            if not facts["raised"]:
                return "no more blocked lanes"
            lanes = ", ".join(f"{b['route']}/{b['lane']}" for b in facts["lanes"])
            return f"{facts['count']} lanes blocked by a dead letter: {lanes}"
        case _:
            return kind
