"""Idempotency keys: one key per business event, never per attempt.

A key must be the same every time the same business event arrives, however it arrives. So we
prefer the source's own event id (the source already decided what "one event" means). Failing
that, we derive the key from normalized parts in a fixed order, ``source : event_type :
external_id : version``, so spelling noise (case, whitespace, Unicode form, time zone) cannot
split one event into two keys. The parts are hashed (SHA-256 over an unambiguous JSON encoding)
so a key carries no raw PII and a ":" inside a part cannot make two events collide; a readable
``source:event_type:`` prefix keeps keys greppable. Never an n8n execution id, a timestamp alone
or a random UUID: those change on every retry or replay, which is exactly what a key must not do.

Keys are namespaced by who may write them (invariant 17). Every key an event of source S gets
starts with ``source_namespace(S) + ":"``: the derived key, a provider webhook's key and a
client's own ``Idempotency-Key`` (scoped by `scoped_client_key`). A sender can name any source it
likes only where that source has no secret; a signed source's namespace is written only with its
signature. So a key sent by one source can never equal a key of another, whatever it claims.
The namespace is the source's slug when the slug is the source itself (``billing``, ``shopify``),
else the slug and 16 hex digits of the source's SHA-256 (``my-app~1a2b…``), so two sources
whose slugs collide (``my app`` and ``my-app``, or two long names cut at 40) never share one.
The migration 0010 computes the same in SQL (``key_namespace``, ``namespaced_key``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import unicodedata
from datetime import UTC, datetime, timedelta, timezone

__all__ = [
    "InvalidKey",
    "NumberOutOfRange",
    "canonical_json",
    "derive_key",
    "mask_key",
    "normalize_part",
    "normalize_text",
    "payload_hash",
    "scoped_client_key",
    "source_namespace",
    "validate_client_key",
]


class InvalidKey(ValueError):
    """A client-supplied key (or a part of one) is unusable; the message says why."""


# Strict on purpose: the whole value must be a timestamp with an explicit offset, in ASCII digits
# only, so ordinary ids (and naive timestamps, whose zone we cannot know) are never rewritten.
_TIMESTAMP = re.compile(
    r"(?P<date>[0-9]{4}-[0-9]{2}-[0-9]{2})[Tt ](?P<time>[0-9]{2}:[0-9]{2}:[0-9]{2})"
    r"(?:\.(?P<fraction>[0-9]{1,9}))?"
    r"(?:(?P<zulu>[Zz])|(?P<sign>[+-])(?P<oh>[0-9]{2}):?(?P<om>[0-9]{2}))"
)
# Slugs keep only characters that are safe in logs, URLs and Redis key names.
_SLUG_UNSAFE = re.compile(r"[^a-z0-9._-]")
_SLUG_MAX = 40  # enough to recognise a source or event type at a glance, short enough for logs
# The hashed namespace's digits: 64 bits, so no one finds a second source with a given namespace.
_NAMESPACE_DIGEST = 16
_DERIVED_KEY = re.compile(
    r"([a-z0-9._-]{1,40}(?:~[0-9a-f]{16})?):([a-z0-9._-]{1,40}):([0-9a-f]{64})"
)
# What follows the namespace in a derived or provider key: `event_type_slug:sha256`.
_DERIVED_TAIL = re.compile(r"[a-z0-9._-]{1,40}:[0-9a-f]{64}")
_CLIENT_KEY = re.compile(r"[\x21-\x7e]+")
_CLIENT_KEY_MAX = 255  # Stripe's limit: room for a UUID or composite id, small enough to index
_ELLIPSIS = "…"
# Built once: json.dumps builds a new encoder on every call that passes options.
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)
_KEY_PARTS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def normalize_text(value: str) -> str:
    """Unicode NFC, trimmed, every run of whitespace (any Unicode whitespace) made one space."""
    return " ".join(unicodedata.normalize("NFC", value).split())


def _utc_timestamp(value: str) -> str | None:
    """The UTC ``...Z`` form of a timestamp with an explicit offset, or None if it is not one."""
    match = _TIMESTAMP.fullmatch(value)
    if match is None:
        return None
    try:
        local = datetime.fromisoformat(f"{match['date']}T{match['time']}")
        if match["zulu"]:
            offset = timedelta(0)
        else:
            sign = -1 if match["sign"] == "-" else 1
            offset = sign * timedelta(hours=int(match["oh"]), minutes=int(match["om"]))
        utc = local.replace(tzinfo=timezone(offset)).astimezone(UTC)
    except (ValueError, OverflowError):  # month 13, offset >= 24h, year 0 after conversion...
        return None
    # Offsets are whole minutes, so the fraction is carried over as digits, never via float: this
    # keeps nanoseconds exact. Microsecond precision (6 digits) unless finer digits are non-zero.
    fraction = (match["fraction"] or "").rstrip("0")
    if fraction:
        fraction = "." + fraction.ljust(6 if len(fraction) <= 6 else 9, "0")
    return f"{utc.year:04d}-{utc:%m-%dT%H:%M:%S}{fraction}Z"


def normalize_part(value: str) -> str:
    """normalize_text, then a timestamp with an explicit offset becomes UTC ISO-8601 with "Z"."""
    text = normalize_text(value)
    return _utc_timestamp(text) or text


def _folded(value: str) -> str:
    # casefold can denormalize ("İ" -> "i" + combining dot), so re-apply NFC after it.
    return unicodedata.normalize("NFC", value.casefold())


def _slug(value: str) -> str:
    return _SLUG_UNSAFE.sub("-", value)[:_SLUG_MAX]


def source_namespace(source: str) -> str:
    """The prefix (before its first ":") of every key an event of `source` gets.

    `source` as events store it (`normalize_text(...).casefold()`: `Envelope.normalized_source`,
    `Source.key`). Its slug when that is the source itself; else the slug, "~" and 16 hex of the
    source's SHA-256, so sources that slug alike (``my app``, ``my-app``) stay apart. Neither
    form contains ":" and only the second contains "~", so two sources never share one.
    """
    slug = _slug(source)
    if slug == source:
        return slug
    return f"{slug}~{_sha256(source)[:_NAMESPACE_DIGEST]}"


def scoped_client_key(source: str, client_key: str) -> str:
    """The key stored for an `Idempotency-Key` (already validated) sent by `source`.

    ``<namespace>:<client_key>``, or `client_key` as it is when it already starts with the
    source's namespace and ":" (clients that namespace their own keys keep them). A key that
    claims another source's prefix (``billing:o-77`` from ``webform``) so stays inside the
    sender's namespace (``webform:billing:o-77``). One more form is read as its new one: a
    derived key as a source whose namespace is hashed had it before namespaces
    (``my-app:t:<sha256>`` from ``my app``), which the migration 0010 rewrote to
    ``my-app~…:t:<sha256>``; a repeat sent with the old key finds the rewritten one.
    """
    namespace = source_namespace(source)
    if client_key.startswith(namespace + ":"):
        return client_key
    slug = _slug(source)
    if (
        namespace != slug
        and client_key.startswith(slug + ":")
        and _DERIVED_TAIL.fullmatch(client_key, len(slug) + 1) is not None
    ):
        return namespace + client_key[len(slug) :]
    return f"{namespace}:{client_key}"


def derive_key(
    source: str,
    event_type: str,
    external_id: str,
    version: str | None = None,
    *,
    fold_external_id_case: bool = False,
) -> str:
    """``source_namespace:event_type_slug:sha256`` for one business event.

    source and event_type are case-folded; external_id keeps its case (Stripe-style ids are
    case-sensitive) unless ``fold_external_id_case`` (e.g. e-mail addresses). A version of None
    and one that is empty after normalization mean the same thing: "no version". Raises
    InvalidKey if source, event_type or external_id is empty after normalization, because such
    a key would merge every event of that type into one. The prefix is the namespace of the
    source as stored (`source_namespace`); the digest covers the whole normalized source, so
    sources whose slugs collide never share a key.
    """
    norm_source = _folded(normalize_part(source))
    norm_type = _folded(normalize_part(event_type))
    norm_id = normalize_part(external_id)
    if fold_external_id_case:
        norm_id = _folded(norm_id)
    for name, part in (
        ("source", norm_source),
        ("event_type", norm_type),
        ("external_id", norm_id),
    ):
        if not part:
            raise InvalidKey(f"{name} is empty after normalization")
    norm_version = normalize_part(version) if version is not None else ""
    parts = [norm_source, norm_type, norm_id, norm_version or None]
    encoded = _KEY_PARTS.encode(parts)
    namespace = source_namespace(normalize_text(source).casefold())
    return f"{namespace}:{_slug(norm_type)}:{_sha256(encoded)}"


def validate_client_key(key: str) -> str:
    """The stripped ``Idempotency-Key`` header value: 1..255 visible ASCII characters."""
    stripped = key.strip()
    if not stripped:
        raise InvalidKey("Idempotency-Key is empty")
    if len(stripped) > _CLIENT_KEY_MAX:
        raise InvalidKey(
            f"Idempotency-Key is {len(stripped)} characters long; at most {_CLIENT_KEY_MAX}"
        )
    if _CLIENT_KEY.fullmatch(stripped) is None:
        position, char = next((i, c) for i, c in enumerate(stripped) if not "\x21" <= c <= "\x7e")
        # Name the character by code point, never echo the key itself.
        raise InvalidKey(
            f"Idempotency-Key has U+{ord(char):04X} at position {position}; "
            "only visible ASCII (0x21..0x7E) is allowed"
        )
    return stripped


DELIVERY_SEPARATOR = " @"
"""Between an event's key and a destination's name in a delivery's key. A space is in no
event's or workflow's key (visible ASCII only), so no key can pose as a delivery's."""


def delivery_key(event_key: str, destination: str) -> str:
    """The key of an event's delivery to one destination: stable (the same event and
    destination give it again, so a repeat finds it and the downstream's `Idempotency-Key`
    never changes), distinct per destination, and never another event's key."""
    return f"{event_key}{DELIVERY_SEPARATOR}{destination}"


def mask_key(key: str) -> str:
    """A key fit for logs: never the full key, at most the PII-free prefixes of a derived key.

    ``src:type:<first 8 of digest>…`` for a derived key; ``abcd…wxyz`` for another key longer
    than 12 characters; ``…yz`` for a shorter one; a delivery's key masks its event's and keeps
    its destination's name.
    """
    event_key, separator, destination = key.rpartition(DELIVERY_SEPARATOR)
    if separator and event_key:
        return f"{mask_key(event_key)}{DELIVERY_SEPARATOR}{destination}"
    derived = _DERIVED_KEY.fullmatch(key)
    if derived is not None:
        return f"{derived[1]}:{derived[2]}:{derived[3][:8]}{_ELLIPSIS}"
    if len(key) > 12:
        return f"{key[:4]}{_ELLIPSIS}{key[-4:]}"
    return f"{_ELLIPSIS}{key[-2:]}"


def canonical_json(value: object) -> str:
    """One JSON text per value: sorted keys, no spaces, UTF-8 kept, NaN and Infinity refused."""
    return _CANONICAL.encode(value)


class NumberOutOfRange(ValueError):
    """A JSON number beyond a double's range, such as `1e400`.

    JSON's grammar allows it, but it parses to infinity, which no JSON text (and so no stored
    payload, hash or result) can hold: the caller's input, refused before anything is written.
    """

    def __init__(self) -> None:
        super().__init__("a number is beyond the range of a 64-bit float (such as 1e400)")


def finite_float(text: str) -> float:
    """`json.loads(parse_float=...)`: a JSON number with a fraction or exponent, never infinite."""
    value = float(text)
    if math.isinf(value):
        raise NumberOutOfRange
    return value


def require_finite(value: object) -> object:
    """`value` itself when no number inside it is infinite or NaN; else `NumberOutOfRange`.

    For bodies a framework parsed already (where `finite_float` could not be the parse hook).
    A loop, not recursion: nesting depth is the caller's to choose.
    """
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise NumberOutOfRange
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return value


def payload_hash(value: object) -> str:
    """SHA-256 hex of the canonical JSON, to tell a replay from a different payload."""
    return _sha256(canonical_json(value))


def event_hash(
    source: str, event_type: str, external_id: str, version: str | None, payload_json: str
) -> str:
    """`payload_hash` of ``{"source", "event_type", "external_id", "version", "payload"}``
    given the payload's canonical JSON, so a request serializes its payload once (the same text
    is stored). The text hashed is exactly `canonical_json` of that object: keys in sorted
    order, the payload's text spliced in (a property test holds the two equal)."""
    encode = _CANONICAL.encode
    return _sha256(
        f'{{"event_type":{encode(event_type)},"external_id":{encode(external_id)},'
        f'"payload":{payload_json},"source":{encode(source)},"version":{encode(version)}}}'
    )


def _sha256(text: str) -> str:
    # surrogatepass: a lone surrogate from a JSON body must hash (deterministically), not crash;
    # for every valid string this is plain UTF-8.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
