"""Failing statements leave no key and no payload value in any log line (finding: SQLAlchemy
errors print their bound parameters, which hold full keys and stored bodies)."""

from __future__ import annotations

import uuid
from pathlib import Path

from tests.support import Stack, query, wait_until

# Refusals PostgreSQL makes inside the statement itself: a constraint violation's error carries
# the statement's parameters (the key, the payload, the result) unless the engine hides them,
# and its DETAIL quotes the failing row ("Failing row contains (…)") unless that is dropped.
CONSTRAINTS = """
ALTER TABLE events ADD CONSTRAINT refuse_intake CHECK (event_type <> 'refused.intake');
ALTER TABLE idempotency_keys ADD CONSTRAINT refuse_result
    CHECK (NOT (status = 'succeeded' AND event_type = 'refused.result'));
"""

ROUTES = """
[[routes]]
match = "refused.result"
action = "python"
function = "tests.actions:echo_payload"
max_attempts = 1

[[routes]]
match = "*"
action = "noop"
"""


def test_no_log_line_of_a_failing_statement_carries_a_key_or_a_payload_value(
    private_stack: Stack, tmp_path: Path
) -> None:
    """A statement PostgreSQL refuses at intake (the receiver's traceback) and while recording
    a result (the Celery task's failure traceback) is logged with its kind, message and SQL,
    never with its parameters or the quoted row: neither the full key nor a payload value
    appears in any process's log."""
    stack = private_stack
    query(stack.database_url, CONSTRAINTS)
    stack.routes_file = tmp_path / "routes.toml"
    stack.routes_file.write_text(ROUTES, encoding="utf-8")
    stack.start_all()
    secrets = {}
    with stack.client() as client:
        for event_type in ("refused.intake", "refused.result"):
            key = f"key-{uuid.uuid4().hex}"
            value = f"value-{uuid.uuid4().hex}"
            secrets[key] = value
            client.post(
                "/v1/events",
                json={
                    "source": "leak",
                    "event_type": event_type,
                    "external_id": "1",
                    "payload": {"card_holder": value},
                },
                headers={"Idempotency-Key": key},
            )
    # The worker refuses the result after the receiver refused the intake; a stopped worker
    # has finished (and logged) every task it took.
    wait_until(lambda: "refuse_result" in stack.logs("worker"), timeout=60)
    stack.stop_all()

    logs = {name: stack.logs(name) for name in ("receiver", "relay", "worker")}
    assert "refuse_intake" in logs["receiver"]
    assert "refuse_result" in logs["worker"]
    leaks = [
        (name, what)
        for name, text in logs.items()
        for key, value in secrets.items()
        for what, secret in (("key", key), ("payload value", value))
        if secret in text
    ]
    assert leaks == []
