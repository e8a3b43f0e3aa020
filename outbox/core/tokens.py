"""Start-up check of the bearer tokens: a short token can be guessed, so none is accepted.

The check runs over (setting name, value) pairs so every token the gateway takes is listed in
one place (`configured_tokens`); an unset token is not checked (its feature stays off or
loopback-only).
"""

from __future__ import annotations

from collections.abc import Iterable

from outbox.core.settings import Settings

# 32 characters of token_urlsafe carry 192 bits: beyond any online guessing, throttled or not.
MIN_TOKEN_LENGTH = 32
HOW_TO_MAKE_ONE = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'


class TokenError(Exception):
    """A configured token is too short; the message names it and says how to make one."""


def configured_tokens(settings: Settings) -> list[tuple[str, str]]:
    """Every bearer token of the settings, as (environment variable, value)."""
    return [
        ("OPERATOR_TOKEN", settings.operator_token),
        ("CLAIMS_TOKEN", settings.claims_token),
        ("METRICS_TOKEN", settings.metrics_token),
        ("REPLAY_SECRET", settings.replay_secret),
    ]


def short_tokens(tokens: Iterable[tuple[str, str]]) -> list[str]:
    """The names of the tokens that are set but shorter than MIN_TOKEN_LENGTH."""
    return [name for name, value in tokens if value and len(value) < MIN_TOKEN_LENGTH]


def check_tokens(tokens: Iterable[tuple[str, str]]) -> None:
    """Raise TokenError naming every token that is set but too short."""
    short = short_tokens(tokens)
    if short:
        raise TokenError(
            f"{', '.join(short)} must be at least {MIN_TOKEN_LENGTH} characters; "
            f"make one with: {HOW_TO_MAKE_ONE}"
        )
