"""A replay's confirm token: only a dry run can issue one, and it says what the dry run saw.

The token is `rp3_<clear>.<mac>`. The clear part carries the dry run's database time, how many
keys it would replay and the last of them, which a batched execution needs; the MAC (HMAC-SHA256
under `confirm_secret`) binds them to the filter and, for a set executed at once, to its exact
keys. Changing any of them, or signing under another secret, makes the token fail.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from outbox.core.settings import Settings


@dataclass(frozen=True)
class Token:
    """What a confirm token carries in clear; its MAC binds these to the filter."""

    as_of: datetime
    count: int
    through: str | None


def confirm_secret(settings: Settings) -> bytes:
    """The key confirm tokens are signed with: from REPLAY_SECRET, else from OPERATOR_TOKEN.

    It must be the same in every process that may take either step: a dry run on one receiver
    replica is often confirmed through another, and `idem replay` runs the dry run and the
    execution as two processes. So it comes from configuration, never from a per-process
    random (which would refuse every such confirmation as stale). OPERATOR_TOKEN is there
    wherever the HTTP paths are enabled; REPLAY_SECRET, when set, keeps tokens unforgeable even
    by holders of the operator token. With neither, only the CLI can replay, and whoever runs
    it holds the database URL. Derived under its own label, so the key is neither the token
    itself nor the console's session key.
    """
    secret = settings.replay_secret or settings.operator_token
    return hmac.new(secret.encode(), b"replay-confirm", hashlib.sha256).digest()


def confirm_token(
    secret: bytes, filter_document: dict[str, Any], token: Token, to_replay: list[str] | None
) -> str:
    """Binds the filter to the dry run's time, count and last key under the server's secret,
    and, for a set executed at once, to its exact keys."""
    head = {"as_of": token.as_of.isoformat(), "count": token.count, "through": token.through}
    material = json.dumps(
        {
            "filter": filter_document,
            **head,
            "keys": None if to_replay is None else sorted(to_replay),
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    mac = hmac.new(secret, material.encode(), hashlib.sha256).hexdigest()[:40]
    clear = base64.urlsafe_b64encode(json.dumps(head, separators=(",", ":")).encode())
    return f"rp3_{clear.decode().rstrip('=')}.{mac}"


def read_token(confirm: str) -> Token | None:
    """The clear part of a confirm token; None when it is not one (its MAC is checked later)."""
    head, dot, _ = confirm.removeprefix("rp3_").partition(".")
    if not confirm.startswith("rp3_") or not dot:
        return None
    try:
        fields = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))
        token = Token(
            datetime.fromisoformat(fields["as_of"]), int(fields["count"]), fields["through"]
        )
    except (binascii.Error, ValueError, KeyError, TypeError):
        return None
    if token.count < 0 or not isinstance(token.through, str | None):
        return None
    return token
