"""Property-based tests (hypothesis) for key normalization and the backoff function."""

from __future__ import annotations

import random
import unicodedata

from hypothesis import assume, given
from hypothesis import strategies as st

from outbox.core.keys import (
    canonical_json,
    derive_key,
    event_hash,
    mask_key,
    normalize_text,
    payload_hash,
    scoped_client_key,
    source_namespace,
)
from worker.backoff import next_delay

part = st.text(min_size=1, max_size=30).filter(lambda s: normalize_text(s) != "")
spacing = st.sampled_from([" ", "  ", "\t", "\n", "\u00a0", "\u2003"])


def _respell(value: str, before: str, after: str, flips: list[bool]) -> str:
    """The same text as a provider might send it: padded, some letters re-cased, decomposed."""
    padded = (flips + [False] * len(value))[: len(value)]
    cased = "".join(ch.swapcase() if flip else ch for ch, flip in zip(value, padded, strict=True))
    return before + unicodedata.normalize("NFD", cased) + after


@given(part, part, part, spacing, spacing, st.lists(st.booleans(), max_size=30))
def test_source_and_event_type_spellings_give_one_key(
    source: str, event_type: str, external_id: str, before: str, after: str, flips: list[bool]
) -> None:
    """Padding, case and Unicode composition of source and event type never change the key
    (case meaning: any re-casing that folds to the same text)."""
    respelled_source = _respell(source, before, after, flips)
    respelled_type = _respell(event_type, after, before, flips)
    assume(normalize_text(respelled_source).casefold() == normalize_text(source).casefold())
    assume(normalize_text(respelled_type).casefold() == normalize_text(event_type).casefold())
    assert derive_key(source, event_type, external_id) == derive_key(
        respelled_source, respelled_type, external_id
    )


@given(st.lists(part, min_size=3, max_size=4), st.lists(part, min_size=3, max_size=4))
def test_different_parts_give_different_keys(first: list[str], second: list[str]) -> None:
    """Keys differ whenever the normalized parts differ (no separator can make them collide)."""

    def norm(parts: list[str]) -> tuple[str, ...]:
        source, event_type, external_id, *rest = parts
        return (
            normalize_text(source).casefold(),
            normalize_text(event_type).casefold(),
            normalize_text(external_id),
            *(normalize_text(r) for r in rest),
        )

    a = derive_key(*first[:3], first[3] if len(first) > 3 else None)
    b = derive_key(*second[:3], second[3] if len(second) > 3 else None)
    if norm(first) != norm(second):
        assert a != b


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(part, part, part, st.none() | part, st.dictionaries(st.text(), json_values, max_size=6))
def test_event_hash_is_the_payload_hash_of_the_whole_event(
    source: str, event_type: str, external_id: str, version: str | None, payload: dict[str, object]
) -> None:
    """Splicing the payload's canonical JSON into the event's text gives exactly the hash of
    the event serialized as one object (keys, and so stored hashes, never change)."""
    whole = {
        "source": source,
        "event_type": event_type,
        "external_id": external_id,
        "version": version,
        "payload": payload,
    }
    assert event_hash(
        source, event_type, external_id, version, canonical_json(payload)
    ) == payload_hash(whole)


# Sources as events store them; the alphabet makes slug collisions (" ", ":", "-") common.
stored_source = (
    st.text(alphabet="ab -:É\u00e9\U0001f600", min_size=1, max_size=45)
    .map(lambda s: normalize_text(s).casefold())
    .filter(bool)
)
client_key = st.text(alphabet="ab-:~" + "0123456789abcdef", min_size=1, max_size=90)


@given(stored_source, stored_source, client_key, client_key, part, part)
def test_no_source_can_write_a_key_of_another(
    a: str, b: str, key_a: str, key_b: str, event_type: str, external_id: str
) -> None:
    """Two different sources never share a namespace, and no key one of them can send (its
    own, or anything claiming the other's prefix) equals a client, derived or provider key of
    the other; every key of a source starts with its namespace."""
    assume(a != b)
    assert source_namespace(a) != source_namespace(b)
    mine = scoped_client_key(a, key_a)
    assert mine.startswith(source_namespace(a) + ":")
    for theirs in (
        scoped_client_key(b, key_b),
        scoped_client_key(b, mine),
        derive_key(b, event_type, external_id),
        derive_key(b, "webhook", external_id),
    ):
        assert theirs.startswith(source_namespace(b) + ":")
        assert mine != theirs


@given(part)
def test_the_stored_source_form_is_stable(source: str) -> None:
    """Normalizing a stored source again changes nothing, so the namespace derive_key computes
    from any spelling is the one of the source column."""
    stored = normalize_text(source).casefold()
    assert normalize_text(stored).casefold() == stored
    assert derive_key(source, "t", "x").startswith(source_namespace(stored) + ":")


@given(part, part, st.emails())
def test_a_key_and_its_mask_never_carry_the_external_id(
    source: str, event_type: str, email: str
) -> None:
    """An e-mail address used as the external id appears neither in the key nor in its mask."""
    key = derive_key(source, event_type, email)
    assert email not in key and email not in mask_key(key)
    assert len(mask_key(key)) < len(key)


@given(
    st.integers(1, 200),
    st.floats(0.01, 10),
    st.floats(0.01, 3600),
    st.none() | st.floats(0, 10_000),
    st.integers(0, 2**32),
)
def test_backoff_stays_within_its_bounds(
    attempt: int, base: float, cap: float, retry_after: float | None, seed: int
) -> None:
    """The delay is within [0, min(cap, base*2^(n-1))], and never below Retry-After."""
    delay = next_delay(attempt, retry_after, base=base, cap=cap, rng=random.Random(seed))
    ceiling = min(cap, base * 2 ** min(attempt - 1, 64))
    if retry_after is None:
        assert 0 <= delay <= ceiling
    else:
        assert delay >= retry_after
        assert delay <= max(ceiling, retry_after)
