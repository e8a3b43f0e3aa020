"""How strong a token or a secret must be before any process starts with it.

A value cannot show its entropy, only its shape; the rule refuses the shapes a guess starts
with and that no generator produces:

    length      32 characters at least (`openssl rand -hex 16` is 32; `-hex 32`, 64)
    characters  printable ASCII without spaces (0x21-0x7E): a bearer token travels in a header,
                and a space, a tab or a line break in a setting is a copy mistake
    variety     8 distinct characters at least: `changeme`, `password` or a run of one letter
                with another at the end (`aaaa…ab`) stay below it, while `openssl rand -hex 16`
                (16 symbols, 32 draws) falls below it once in about 28 million draws and
                `-hex 32` never in practice (once in 10^19)
    repetition  not a short sequence repeated (a period of at most half the length):
                `changemechangemechangemechangeme` has 8 distinct characters and no strength

A provider's own format is judged on its key: a Standard Webhooks secret (`whsec_` + base64)
decodes to 24 bytes at least (the specification asks for 24 to 64 random bytes), with the same
variety and repetition rules over the bytes. Stripe (`whsec_` and 32 letters and digits from
the dashboard, 64 hex digits from its CLI), GitHub (chosen by whoever configures the hook) and
Shopify (the app's client secret, 32 hex digits, newer ones after `shpss_`; or the key the
admin's notifications page shows, 64 hex digits) use the secret's text as the key, so the
text rule applies to them as it stands and their real secrets pass it.

The reasons returned never quote the value.
"""

from __future__ import annotations

from collections.abc import Sequence

from outbox.core import standard_webhooks

MIN_CHARS = 32
MIN_DISTINCT = 8
# Standard Webhooks asks for 24 to 64 random bytes; a shorter key is a typo or a placeholder.
MIN_STANDARD_KEY_BYTES = 24
HOW_TO_MAKE_ONE = (
    'openssl rand -hex 32 (or python -c "import secrets; print(secrets.token_urlsafe(32))")'
)
_VISIBLE = frozenset(range(0x21, 0x7F))


def weakness(value: str) -> str | None:
    """Why `value` is too weak for a token or a signing secret, or None when it is not."""
    if any(ord(ch) not in _VISIBLE for ch in value):
        return "holds a space, a control character or a character outside ASCII"
    return _shape(value, MIN_CHARS, "characters")


def standard_weakness(secret: str) -> str | None:
    """Why a Standard Webhooks secret (`whsec_` + base64, the prefix optional) is too weak."""
    try:
        key = standard_webhooks.decode_secret(secret)
    except ValueError:
        return "is not whsec_ followed by base64"
    return _shape(key, MIN_STANDARD_KEY_BYTES, "bytes once decoded")


def _shape(value: Sequence[object], minimum: int, unit: str) -> str | None:
    if len(value) < minimum:
        return f"is shorter than {minimum} {unit}"
    if len(set(value)) < MIN_DISTINCT:
        return f"has fewer than {MIN_DISTINCT} distinct {unit.split()[0]}"
    if smallest_period(value) <= len(value) // 2:
        return "repeats a shorter sequence"
    return None


def smallest_period(value: Sequence[object]) -> int:
    """The smallest p with value[i] == value[i + p] for every i (len(value) when none is
    shorter), from the longest border of the whole (Knuth-Morris-Pratt's failure function)."""
    border = [0] * len(value)
    for i in range(1, len(value)):
        k = border[i - 1]
        while k and value[i] != value[k]:
            k = border[k - 1]
        border[i] = k + 1 if value[i] == value[k] else 0
    return len(value) - (border[-1] if value else 0)
