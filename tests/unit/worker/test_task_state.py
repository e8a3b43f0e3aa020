"""An attempt's outcome becomes the task's state: a return for what ended well or was given
back, a Retry for a retry, an expected failure for a dead letter, each naming only the code."""

from __future__ import annotations

import pickle

import pytest
from celery.exceptions import Retry

from worker.task_state import DeadLettered, Finished, RetryScheduled, report


@pytest.mark.parametrize("outcome", ["succeeded", "deferred", "superseded", "blocked"])
def test_what_ended_well_or_was_given_back_returns_its_name(outcome: str) -> None:
    returned = report(Finished(outcome))
    assert returned == outcome and type(returned) is str


def test_a_retry_raises_a_retry_naming_its_code_that_survives_the_pool_pipe() -> None:
    with pytest.raises(Retry) as raised:
        report(Finished("retry", "http_503"))
    copy = pickle.loads(pickle.dumps(raised.value))
    for retry in (raised.value, copy):
        assert isinstance(retry, RetryScheduled)
        assert repr(retry) == repr(retry.exc) == "RetryScheduled('http_503')"
        assert str(retry) == "retry scheduled in the outbox: http_503"
        assert retry.sig is None and retry.when is None  # nothing to publish, no countdown


def test_a_dead_letter_raises_its_code_alone() -> None:
    with pytest.raises(DeadLettered) as raised:
        report(Finished("dead_letter", "http_422"))
    assert raised.value.args == ("http_422",)
    assert repr(pickle.loads(pickle.dumps(raised.value))) == "DeadLettered('http_422')"


def test_an_outcome_without_a_code_still_says_so() -> None:
    with pytest.raises(DeadLettered, match="unknown"):
        report(Finished("dead_letter"))
