"""Keeping credentials out of what operators and logs see.

Error details may quote a header or a query string; payloads may carry a password or a token.
Both pass through here before they are stored in a dead letter or shown to an operator.
"""

from __future__ import annotations

import re
from typing import Any

SECRET_NAMES = re.compile(
    r"(?i)^(authorization|proxy-authorization|cookie|set-cookie|x-api-key|api[_-]?key|"
    r".*token|.*secret|password|passwd|pwd|signature|.*_key)$"
)
_SECRETS_IN_TEXT = re.compile(
    r"(?i)(authorization|proxy-authorization|cookie|set-cookie|x-api-key|api[_-]?key|token|"
    r"secret|password|passwd)(\s*[:=]\s*)(bearer\s+|basic\s+)?[^\s,;&\"']+"
)
MASK = "[redacted]"


def redact(detail: str) -> str:
    """Remove credentials a message may quote (headers, query strings, key=value)."""
    return _SECRETS_IN_TEXT.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}", detail)


def mask_secrets(value: Any) -> Any:
    """A copy of a JSON value with the values of secret-looking members replaced."""
    if isinstance(value, dict):
        return {
            k: MASK if isinstance(k, str) and SECRET_NAMES.match(k) else mask_secrets(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [mask_secrets(v) for v in value]
    return value
