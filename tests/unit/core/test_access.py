"""The failed-credential throttle's window and the start-up token check, without a server."""

from __future__ import annotations

import pytest

from outbox.core.access import FailureThrottle, is_loopback
from outbox.core.bearer import bearer_token
from outbox.core.settings import Settings
from outbox.core.tokens import TokenError, check_tokens, configured_tokens, weak_tokens


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_address_is_held_until_its_oldest_failure_leaves_the_window() -> None:
    """Three failures in a 60 s window hold the address; Retry-After counts down to the moment
    the first failure is 60 s old, and then the address may try again."""
    clock = Clock()
    throttle = FailureThrottle(3, 60, clock=clock)
    for step in (0, 10, 20):
        clock.now = 1000.0 + step
        assert throttle.retry_after("a") is None
        throttle.failed("a")
    assert throttle.retry_after("a") == 40
    assert throttle.retry_after("b") is None
    clock.now = 1059.5
    assert throttle.retry_after("a") == 1
    clock.now = 1060.0
    assert throttle.retry_after("a") is None


def test_only_failures_past_the_limit_are_told_to_wait_and_guessing_keeps_an_address_held() -> None:
    """`failed` answers None for the first three failures and the wait for the fourth; each
    further failure is counted, so the wait runs from the oldest of the last three."""
    clock = Clock()
    throttle = FailureThrottle(3, 60, clock=clock)
    answers = []
    for step in (0, 10, 20, 30):
        clock.now = 1000.0 + step
        answers.append(throttle.failed("a"))
    assert answers == [None, None, None, 40]
    clock.now = 1065.0
    assert throttle.failed("a") == 15
    assert throttle.failed("b") is None


def test_the_throttle_forgets_the_oldest_addresses_beyond_its_capacity() -> None:
    """Memory stays bounded: past `max_addresses`, the least recently failing address goes."""
    throttle = FailureThrottle(1, 60, clock=Clock(), max_addresses=2)
    for address in ("a", "b", "c"):
        throttle.failed(address)
    assert throttle.retry_after("a") is None
    assert throttle.retry_after("b") == 60
    assert throttle.retry_after("c") == 60


@pytest.mark.parametrize(
    ("header", "token"),
    [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None), ("Bearer ", None)],
)
def test_bearer_token(header: str, token: str | None) -> None:
    """Only the Bearer scheme carries a token."""
    assert bearer_token(header) == token


def test_loopback_addresses() -> None:
    """127.0.0.0/8 and ::1 are this machine; other addresses and names are not."""
    assert is_loopback("127.0.0.1") and is_loopback("127.8.0.1") and is_loopback("::1")
    assert not is_loopback("10.0.0.1") and not is_loopback("unknown")


def test_weak_tokens_are_named_and_unset_ones_pass() -> None:
    """A set token under 32 characters is refused with how to make one; an unset one is not
    checked."""
    settings = Settings(operator_token="x" * 31, metrics_token="")
    assert weak_tokens(configured_tokens(settings)) == [
        "OPERATOR_TOKEN is shorter than 32 characters"
    ]
    with pytest.raises(TokenError, match=r"openssl rand -hex 32"):
        check_tokens(configured_tokens(settings))
    check_tokens([("OPERATOR_TOKEN", "2483433c2ea714f3e48cf63e0fe5bce3"), ("CLAIMS_TOKEN", "")])
