"""n8n's answers on real processes: a webhook not yet registered is retried, and the Idem
Trigger's "in progress" is waited out without spending an attempt."""

from __future__ import annotations

from tests.support import Downstream, Reply, Stack, envelope, finished, query

NOT_REGISTERED = {"code": 404, "message": 'The requested webhook "POST crm" is not registered.'}


def _send(stack: Stack, external_id: str) -> str:
    with stack.client() as client:
        answer = client.post("/v1/events", json=envelope(external_id, event_type="n8n.lead"))
    assert answer.status_code == 202, answer.text
    key: str = answer.json()["key"]
    return key


def test_a_webhook_not_yet_registered_is_retried_until_n8n_takes_it(
    stack: Stack, downstream: Downstream
) -> None:
    """n8n's 404 "not registered" on the first request is asked again, spending no attempt
    (no workflow listened: nothing ran); the second request succeeds, the key's one attempt
    is the one that acted, and the effect happens once."""
    downstream.behaviour = lambda _key, n: (
        Reply(404, extra=NOT_REGISTERED, commit=False) if n == 1 else Reply()
    )
    key = _send(stack, "n8n-1")
    state = finished(stack, key)
    assert (state["status"], state["attempts"]) == ("succeeded", 1)
    assert len(downstream.request_times(key)) == 2
    assert downstream.effects == {key: 1}


def test_in_progress_is_waited_out_without_spending_an_attempt(
    stack: Stack, downstream: Downstream
) -> None:
    """Two "in progress" answers then a success end the key succeeded with one attempt
    counted, its deadline clock started, and no dead letter, on a route of two attempts."""
    downstream.behaviour = lambda _key, n: (
        Reply(409, extra={"idem": "in_progress", "retry_after": 1}, commit=False)
        if n <= 2
        else Reply()
    )
    key = _send(stack, "n8n-2")
    state = finished(stack, key)
    assert (state["status"], state["attempts"]) == ("succeeded", 1)
    assert len(downstream.request_times(key)) == 3
    assert query(
        stack.database_url,
        "SELECT first_failed_at IS NOT NULL FROM idempotency_keys WHERE idempotency_key = %s",
        (key,),
    ) == [(True,)]
    assert query(stack.database_url, "SELECT count(*) FROM dead_letters") == [(0,)]
