"""Standard Webhooks (standardwebhooks.com): the secret's decoding and the signature, shared by
the receiver, which checks the signatures of inbound sources, and the worker, which signs what
it sends on a route with `signing_secret`.

    secret              whsec_ + base64 of the key bytes (the prefix is optional)
    signed content      "<webhook-id>.<webhook-timestamp>.<body>", the body as the exact bytes
                        on the wire
    webhook-signature   "v1,<base64 HMAC-SHA256(key, signed content)>", one per key, separated
                        by spaces (a sender in the middle of a rotation signs with each key)
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Iterable

PREFIX = "whsec_"
"""A Standard Webhooks secret's prefix."""
VERSION = "v1"
"""The symmetric (HMAC-SHA256) signature's version tag."""


def decode_secret(secret: str) -> bytes:
    """The key bytes of a Standard Webhooks secret (`whsec_` + base64; the prefix optional).

    Raises ValueError when the rest is not base64, so a mistyped secret fails at start-up. The
    message never quotes the secret."""
    try:
        return base64.b64decode(secret.removeprefix(PREFIX), validate=True)
    except binascii.Error as error:
        raise ValueError("a Standard Webhooks secret is whsec_ followed by base64") from error


def mac(key: bytes, message_id: str, timestamp: int, body: bytes) -> bytes:
    """The base64 HMAC-SHA256 of one message under one key (the value after `v1,`)."""
    digest = hmac.new(key, f"{message_id}.{timestamp}.".encode(), hashlib.sha256)
    digest.update(body)
    return base64.b64encode(digest.digest())


def signature_header(keys: Iterable[bytes], message_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` value: `v1,<mac>` for each key, space-separated."""
    return " ".join(f"{VERSION},{mac(key, message_id, timestamp, body).decode()}" for key in keys)
