"""`idem demo` tells its story to the end on embedded servers; its fake CRM works as documented."""

from __future__ import annotations

import os

import httpx
import pytest

from examples.fake_crm import FakeCrm
from tests.support import ROOT, run_idem

STEPS = (
    "1) A lead arrives from a web form.",
    "2) The CRM creates the follow-up task",
    "3) The attempt is marked uncertain.",
    "4) The recovery step asks the CRM by the event key",
    "5) The form provider redelivers the original event.",
    "6) The end.",
)


def test_demo_ends_with_one_task_on_embedded_servers() -> None:
    """`idem demo` without DATABASE_URL/REDIS_URL exits 0 after telling every step, the replay
    and exactly one side effect."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env["PYTHONPATH"] = str(ROOT)
    done = run_idem("demo", env=env)
    output = done.stdout
    assert done.returncode == 0, output + done.stderr[-3000:]
    for step in STEPS:
        assert step in output, step
    assert "Idempotent-Replayed: true" in output
    assert "side effects: 1 task\n" in output


@pytest.fixture
def crm() -> FakeCrm:
    return FakeCrm()


def test_fake_crm_lookup_is_404_before_and_200_after_a_create(crm: FakeCrm) -> None:
    """The by-key lookup answers 404 for an unknown key and 200 with the task once created."""
    url = crm.start()
    try:
        with httpx.Client(base_url=url, timeout=5) as client:
            assert client.get("/api/tasks/by-key/lead%3A1").status_code == 404
            created = client.post(
                "/api/tasks",
                json={"customer": "Ada", "assignee": "Sales"},
                headers={"Idempotency-Key": "lead:1"},
            )
            assert created.status_code == 201
            task = created.json()
            assert task == {
                "id": "T-1",
                "assignee": "Sales",
                "title": "Follow up with Ada",
                "idempotency_key": "lead:1",
            }
            found = client.get("/api/tasks/by-key/lead%3A1")
            assert (found.status_code, found.json()) == (200, task)
            assert client.get("/api/tasks").json() == [task]
    finally:
        crm.stop()


@pytest.mark.parametrize("mode", ["drop", "delay"])
def test_fake_crm_loses_the_answer_but_keeps_the_task(crm: FakeCrm, mode: str) -> None:
    """lose_next_response() commits the task and gives the client no answer (a dropped
    connection, or one later than its timeout); the create after it is answered again."""
    url = crm.start()
    try:
        crm.lose_next_response("drop" if mode == "drop" else "delay", delay=1.0)
        with httpx.Client(base_url=url, timeout=0.3) as client:
            with pytest.raises(httpx.TransportError):
                client.post(
                    "/api/tasks", json={"assignee": "Sales"}, headers={"Idempotency-Key": "k"}
                )
            assert [t["idempotency_key"] for t in crm.tasks] == ["k"]
            assert crm.lost == 1
            assert client.get("/api/tasks/by-key/k").status_code == 200
            again = client.post(
                "/api/tasks", json={"assignee": "Sales"}, headers={"Idempotency-Key": "k2"}
            )
            assert again.status_code == 201
    finally:
        crm.stop()
