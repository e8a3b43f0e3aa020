"""Keeping credentials out of what operators and logs see.

Error details may quote a header or a query string; payloads may carry a password or a token.
Both pass through here before they are stored in a dead letter or shown to an operator. A
route's URL may carry a credential in its userinfo or its query (`?api_key=${CRM_KEY}`): where
it is shown, only its host is (`url_host`); where a whole URL must be kept (a trace's
`url.full`), its userinfo and every query value are masked (`url_masked`).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

SECRET_NAMES = re.compile(
    r"(?i)^(authorization|proxy-authorization|cookie|set-cookie|x-api-key|api[_-]?key|"
    r".*token|.*secret|password|passwd|pwd|signature|.*_key)$"
)
# Authorization: an optional scheme word and the credential after it.
_AUTH_HEADERS = re.compile(
    r"(?i)\b(authorization|proxy-authorization)"
    r"([\"']?\s*[:=]\s*)([\"']?)((?:[a-z][\w-]*\s+)?[^\s\"',;]+)"
)
# Cookies: the whole value, to the end of the line.
_COOKIE_HEADERS = re.compile(r"(?i)\b(cookie|set-cookie)([\"']?\s*[:=]\s*)([\"']?)([^\"'\r\n]+)")
# name=value, name: value, "name": "value" for credential-looking names.
_SECRET_PAIRS = re.compile(
    r"(?i)\b([\w-]*(?:api[_-]?key|token|secret|password|passwd))"
    r"([\"']?\s*[:=]\s*)([\"']?)([^\s,;&\"'()]+)"
)
MASK = "[redacted]"


def redact(detail: str) -> str:
    """Remove credentials a message may quote (headers, query strings, key=value, JSON)."""

    def keep_name(match: re.Match[str]) -> str:
        return f"{match.group(1)}{match.group(2)}{match.group(3)}{MASK}"

    for pattern in (_AUTH_HEADERS, _COOKIE_HEADERS, _SECRET_PAIRS):
        detail = pattern.sub(keep_name, detail)
    return detail


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


def url_host(url: str) -> str:
    """The host (and port) of a URL, without the userinfo, path, query or fragment that may
    carry a credential; "?" when it has none."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return "?"
    if not host:
        return "?"
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}" if port is not None else host


def url_masked(url: str) -> str:
    """The URL with its userinfo and the value of every query parameter masked (names kept,
    so a trace still shows which parameters a request had); "?" when it cannot be read."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return "?"
    netloc = (f"[{host}]" if host and ":" in host else host or "") + (
        f":{port}" if port is not None else ""
    )
    if parts.username is not None or parts.password is not None:
        netloc = f"{MASK}@{netloc}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = urlencode([(name, MASK) for name, _ in pairs], safe="[]")
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))
