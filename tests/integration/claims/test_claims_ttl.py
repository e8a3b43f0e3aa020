"""The TTL purge and workflow keys: time is moved in the database (the keys' own timestamps),
never waited for."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from outbox.core.settings import Settings
from outbox.maintenance.purge import purge
from outbox.store.engines import create_sync_engine
from tests.support import Stack, claim, claim_call, query


@pytest.fixture
def engine(stack: Stack) -> Iterator[Engine]:
    created = create_sync_engine(Settings(database_url=stack.database_url, redis_url="redis://x"))
    yield created
    created.dispose()


def _fail(stack: Stack, key: str, effect: str) -> None:
    token = claim(stack, key).json()["lease_token"]
    failed = claim_call(
        stack,
        key,
        "fail",
        {"lease_token": token, "error_code": "timeout", "retryable": True, "effect": effect},
    )
    assert failed.json()["status"] == "failed_retryable", failed.text


def _age(stack: Stack, key: str, *, first_claim: str, last_change: str) -> None:
    """The key's TTL (30 days) started `first_claim` ago and it last changed `last_change` ago."""
    query(
        stack.database_url,
        "UPDATE idempotency_keys SET created_at = now() - CAST(%s AS interval),"
        " expires_at = now() - CAST(%s AS interval) + interval '30 days',"
        " updated_at = now() - CAST(%s AS interval) WHERE idempotency_key = %s",
        (first_claim, first_claim, last_change, key),
    )


def _keys(stack: Stack) -> set[str]:
    return {k for (k,) in query(stack.database_url, "SELECT idempotency_key FROM idempotency_keys")}


def test_an_uncertain_workflow_key_outlives_its_ttl_and_the_next_claim_is_told(
    stack: Stack, engine: Engine
) -> None:
    """A failed_retryable workflow key whose effect may exist is never purged, however old,
    so the next claim still answers uncertain: true."""
    _fail(stack, "maybe-sent", effect="unknown")
    _age(stack, "maybe-sent", first_claim="40 days", last_change="35 days")
    assert purge(engine, dry_run=True).expired_keys == 0
    assert purge(engine, dry_run=False).expired_keys == 0
    again = claim(stack, "maybe-sent")
    assert again.status_code == 201 and again.json()["uncertain"] is True


def test_a_workflow_key_whose_lease_expired_is_never_purged(stack: Stack, engine: Engine) -> None:
    """A processing workflow key past its TTL is kept whether its lease is live or expired (its
    holder may have acted): the next claim is a reclaim that answers uncertain: true."""
    for key in ("live", "lapsed"):
        assert claim(stack, key).status_code == 201
        _age(stack, key, first_claim="40 days", last_change="35 days")
    query(
        stack.database_url,
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 second',"
        " in_flight_until = NULL"
        " WHERE idempotency_key = 'lapsed'",
    )
    assert purge(engine, dry_run=False).expired_keys == 0
    assert _keys(stack) == {"live", "lapsed"}
    again = claim(stack, "lapsed").json()
    assert again["reclaimed"] is True and again["uncertain"] is True


def test_a_workflow_key_expires_from_its_last_change(stack: Stack, engine: Engine) -> None:
    """A certain failed_retryable key first claimed 40 days ago but changed an hour ago is kept;
    once its last change is older than its TTL, it is purged."""
    _fail(stack, "retried", effect="none")
    _age(stack, "retried", first_claim="40 days", last_change="1 hour")
    assert purge(engine, dry_run=False).expired_keys == 0
    assert _keys(stack) == {"retried"}
    _age(stack, "retried", first_claim="40 days", last_change="31 days")
    assert purge(engine, dry_run=True).expired_keys == 1
    assert purge(engine, dry_run=False).expired_keys == 1
    assert _keys(stack) == set()
