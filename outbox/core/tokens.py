"""Start-up check of the settings' secrets: a weak token or webhook secret can be guessed, so
no process (receiver, relay, worker, sweeper, CLI) starts with one.

The check runs over (setting name, value) pairs so every token the gateway takes is listed in
one place (`configured_tokens`); an unset token is not checked (its feature stays off or
loopback-only). WEBHOOK_SECRETS is checked per source, by the same rule
(`outbox.core.strength`). The routes file's secrets are checked where it is read
(`outbox.core.routes`). Messages name the setting and the source, never the value.
"""

from __future__ import annotations

from collections.abc import Iterable

from outbox.core.settings import Settings
from outbox.core.strength import HOW_TO_MAKE_ONE, weakness

WEBHOOK_SECRETS = "WEBHOOK_SECRETS"


class TokenError(Exception):
    """A configured token or secret is too weak; the message names it and says how to make
    a strong one."""


def configured_tokens(settings: Settings) -> list[tuple[str, str]]:
    """Every bearer token and signing secret of the settings, as (environment variable,
    value)."""
    return [
        ("OPERATOR_TOKEN", settings.operator_token),
        ("CLAIMS_TOKEN", settings.claims_token),
        ("METRICS_TOKEN", settings.metrics_token),
        ("REPLAY_SECRET", settings.replay_secret),
        ("FLOWER_PASSWORD", settings.flower_password),
    ]


def weak_tokens(tokens: Iterable[tuple[str, str]]) -> list[str]:
    """`NAME reason` for each token that is set but too weak."""
    found = ((name, weakness(value)) for name, value in tokens if value)
    return [f"{name} {reason}" for name, reason in found if reason]


def parse_secrets(value: str) -> dict[str, tuple[str, ...]]:
    """`"stripe=whsec_1,shop=s3cr3t,shop=n3w"` → {"stripe": ("whsec_1",), "shop": ("s3cr3t",
    "n3w")}: a source named twice has both secrets (a rotation)."""
    found: dict[str, tuple[str, ...]] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, secret = item.partition("=")
        if not sep or not name.strip() or not secret:
            raise ValueError(f"{WEBHOOK_SECRETS} is a comma-separated list of source=secret")
        source = name.strip().casefold()
        found[source] = (*found.get(source, ()), secret)
    return found


def weak_webhook_secrets(value: str) -> list[str]:
    """`WEBHOOK_SECRETS (source 'name') reason` for each source's secret that is too weak."""
    problems = []
    for source, secrets in parse_secrets(value).items():
        for secret in secrets:
            reason = weakness(secret)
            if reason:
                problems.append(f"{WEBHOOK_SECRETS} (source {source!r}): its secret {reason}")
    return problems


def check_tokens(tokens: Iterable[tuple[str, str]], webhook_secrets: str = "") -> None:
    """Raise TokenError naming every token and webhook secret that is set but too weak."""
    try:
        problems = weak_tokens(tokens) + weak_webhook_secrets(webhook_secrets)
    except ValueError as error:
        raise TokenError(str(error)) from None
    if problems:
        raise TokenError(
            "; ".join(problems) + ". Tokens and secrets are 32 characters or more, printable "
            "ASCII without spaces, and hard to guess by zxcvbn's estimate (no words, "
            f"sequences or repeats); make one with: {HOW_TO_MAKE_ONE}"
        )


def check_settings(settings: Settings) -> None:
    """The start-up check of every process: its tokens and WEBHOOK_SECRETS."""
    check_tokens(configured_tokens(settings), settings.webhook_secrets)
