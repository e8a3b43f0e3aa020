"""How a finished attempt shows in Celery's task state, and so in Flower.

The outcome is already recorded in PostgreSQL when the task ends; the task state only reports
it. A retry ends the task as RETRY and a dead letter as FAILURE, each naming the error code, so
Flower's Retried and Failed views list what operators must look at. Neither asks Celery to do
anything: the retry waits in the outbox, not in a Celery countdown.

- A retry raises `RetryScheduled`, a `celery.exceptions.Retry`, itself, never `Task.retry`
  (which publishes a new message first): the worker acknowledges the message and sends
  `task-retried`.
- A dead letter raises `DeadLettered`, one of the task's expected errors (`throws`): Celery
  logs one INFO line without a traceback, acknowledges the message (`acks_late` acknowledges a
  failed task, `task_acks_on_failure_or_timeout`) and sends `task-failed`. There is no result
  backend to write to (`task_ignore_result`).

Only an exception raised in the task's own code travels this way; a lost worker process is
still rejected and redelivered (`task_reject_on_worker_lost`).
"""

from __future__ import annotations

from celery.exceptions import Retry


class Finished(str):
    """An attempt's outcome name (what callers and the task's log line compare) carrying the
    error code it ended with, which the outcome name alone does not say."""

    error_code: str

    def __new__(cls, outcome: str, error_code: str = "") -> Finished:
        finished = super().__new__(cls, outcome)
        finished.error_code = error_code
        return finished


class DeadLettered(Exception):
    """The attempt ended the key in a dead letter; the message is the error code."""


class RetryScheduled(Retry):  # type: ignore[misc]
    """The attempt scheduled a retry through the outbox. Raised as it is, never through
    `Task.retry`: nothing is published. Its repr is what Flower shows as the exception."""

    def __init__(self, error_code: str) -> None:
        super().__init__(f"retry scheduled in the outbox: {error_code}")
        self.error_code = error_code
        # Its own cause: the `task-retried` event shows the cause of the Retry (prefork pool)
        # or the Retry itself (threads pool, where billiard wraps it); either way this.
        self.exc = self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.error_code!r})"

    def __reduce__(self) -> tuple[type[RetryScheduled], tuple[str]]:
        # Across the prefork pool's pipe, rebuilt from the code alone.
        return type(self), (self.error_code,)


def report(finished: Finished) -> str:
    """The task's return value for an attempt that ended well or was given back; raise for
    a retry (RETRY) or a dead letter (FAILURE). Only the error code leaves the worker: never
    a detail, which may quote the downstream's answer."""
    code = finished.error_code or "unknown"
    if finished == "retry":
        raise RetryScheduled(code)
    if finished == "dead_letter":
        raise DeadLettered(code)
    return str(finished)
