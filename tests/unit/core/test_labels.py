"""Labels that travel in headers (correlation id, workflow, execution id) are checked at intake."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from outbox.claims.api import ClaimRequest
from outbox.core.labels import MAX_LABEL_CHARS
from outbox.ingest.envelope import Envelope

BASE = {"source": "s", "event_type": "t", "external_id": "e", "payload": {}}


@pytest.mark.parametrize(
    "value",
    ["c-1", "0c7a9d4e-1b2f-4a3c-9d8e-7f6a5b4c3d2e", "Lead intake", "~!@#$%^&*()_+{}|:<>?", "x"],
)
def test_visible_ascii_labels_are_accepted_and_can_be_sent_as_headers(value: str) -> None:
    """Printable ASCII with inner spaces passes, and httpx builds a header from it."""
    assert Envelope.model_validate({**BASE, "correlation_id": value}).correlation_id == value
    httpx.Request("POST", "http://x", headers={"X-Correlation-Id": value})


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("caf\u00e9", "label_not_visible_ascii"),
        ("line\r\nX-Injected: 1", "label_not_visible_ascii"),
        ("tab\there", "label_not_visible_ascii"),
        ("nul\x00", "label_not_visible_ascii"),
        ("del\x7f", "label_not_visible_ascii"),
        (" leading", "label_not_visible_ascii"),
        ("trailing ", "label_not_visible_ascii"),
        ("", "label_not_visible_ascii"),
        ("x" * (MAX_LABEL_CHARS + 1), "label_too_long"),
    ],
    ids=["non-ascii", "crlf", "tab", "nul", "del", "leading", "trailing", "empty", "too-long"],
)
@pytest.mark.parametrize("field", ["correlation_id", "workflow", "execution_id"])
def test_a_label_that_cannot_travel_is_refused_naming_the_field(
    field: str, value: str, error: str
) -> None:
    """Non-ASCII, control characters, CR/LF, outer spaces or over 200 characters: refused, and
    the error names the field and the rule."""
    with pytest.raises(ValidationError) as refused:
        Envelope.model_validate({**BASE, field: value})
    [problem] = refused.value.errors()
    assert (problem["loc"][0], problem["type"]) == (field, error)


@pytest.mark.parametrize("field", ["correlation_id", "workflow"])
def test_the_claims_api_checks_its_labels_the_same_way(field: str) -> None:
    """A claim's correlation id and workflow follow the same rule as an event's."""
    body: dict[str, Any] = {"key": "k-1", field: "r\u00e9sum\u00e9"}
    with pytest.raises(ValidationError) as refused:
        ClaimRequest.model_validate(body)
    [problem] = refused.value.errors()
    assert (problem["loc"][0], problem["type"]) == (field, "label_not_visible_ascii")
    assert getattr(ClaimRequest.model_validate({"key": "k-1", field: "Lead intake"}), field)


def test_an_execution_id_may_still_be_a_number() -> None:
    """n8n sends execution ids as numbers too."""
    assert Envelope.model_validate({**BASE, "execution_id": 1234}).execution_id == 1234
