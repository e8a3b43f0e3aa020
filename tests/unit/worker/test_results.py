"""Unit tests for worker.results: every result becomes storable JSON, with a note when
something had to go."""

from __future__ import annotations

import json

import pytest

from worker.results import MAX_RESULT_BYTES, storable_ref, storable_result


def test_plain_json_is_kept_as_it_is() -> None:
    """A JSON-able result is stored unchanged."""
    value = {"status_code": 201, "body": {"id": "T-1", "tags": ["a", "b"]}}
    assert json.loads(storable_result(value)) == value


@pytest.mark.parametrize("value", [object(), {1, 2}, {"when": object()}, b"bytes"])
def test_a_value_that_is_not_json_is_replaced_by_a_note(value: object) -> None:
    """Not JSON: a note naming the type, never an exception."""
    assert "result_dropped" in json.loads(storable_result(value))


def test_nul_characters_and_infinities_are_replaced_and_noted() -> None:
    """U+0000 (which PostgreSQL refuses) becomes U+FFFD, inf and NaN become null."""
    stored = json.loads(storable_result({"a\x00": ["x\x00y", float("nan")], "n": float("inf")}))
    assert stored["value"] == {"a\ufffd": ["x\ufffdy", None], "n": None}
    assert stored["result_note"]


def test_a_result_over_the_bound_is_dropped_with_its_size() -> None:
    """Over 64 KiB: only a note with the size is kept."""
    stored = json.loads(storable_result({"blob": "x" * MAX_RESULT_BYTES}))
    assert str(MAX_RESULT_BYTES) in stored["result_dropped"]


def test_the_external_reference_fits_its_column() -> None:
    """NULs replaced, at most 500 characters."""
    assert storable_ref("a\x00b") == "a\ufffdb"
    assert len(storable_ref("r" * 1000) or "") == 500
    assert storable_ref(None) is None
