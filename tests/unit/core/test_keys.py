"""Unit tests for outbox.core.keys: one key per business event, no PII in keys or logs."""

from __future__ import annotations

import hashlib
import itertools
import json
import re

import pytest

from outbox.core.keys import (
    InvalidKey,
    NumberOutOfRange,
    canonical_json,
    derive_key,
    finite_float,
    mask_key,
    normalize_part,
    normalize_text,
    payload_hash,
    require_finite,
    scoped_client_key,
    source_namespace,
    validate_client_key,
)

DERIVED_KEY_SHAPE = re.compile(r"[a-z0-9._-]{1,40}(~[0-9a-f]{16})?:[a-z0-9._-]{1,40}:[0-9a-f]{64}")
NFD_E = "e\u0301"  # "é" as "e" + combining acute accent
NFC_E = "\u00e9"  # "é" as one code point


def digest(key: str) -> str:
    return key.rsplit(":", 1)[1]


# --- normalize_text ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("abc", "abc"),
        ("  abc  ", "abc"),
        ("a  b", "a b"),
        ("a\tb", "a b"),
        ("a\nb", "a b"),
        ("a\r\n\t b", "a b"),
        ("a\u00a0b", "a b"),  # no-break space
        ("a\u2003\u3000b", "a b"),  # em space, ideographic space
        ("\u00a0\ta b\n", "a b"),
        (f"caf{NFD_E}", f"caf{NFC_E}"),
        ("", ""),
        (" \t\n ", ""),
    ],
)
def test_normalize_text(raw: str, expected: str) -> None:
    """normalize_text applies NFC, trims and collapses every whitespace run to one space."""
    assert normalize_text(raw) == expected


# --- normalize_part: timestamps ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("2026-01-02T03:04:05+02:00", "2026-01-02T01:04:05Z"),
        ("2026-01-02 03:04:05Z", "2026-01-02T03:04:05Z"),
        ("2026-01-02T03:04:05z", "2026-01-02T03:04:05Z"),
        ("2026-01-02T03:04:05+00:00", "2026-01-02T03:04:05Z"),
        ("2026-01-02T03:04:05-00:00", "2026-01-02T03:04:05Z"),
        ("2026-01-02T03:04:05+0200", "2026-01-02T01:04:05Z"),
        ("2026-01-01T23:30:00-05:00", "2026-01-02T04:30:00Z"),
        ("2026-01-01T01:00:00+02:30", "2025-12-31T22:30:00Z"),
        ("2026-01-02T03:04:05.123+02:00", "2026-01-02T01:04:05.123000Z"),
        ("2026-01-02T03:04:05.123456Z", "2026-01-02T03:04:05.123456Z"),
        ("2026-01-02T03:04:05.000000+02:00", "2026-01-02T01:04:05Z"),
        ("2026-01-02T03:04:05.0Z", "2026-01-02T03:04:05Z"),
        ("2026-01-02T03:04:05.1234560Z", "2026-01-02T03:04:05.123456Z"),
        ("2026-01-02T03:04:05.123456789-01:00", "2026-01-02T04:04:05.123456789Z"),
        ("  2026-01-02T03:04:05+02:00\n", "2026-01-02T01:04:05Z"),
        ("2024-02-29T23:00:00-01:00", "2024-03-01T00:00:00Z"),
    ],
)
def test_normalize_part_converts_offset_timestamps_to_utc(raw: str, expected: str) -> None:
    """A whole-value timestamp with an explicit offset or Z becomes UTC ISO-8601 with Z."""
    assert normalize_part(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        "2026-01-02T03:04:05",  # naive: zone unknown, left alone
        "2026-01-02 03:04:05.123",
        "2026-01-02",
        "03:04:05Z",
        "evt_2026-01-02T03:04:05Z",  # timestamp inside an id
        "2026-01-02T03:04:05Z-retry",
        "2026-01-02T03:04:05+02:00 x",
        "2026-13-02T03:04:05Z",  # no month 13
        "2026-02-30T03:04:05Z",
        "2026-01-02T24:00:00Z",
        "2026-01-02T03:04:05+24:00",  # offsets stay below 24h
        "2026-01-02T03:04:05+02",
        "2026-01-02T03:04:05.Z",
        "2026-01-02T03:04:05.1234567890Z",
        "0001-01-01T00:00:00+01:00",  # would fall before year 1 in UTC
        "\u0662\u0660\u0662\u0666-01-02T03:04:05Z",  # Arabic-Indic digits are not ASCII digits
        "ORD-123",
        "cus_AbC123",
        "1767322800",
    ],
)
def test_normalize_part_leaves_other_values_alone(raw: str) -> None:
    """Ids, naive timestamps and near-miss or invalid timestamps are only text-normalized."""
    assert normalize_part(raw) == normalize_text(raw)


# --- derive_key: shape and stability ----------------------------------------------------------


def test_derive_key_golden_value() -> None:
    """The derived key for a fixed event never changes between releases."""
    assert derive_key("Stripe", "charge.succeeded", "ch_1") == (
        "stripe:charge.succeeded:c5d8aa271932cf8d2feaaecdddb014a5a83dfe70899ccf4dc8c71c7dbcfc5750"
    )


def _hashed(slug: str, source: str) -> str:
    return f"{slug}~{hashlib.sha256(source.encode()).hexdigest()[:16]}"


@pytest.mark.parametrize(
    ("source", "event_type", "prefix"),
    [
        ("stripe", "charge.succeeded", "stripe:charge.succeeded:"),
        (
            "Shopify Store",
            "Order/Created",
            _hashed("shopify-store", "shopify store") + ":order-created:",
        ),
        (f"caf{NFD_E}", "a_b-c.d", _hashed("caf-", f"caf{NFC_E}") + ":a_b-c.d:"),
        ("x" * 50, "y" * 41, _hashed("x" * 40, "x" * 50) + f":{'y' * 40}:"),
    ],
)
def test_derive_key_prefix_is_a_safe_slug(source: str, event_type: str, prefix: str) -> None:
    """The readable prefix is the source's namespace (its slug, with a digest of the source
    when the slug is not the source itself) and the event type slugged and cut to 40."""
    key = derive_key(source, event_type, "id-1")
    assert key.startswith(prefix)
    assert DERIVED_KEY_SHAPE.fullmatch(key)


@pytest.mark.parametrize(
    ("source", "event_type"),
    [
        ("stripe", "charge.succeeded"),
        ("Stripe", "Charge.Succeeded"),
        ("STRIPE", "CHARGE.SUCCEEDED"),
        ("  stripe\t", "\ncharge.succeeded\u00a0"),
    ],
)
def test_source_and_event_type_case_and_whitespace_give_one_key(
    source: str, event_type: str
) -> None:
    """Case and surrounding whitespace of source and event_type do not change the key."""
    assert derive_key(source, event_type, "ch_1") == derive_key(
        "stripe", "charge.succeeded", "ch_1"
    )


@pytest.mark.parametrize(
    ("source", "event_type"),
    [
        (f"caf{NFC_E} crm", f"r{NFC_E}servation cr{NFC_E}{NFC_E}"),
        (f"caf{NFD_E} crm", f"r{NFD_E}servation cr{NFD_E}{NFD_E}"),
        (f"CAF{NFD_E.upper()}\tCRM", f"R{NFC_E.upper()}SERVATION  CR{NFD_E}{NFC_E}"),
        (f"caf{NFC_E}\u00a0\u00a0crm", f"r{NFC_E}servation\ncr{NFC_E}{NFC_E}"),
        (f" caf{NFD_E}\r\n crm ", f"r{NFD_E}servation\u2003cr{NFC_E}{NFD_E}"),
    ],
)
def test_unicode_and_inner_whitespace_variants_give_one_key(source: str, event_type: str) -> None:
    """NFC/NFD forms, tabs, NBSP and newlines in source and event_type give one key."""
    expected = derive_key(f"caf{NFC_E} crm", f"r{NFC_E}servation cr{NFC_E}{NFC_E}", "42")
    assert derive_key(source, event_type, "42") == expected


def test_casefold_handles_special_cases() -> None:
    """Full case folding makes "Straße" and "STRASSE" one source."""
    assert derive_key("Straße", "t", "1") == derive_key("STRASSE", "t", "1")


@pytest.mark.parametrize(
    "variant",
    [
        "2026-01-02T01:04:05Z",
        "2026-01-02T03:04:05+02:00",
        "2026-01-01T20:04:05-05:00",
        "2026-01-02 06:34:05+0530",
        " 2026-01-02T01:04:05.000Z ",
    ],
)
def test_same_instant_in_two_time_zones_gives_one_key(variant: str) -> None:
    """A timestamp part written in different zones still identifies one event."""
    base = "2026-01-02T01:04:05Z"
    assert derive_key("cal", "booked", variant) == derive_key("cal", "booked", base)
    assert derive_key("cal", "booked", "b-1", variant) == derive_key("cal", "booked", "b-1", base)


def test_naive_timestamp_is_not_guessed_into_utc() -> None:
    """A naive timestamp is kept as is, so it differs from any zoned reading of it."""
    naive = derive_key("cal", "booked", "2026-01-02T01:04:05")
    assert naive != derive_key("cal", "booked", "2026-01-02T01:04:05Z")
    assert naive == derive_key("cal", "booked", " 2026-01-02T01:04:05 ")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("cus_AbC123", "cus_abc123"),
        ("Jane.Doe@Example.com", "jane.doe@example.com"),
        ("ORD-1", "ord-1"),
    ],
)
def test_external_id_keeps_case_unless_asked_to_fold(first: str, second: str) -> None:
    """External ids are case-sensitive by default and fold only with fold_external_id_case."""
    assert derive_key("crm", "contact", first) != derive_key("crm", "contact", second)
    assert derive_key("crm", "contact", first, fold_external_id_case=True) == derive_key(
        "crm", "contact", second, fold_external_id_case=True
    )


def test_external_id_whitespace_is_normalized() -> None:
    """External ids are trimmed and NFC-normalized with inner whitespace collapsed."""
    assert derive_key("s", "t", f" Ren{NFD_E}\t Roe ") == derive_key("s", "t", f"Ren{NFC_E} Roe")


def test_version_case_is_kept_even_when_folding_external_id() -> None:
    """fold_external_id_case folds only the external id, never the version."""
    assert derive_key("s", "t", "x", "V1", fold_external_id_case=True) != derive_key(
        "s", "t", "x", "v1", fold_external_id_case=True
    )


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (None, "1"),
        ("1", "2"),
        ("", "1"),
        (None, "null"),
        (None, "None"),
    ],
)
def test_different_versions_give_different_keys(first: str | None, second: str | None) -> None:
    """Distinct versions of one event get distinct keys."""
    assert derive_key("s", "t", "x", first) != derive_key("s", "t", "x", second)


@pytest.mark.parametrize("empty", ["", " ", "\t\n", "\u00a0"])
def test_no_version_and_empty_version_are_the_same(empty: str) -> None:
    """A version of None and one that is empty after normalization both mean "no version"."""
    assert derive_key("s", "t", "x", empty) == derive_key("s", "t", "x", None)
    assert derive_key("s", "t", "x", empty) == derive_key("s", "t", "x")


@pytest.mark.parametrize(
    ("source", "event_type", "external_id", "name"),
    [
        ("", "t", "x", "source"),
        ("s", " \t", "x", "event_type"),
        ("s", "t", "", "external_id"),
        ("s", "t", "\u00a0\n", "external_id"),
    ],
)
def test_empty_required_part_is_rejected(
    source: str, event_type: str, external_id: str, name: str
) -> None:
    """An empty source, event_type or external_id raises InvalidKey naming the part."""
    with pytest.raises(InvalidKey, match=name):
        derive_key(source, event_type, external_id)


# --- derive_key: no collisions ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second"),
    [
        # A ":" moved across each pair of adjacent parts.
        (("a:b", "c", "x", "v"), ("a", "b:c", "x", "v")),
        (("s", "a:b", "c", "v"), ("s", "a", "b:c", "v")),
        (("s", "t", "a:b", "c"), ("s", "t", "a", "b:c")),
        # ... and across parts further apart.
        (("a:b", "c", "d", "v"), ("a", "b", "c:d", "v")),
        (("s", "a:b", "c", "d"), ("s", "a", "b", "c:d")),
        (("a:b", "c", "d", "e"), ("a", "b", "c", "d:e")),
        # A trailing ":" versus a version.
        (("s", "t", "x:1", None), ("s", "t", "x", "1")),
        (("s", "t", "x:", None), ("s", "t", "x", None)),
        # The slug maps ":" and "-" to the same prefix, but the digest still tells them apart.
        (("a:b", "t", "x", None), ("a-b", "t", "x", None)),
        # JSON punctuation inside a part.
        (("s", "t", 'a","b', None), ("s", "t", "a", "b")),
        (("s", "t", "a,b", None), ("s", "t", "a", "b")),
        (("s", "t", "x", "null"), ("s", "t", "x", None)),
    ],
)
def test_separator_inside_a_part_cannot_collide(
    first: tuple[str, str, str, str | None], second: tuple[str, str, str, str | None]
) -> None:
    """Parts whose naive ":"-join is equal still give different digests."""
    assert digest(derive_key(*first)) != digest(derive_key(*second))


def test_every_split_of_one_string_into_parts_gives_a_distinct_digest() -> None:
    """All ways to cut "a:b:c:d:e:f" into the four parts give pairwise different digests."""
    tokens = "abcdef"
    digests = set()
    for cuts in itertools.combinations(range(1, len(tokens)), 3):
        bounds = (0, *cuts, len(tokens))
        parts = [":".join(tokens[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
        digests.add(digest(derive_key(parts[0], parts[1], parts[2], parts[3])))
    assert len(digests) == 10  # C(5, 3) ways to place three cuts between six tokens


# --- no PII -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("external_id", "version", "needles"),
    [
        ("jane.doe@example.com", None, ["jane", "doe", "example", "@"]),
        ("Jane Doe", None, ["jane", "doe"]),
        ("Zoë Ångström", "zoe@example.org", ["zo", "ngstr", "example"]),
        ("ord-77", "Jane.Doe@Example.com", ["jane", "doe", "example", "@"]),
    ],
)
@pytest.mark.parametrize("fold", [False, True])
def test_key_and_mask_carry_no_raw_pii(
    external_id: str, version: str | None, needles: list[str], fold: bool
) -> None:
    """An e-mail address or name in external_id or version never appears in the key or its mask."""
    key = derive_key("crm", "contact.created", external_id, version, fold_external_id_case=fold)
    for text in (key, mask_key(key)):
        lowered = text.casefold()
        assert external_id.casefold() not in lowered
        for needle in needles:
            assert needle.casefold() not in lowered


# --- validate_client_key ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("a", "a"),
        ("abc-123", "abc-123"),
        ("  abc  ", "abc"),
        ("\tabc\r\n", "abc"),
        ("550e8400-e29b-41d4-a716-446655440000", "550e8400-e29b-41d4-a716-446655440000"),
        ("!~", "!~"),  # both ends of the allowed range
        ("a" * 255, "a" * 255),
        (" " + "a" * 255 + " ", "a" * 255),
        ("stripe:charge:" + "f" * 64, "stripe:charge:" + "f" * 64),
    ],
)
def test_validate_client_key_accepts(raw: str, expected: str) -> None:
    """Keys of 1..255 visible ASCII characters are accepted and returned stripped."""
    assert validate_client_key(raw) == expected


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("\t\n", "empty"),
        ("a" * 256, "256 characters"),
        ("a b", "U\\+0020 at position 1"),
        ("a\tb", "U\\+0009"),
        ("a\nb", "U\\+000A"),
        ("a\x00b", "U\\+0000"),
        ("a\x7fb", "U\\+007F"),
        ("a\x1bb", "U\\+001B"),
        ("caf\u00e9", "U\\+00E9 at position 3"),
        ("key\u00a0x", "U\\+00A0"),
        ("\u2014key", "U\\+2014 at position 0"),
    ],
)
def test_validate_client_key_rejects(raw: str, message: str) -> None:
    """Empty, over-long, or non-visible-ASCII keys raise InvalidKey saying what is wrong."""
    with pytest.raises(InvalidKey, match=message):
        validate_client_key(raw)


def test_invalid_key_is_a_value_error() -> None:
    """InvalidKey can be caught as ValueError at the HTTP boundary."""
    assert issubclass(InvalidKey, ValueError)


def test_rejection_message_does_not_echo_the_key() -> None:
    """The error message names the bad character, not the (possibly sensitive) key."""
    with pytest.raises(InvalidKey) as caught:
        validate_client_key("jane.doe@example.com secret")
    assert "jane" not in str(caught.value)


# --- source_namespace and scoped_client_key --------------------------------------------------


@pytest.mark.parametrize(
    ("source", "namespace"),
    [
        ("billing", "billing"),
        ("shopify", "shopify"),
        ("a.b_c-1", "a.b_c-1"),
        ("x" * 40, "x" * 40),
        ("my app", _hashed("my-app", "my app")),
        ("my:app", _hashed("my-app", "my:app")),
        (f"caf{NFC_E}", _hashed("caf-", f"caf{NFC_E}")),
        ("x" * 41, _hashed("x" * 40, "x" * 41)),
        ("\U0001f600 shop", _hashed("--shop", "\U0001f600 shop")),
    ],
)
def test_source_namespace_is_the_slug_or_the_slug_and_a_digest(source: str, namespace: str) -> None:
    """A source that is its own slug is its namespace; any other gets 16 hex of its SHA-256
    after "~", so `my app`, `my:app` and `my-app` are three namespaces."""
    assert source_namespace(source) == namespace
    assert ":" not in namespace


@pytest.mark.parametrize(
    ("source", "client_key", "stored"),
    [
        ("webform", "o-77", "webform:o-77"),
        ("webform", "billing:o-77", "webform:billing:o-77"),
        ("webform", "shopify:webhook:" + "a" * 64, "webform:shopify:webhook:" + "a" * 64),
        ("webform", "webform:o-77", "webform:o-77"),  # already namespaced: kept
        ("webform", "webform:", "webform:"),
        ("webform", "webformx:o-77", "webform:webformx:o-77"),
        ("webform", "webform", "webform:webform"),
        ("my-app", "my-app:o-1", "my-app:o-1"),
        ("my app", "o-1", _hashed("my-app", "my app") + ":o-1"),
        # Another source's slug never passes for the sender's namespace...
        ("my app", "my-app:o-1", _hashed("my-app", "my app") + ":my-app:o-1"),
        # ...except the old form of the sender's own derived keys, read as their new form.
        (
            "my app",
            "my-app:t.x:" + "b" * 64,
            _hashed("my-app", "my app") + ":t.x:" + "b" * 64,
        ),
    ],
)
def test_scoped_client_key_keeps_a_key_inside_its_senders_namespace(
    source: str, client_key: str, stored: str
) -> None:
    """A client's key is stored under its source's namespace; one that already starts with it
    is kept as sent, and one claiming another source's prefix is nested inside the sender's."""
    assert scoped_client_key(source, client_key) == stored


def test_derived_and_provider_keys_start_with_the_source_namespace() -> None:
    """Every key a source's event gets starts with its namespace: derived keys of sources whose
    slugs collide differ in namespace and digest, and none equals the other's client key."""
    spaced, dashed = derive_key("My App", "t", "1"), derive_key("my-app", "t", "1")
    assert spaced.startswith(source_namespace("my app") + ":")
    assert dashed.startswith("my-app:")
    assert scoped_client_key("my-app", spaced.split(":", 1)[1]) != spaced
    assert scoped_client_key("my-app", "my-app:" + spaced.split(":", 1)[1]) != spaced
    assert derive_key("Shopify", "webhook", "e1") == "shopify:webhook:" + digest(
        derive_key("shopify", "webhook", "e1")
    )


# --- mask_key ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("stripe:charge.succeeded:" + "0123456789abcdef" * 4, "stripe:charge.succeeded:01234567…"),
        (
            "my-app~0123456789abcdef:t:" + "0123456789abcdef" * 4,
            "my-app~0123456789abcdef:t:01234567…",
        ),
        ("abcdefghijklm", "abcd…jklm"),
        ("550e8400-e29b-41d4-a716-446655440000", "550e…0000"),
        ("0123456789abcdef" * 4, "0123…cdef"),
        ("stripe:charge:" + "F" * 64, "stri…FFFF"),  # uppercase hex is not a derived key
        ("abcdefghijkl", "…kl"),
        ("abc", "…bc"),
        ("", "…"),
    ],
)
def test_mask_key_examples(key: str, expected: str) -> None:
    """mask_key shows a derived key's prefixes, else a few edge characters, plus an ellipsis."""
    assert mask_key(key) == expected


@pytest.mark.parametrize(
    "key",
    [
        derive_key("stripe", "charge.succeeded", "ch_1"),
        derive_key("x" * 60, "y" * 60, "z"),
        "stripe:charge.succeeded:" + "0123456789abcdef" * 4,
        "0123456789abcdef" * 4,
        "ab:" + "0123456789abcdef" * 4,
    ],
)
def test_mask_key_never_returns_the_full_digest(key: str) -> None:
    """No mask contains the full 64-hex digest, nor more than 8 of its characters."""
    masked = mask_key(key)
    full = key[-64:]
    assert full not in masked
    assert full[:9] not in masked


@pytest.mark.parametrize("length", [3, 4, 11, 12, 13, 20, 64, 255])
def test_mask_key_reveals_less_than_the_key(length: int) -> None:
    """For any key longer than two characters, the mask reveals fewer characters than the key."""
    key = "".join(chr(0x21 + i % 94) for i in range(length))
    masked = mask_key(key)
    assert masked != key
    assert len(masked.replace("…", "")) < length


# --- canonical_json and payload_hash ----------------------------------------------------------


def test_canonical_json_format() -> None:
    """canonical_json sorts keys, drops spaces and keeps non-ASCII characters."""
    value = {"b": [1, {"d": None, "c": True}], "a": "caf\u00e9"}
    assert canonical_json(value) == '{"a":"café","b":[1,{"c":true,"d":null}]}'


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), {"x": [float("-inf")]}])
def test_canonical_json_refuses_non_finite_numbers(bad: object) -> None:
    """NaN and Infinity are not JSON, so canonical_json refuses them."""
    with pytest.raises(ValueError):
        canonical_json(bad)


@pytest.mark.parametrize("text", ['{"a": 1e400}', "[-1e400]", '{"a": [{"b": 2E+999}]}'])
def test_numbers_overflowing_a_double_are_refused_while_parsing(text: str) -> None:
    """A JSON number that would parse to infinity raises NumberOutOfRange (a ValueError)."""
    with pytest.raises(NumberOutOfRange):
        json.loads(text, parse_float=finite_float)


def test_finite_numbers_parse_as_usual() -> None:
    """Ordinary, tiny and huge-but-finite numbers parse exactly as without the hook."""
    text = '{"a": 1.5, "b": 1e-400, "c": 1.7e308, "d": 10, "e": -0.0}'
    assert json.loads(text, parse_float=finite_float) == json.loads(text)


@pytest.mark.parametrize("bad", [float("inf"), {"x": [1, {"y": float("-inf")}]}, [float("nan")]])
def test_require_finite_finds_a_non_finite_number_at_any_depth(bad: object) -> None:
    """require_finite refuses a parsed value holding infinity or NaN anywhere inside it."""
    with pytest.raises(NumberOutOfRange):
        require_finite(bad)


def test_require_finite_returns_a_finite_value_unchanged() -> None:
    """A value without non-finite numbers comes back as it is (the validator's answer)."""
    value = {"a": [1, 2.5, None, "inf", {"b": True}]}
    assert require_finite(value) is value


def test_payload_hash_golden_value() -> None:
    """payload_hash is the SHA-256 hex of the canonical JSON text."""
    assert payload_hash({}) == "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
        ({"x": {"p": 1, "q": [1, 2]}, "y": None}, {"y": None, "x": {"q": [1, 2], "p": 1}}),
        ({"name": "Zoë", "n": 1}, {"n": 1, "name": "Zoë"}),
    ],
)
def test_payload_hash_ignores_key_order(first: object, second: object) -> None:
    """Dicts equal up to key order (at any depth) hash the same."""
    assert payload_hash(first) == payload_hash(second)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"a": 1}, {"a": 2}),
        ({"a": 1}, {"a": "1"}),
        ({"a": 1}, {"a": 1.5}),
        ({"a": 1}, {"a": True}),
        ({"a": None}, {}),
        ({"a": 1}, {"A": 1}),
        ([1, 2], [2, 1]),
        ({"a": "x"}, {"a": "x "}),
        ({"a": f"caf{NFC_E}"}, {"a": f"caf{NFD_E}"}),  # payloads are hashed as sent, not normalized
    ],
)
def test_payload_hash_differs_for_different_payloads(first: object, second: object) -> None:
    """Payloads that differ in any value, type, key or order of a list hash differently."""
    assert payload_hash(first) != payload_hash(second)
    assert len(payload_hash(first)) == 64


def test_lone_surrogate_hashes_instead_of_crashing() -> None:
    """A lone surrogate (which json.loads accepts) gives a stable hash and key, not an error."""
    assert payload_hash({"a": "\ud800"}) == payload_hash({"a": "\ud800"})
    assert payload_hash({"a": "\ud800"}) != payload_hash({"a": "\ud801"})
    assert DERIVED_KEY_SHAPE.fullmatch(derive_key("s", "t", "\ud800"))
