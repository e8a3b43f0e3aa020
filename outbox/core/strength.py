"""How strong a token or a secret must be before any process starts with it.

A value cannot show its entropy, only its shape, so the judge is an estimator made for it:
zxcvbn (Dropbox's, as kept on PyPI), which counts the guesses an attacker who knows how people
and programs make secrets would need: dictionary words and their l33t spellings, keyboard
runs, sequences (`0123…`, `abcd…`), repeats, dates. The rule:

    length      32 characters at least (`openssl rand -hex 16` is 32; `-hex 32`, 64)
    characters  printable ASCII without spaces (0x21-0x7E): a bearer token travels in a header,
                and a space, a tab or a line break in a setting is a copy mistake
    guesses     zxcvbn's score 4 and at least 10^18 estimated guesses (MIN_GUESSES_LOG10).
                Score 4 alone means 10^10, a day of one GPU against a captured signature;
                10^18 is about 60 bits. `aaaa…abcdefgh` (10^9.8), `Password1Password2…`
                (10^15.4) and `0123456789abcdef…` with its last digit changed (10^12.6) fall
                below it; `openssl rand -hex 16` was never below 10^27 in 3 000 draws.

zxcvbn reads at most 72 characters (its own bound: its cost grows with the square of the
length), so a longer value is judged on its first 72, which must carry the strength.

A provider's own format is judged on its key: a Standard Webhooks secret (`whsec_` + base64)
decodes to 24 bytes at least (the specification asks for 24 to 64 random bytes), and those
bytes, written as hex, must pass the same estimate. Stripe (`whsec_` and 32 letters and digits
from the dashboard, 64 hex digits from its CLI), GitHub (chosen by whoever configures the hook)
and Shopify (the app's client secret, 32 hex digits, newer ones after `shpss_`; or the key the
admin's notifications page shows, 64 hex digits) use the secret's text as the key, so the text
rule applies to them as it stands and their real secrets pass it.

The reasons returned never quote the value.
"""

from __future__ import annotations

from functools import lru_cache

from zxcvbn import zxcvbn

from outbox.core import standard_webhooks

MIN_CHARS = 32
# About 60 bits: see the module's docstring for what falls below and what passes.
MIN_GUESSES_LOG10 = 18
# zxcvbn's strongest score (its own scale: 4 is "very unguessable", 10^10 guesses and more).
MIN_SCORE = 4
# zxcvbn's own bound on what it reads.
ESTIMATED_CHARS = 72
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
    if len(value) < MIN_CHARS:
        return f"is shorter than {MIN_CHARS} characters"
    return guessable(value)


def standard_weakness(secret: str) -> str | None:
    """Why a Standard Webhooks secret (`whsec_` + base64, the prefix optional) is too weak."""
    try:
        key = standard_webhooks.decode_secret(secret)
    except ValueError:
        return "is not whsec_ followed by base64"
    if len(key) < MIN_STANDARD_KEY_BYTES:
        return f"is shorter than {MIN_STANDARD_KEY_BYTES} bytes once decoded"
    return guessable(key.hex())


# A process judges the same secrets more than once (a routes file is read again to be served,
# a CLI command checks the settings' tokens): each costs zxcvbn about 10 ms.
@lru_cache(maxsize=256)
def guessable(text: str) -> str | None:
    """Why zxcvbn finds `text` (its first 72 characters) easy to guess, or None."""
    estimate = zxcvbn(text[:ESTIMATED_CHARS])
    if estimate["score"] >= MIN_SCORE and estimate["guesses_log10"] >= MIN_GUESSES_LOG10:
        return None
    return (
        f"is easy to guess (about 10^{int(estimate['guesses_log10'])} guesses by zxcvbn's "
        f"estimate; 10^{MIN_GUESSES_LOG10} at least)"
    )
