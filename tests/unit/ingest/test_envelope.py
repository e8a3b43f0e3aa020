"""Unit tests for outbox.ingest.envelope: validation, and which members make two deliveries
one event."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from outbox.ingest.envelope import Envelope

BASE: dict[str, Any] = {
    "source": "stripe",
    "event_type": "invoice.paid",
    "external_id": "in_1Abc",
    "version": "3",
    "payload": {"amount": 100, "currency": "eur", "lines": [{"sku": "A"}, {"sku": "B"}]},
}


def envelope(**changes: Any) -> Envelope:
    return Envelope.model_validate({**BASE, **changes})


def key(env: Envelope, fold: bool = False) -> str:
    return env.derived_key(fold_external_id_case=fold)


# --- payload_hash -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"correlation_id": "corr-1"},
        {"correlation_id": "corr-2", "workflow": "Invoices to CRM"},
        {"execution_id": 1234},
        {"execution_id": "5678"},  # an n8n re-run has a new execution id
        {"correlation_id": "c", "workflow": "w", "execution_id": "e"},
        {"payload": {"lines": [{"sku": "A"}, {"sku": "B"}], "currency": "eur", "amount": 100}},
    ],
    ids=["correlation", "workflow", "execution-int", "execution-str", "all-metadata", "key-order"],
)
def test_payload_hash_ignores_delivery_metadata_and_key_order(changes: dict[str, Any]) -> None:
    """Correlation id, workflow, execution id and dict key order do not change the payload hash."""
    assert envelope(**changes).payload_hash() == envelope().payload_hash()
    assert key(envelope(**changes)) == key(envelope())


@pytest.mark.parametrize(
    "changes",
    [
        {"payload": {"amount": 101, "currency": "eur", "lines": [{"sku": "A"}, {"sku": "B"}]}},
        {"payload": {"amount": 100, "currency": "eur", "lines": [{"sku": "B"}, {"sku": "A"}]}},
        {"payload": {"amount": 100.5, "currency": "eur"}},
        {"payload": {}},
        {"external_id": "in_2Xyz"},
        {"external_id": "IN_1ABC"},  # external ids keep their case
        {"version": "4"},
        {"version": None},
    ],
    ids=["amount", "list-order", "fields", "empty", "external-id", "id-case", "version", "no-ver"],
)
def test_payload_hash_differs_on_business_content(changes: dict[str, Any]) -> None:
    """A different payload, external id or version gives a different payload hash."""
    assert envelope(**changes).payload_hash() != envelope().payload_hash()


def test_payload_hash_is_sha256_hex() -> None:
    """The payload hash is 64 lower-case hex digits."""
    digest = envelope().payload_hash()
    assert len(digest) == 64
    assert set(digest) <= set("0123456789abcdef")


@pytest.mark.parametrize(
    ("source", "event_type"),
    [
        ("Stripe", "Invoice.Paid"),
        ("STRIPE", "INVOICE.PAID"),
        ("  stripe ", "\tinvoice.paid\n"),
        ("stripe\u00a0", "invoice.paid\u3000"),
        (" StRiPe", " Invoice.PAID "),
    ],
)
def test_source_and_event_type_spelling_does_not_matter(source: str, event_type: str) -> None:
    """Case and whitespace variants of source and event type give the same key and hash."""
    variant = envelope(source=source, event_type=event_type)
    assert key(variant) == key(envelope())
    assert variant.payload_hash() == envelope().payload_hash()
    assert variant.normalized_source == "stripe"
    assert variant.normalized_event_type == "invoice.paid"


@pytest.mark.parametrize(("as_int", "as_str"), [(42, "42"), (0, "0"), (-7, "-7")])
def test_integer_and_string_ids_are_the_same_event(as_int: int, as_str: str) -> None:
    """An integer external id (or version) and its decimal string give the same key and hash."""
    assert key(envelope(external_id=as_int)) == key(envelope(external_id=as_str))
    assert (
        envelope(external_id=as_int).payload_hash() == envelope(external_id=as_str).payload_hash()
    )
    assert key(envelope(version=as_int)) == key(envelope(version=as_str))


def test_fold_external_id_case_passes_through() -> None:
    """derived_key folds the external id's case only when the route asks for it."""
    upper = envelope(external_id="Bob@Example.COM")
    lower = envelope(external_id="bob@example.com")
    assert key(upper, fold=False) != key(lower, fold=False)
    assert key(upper, fold=True) == key(lower, fold=True)


def test_derived_key_shape() -> None:
    """The derived key is `source:event_type:sha256`, readable prefix and no raw external id."""
    derived = key(envelope(source=" Stripe ", event_type="Invoice.Paid"))
    prefix_source, prefix_type, digest = derived.split(":")
    assert (prefix_source, prefix_type) == ("stripe", "invoice.paid")
    assert len(digest) == 64
    assert "in_1Abc" not in derived


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["external_id", "version", "execution_id"])
@pytest.mark.parametrize("value", [True, False])
def test_booleans_are_not_identifiers(field: str, value: bool) -> None:
    """A JSON boolean is refused where an id is expected (True is not the id 1)."""
    with pytest.raises(ValidationError):
        envelope(**{field: value})


@pytest.mark.parametrize(
    "changes",
    [
        {"source": ""},
        {"source": "   "},
        {"source": "\u00a0\t"},
        {"event_type": " "},
        {"external_id": ""},
        {"external_id": "  "},
        {"external_id": "x" * 1001},
        {"version": " "},
        {"source": "s" * 201},
        {"external_id": 4.2},
        {"external_id": None},
        {"external_id": ["a"]},
        {"payload": []},
        {"payload": "text"},
        {"correlation_id": ""},
        {"workflow": ""},
    ],
)
def test_invalid_members_are_refused(changes: dict[str, Any]) -> None:
    """Blank, oversized or wrongly typed members are refused."""
    with pytest.raises(ValidationError):
        envelope(**changes)


@pytest.mark.parametrize("missing", ["source", "event_type", "external_id", "payload"])
def test_required_members(missing: str) -> None:
    """source, event_type, external_id and payload are required."""
    body = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(ValidationError):
        Envelope.model_validate(body)


@pytest.mark.parametrize("extra", ["idempotency_key", "eventType", "Source", "extra"])
def test_extra_members_are_refused(extra: str) -> None:
    """An unknown member is refused, so a typo cannot pass unnoticed."""
    with pytest.raises(ValidationError, match="Extra inputs"):
        envelope(**{extra: "x"})


def test_optional_members_default_to_none() -> None:
    """version, correlation_id, workflow and execution_id may be left out."""
    env = Envelope.model_validate(
        {"source": "s", "event_type": "t", "external_id": "1", "payload": {}}
    )
    assert env.version is None
    assert env.correlation_id is None
    assert env.workflow is None
    assert env.execution_id is None


# --- a derived key and its payload hash agree --------------------------------


@pytest.mark.parametrize(
    ("first", "second", "fold"),
    [
        ({"external_id": "in_1Abc"}, {"external_id": " in_1Abc "}, False),
        ({"external_id": "bob@example.com"}, {"external_id": "Bob@Example.com"}, True),
        ({"version": "2024-01-01T00:00:00Z"}, {"version": "2024-01-01T01:00:00+01:00"}, False),
    ],
    ids=["id-whitespace", "id-folded-case", "version-timezone"],
)
def test_same_derived_key_means_same_payload_hash(
    first: dict[str, Any], second: dict[str, Any], fold: bool
) -> None:
    """Two envelopes that derive the same key with the same payload have the same payload hash."""
    a, b = envelope(**first), envelope(**second)
    assert key(a, fold) == key(b, fold)
    assert a.payload_hash(fold_external_id_case=fold) == b.payload_hash(fold_external_id_case=fold)
