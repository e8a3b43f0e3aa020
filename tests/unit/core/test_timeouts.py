"""Unit tests for outbox.core.timeouts: the lease, the action timeouts and the broker's visibility
timeout must fit together, and every rule a configuration breaks is named with its values."""

from __future__ import annotations

import pytest

from outbox.core.routes import DEFAULT_ROUTES, Route, RouteTable
from outbox.core.settings import Settings
from outbox.core.timeouts import TimingError, check_timing, timing_problems


@pytest.fixture(autouse=True)
def _no_timing_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings fill unset fields from the environment; these tests name every value."""
    for name in ("LEASE_SECONDS", "VISIBILITY_TIMEOUT", "BROKER_URL", "REDIS_URL"):
        monkeypatch.delenv(name, raising=False)


def _http(name: str = "crm", connect: float = 5.0, read: float = 10.0) -> Route:
    return Route(
        match=f"{name}.*",
        name=name,
        action="http",
        url="https://crm.example/tasks",
        connect_timeout_seconds=connect,
        read_timeout_seconds=read,
    )


def test_defaults_fit_together() -> None:
    """The default settings with a default http route and the default noop table break no
    rule."""
    assert timing_problems(Settings(), RouteTable([_http()])) == []
    assert timing_problems(Settings(), DEFAULT_ROUTES) == []
    check_timing(Settings(), RouteTable([_http()]))


def test_the_test_stack_timings_fit_together() -> None:
    """A 5 s lease with 1 s + 1 s route timeouts and the default visibility timeout passes."""
    settings = Settings(lease_seconds=5)
    assert timing_problems(settings, RouteTable([_http(connect=1, read=1)])) == []


def test_visibility_timeout_below_twice_lease_plus_renewal_is_reported() -> None:
    """VISIBILITY_TIMEOUT under 2 x (lease + lease/3) is reported with all three values."""
    settings = Settings(lease_seconds=30, visibility_timeout=79)
    problems = timing_problems(settings, DEFAULT_ROUTES)
    assert len(problems) == 1
    assert "VISIBILITY_TIMEOUT=79" in problems[0]
    assert "80 s" in problems[0]
    assert "LEASE_SECONDS=30" in problems[0]
    assert "renewal 10" in problems[0]


def test_visibility_timeout_is_not_checked_on_rabbitmq() -> None:
    """RabbitMQ has no visibility timeout (it redelivers when the holder's connection ends): a
    VISIBILITY_TIMEOUT Redis would refuse is no problem with an amqp:// BROKER_URL."""
    settings = Settings(lease_seconds=30, visibility_timeout=79, broker_url="amqp://h/")
    assert timing_problems(settings, DEFAULT_ROUTES) == []
    redis = Settings(lease_seconds=30, visibility_timeout=79, broker_url="redis://h/0")
    assert len(timing_problems(redis, DEFAULT_ROUTES)) == 1


def test_visibility_timeout_at_the_minimum_passes() -> None:
    """A visibility timeout of exactly 2 x (lease + lease/3) is enough."""
    assert timing_problems(Settings(lease_seconds=30, visibility_timeout=80), DEFAULT_ROUTES) == []


def test_visibility_timeout_with_a_fractional_minimum_is_reported() -> None:
    """LEASE_SECONDS=5 needs 13.33 s; VISIBILITY_TIMEOUT=13 is refused, 14 accepted."""
    problems = timing_problems(Settings(lease_seconds=5, visibility_timeout=13), DEFAULT_ROUTES)
    assert len(problems) == 1
    assert "VISIBILITY_TIMEOUT=13" in problems[0] and "LEASE_SECONDS=5" in problems[0]
    assert "13.3333" in problems[0]
    assert timing_problems(Settings(lease_seconds=5, visibility_timeout=14), DEFAULT_ROUTES) == []


@pytest.mark.parametrize(("connect", "read"), [(2, 3), (1, 4), (0.5, 4.5), (3, 10)])
def test_route_timeouts_reaching_the_lease_are_reported(connect: float, read: float) -> None:
    """An http route whose connect + read timeout is at least LEASE_SECONDS is reported with
    its name and both timeouts."""
    settings = Settings(lease_seconds=5)
    problems = timing_problems(settings, RouteTable([_http("slow", connect, read)]))
    assert len(problems) == 1
    assert "'slow'" in problems[0]
    assert f"connect_timeout_seconds ({connect:g})" in problems[0]
    assert f"read_timeout_seconds ({read:g})" in problems[0]
    assert "LEASE_SECONDS=5" in problems[0]


def test_route_timeouts_just_below_the_lease_pass() -> None:
    """A connect + read timeout just under LEASE_SECONDS is accepted."""
    settings = Settings(lease_seconds=5)
    assert timing_problems(settings, RouteTable([_http(connect=2, read=2.9)])) == []


def test_non_http_routes_have_no_action_timeout() -> None:
    """noop and python routes never break the timeout rule, even with a one-second lease."""
    routes = RouteTable(
        [
            Route(match="a.*", action="noop"),
            Route(match="b.*", action="python", function="pkg.mod:fn"),
        ]
    )
    assert timing_problems(Settings(lease_seconds=1, visibility_timeout=3), routes) == []


def test_every_broken_rule_is_reported_and_check_timing_names_them_all() -> None:
    """Each broken rule is one problem (the visibility timeout and every slow route), and
    check_timing raises one TimingError naming all of them."""
    settings = Settings(lease_seconds=5, visibility_timeout=6)
    routes = RouteTable([_http("fast", 1, 1), _http("slow-a", 2, 3), _http("slow-b", 4, 4)])
    problems = timing_problems(settings, routes)
    assert len(problems) == 3
    assert "VISIBILITY_TIMEOUT=6" in problems[0]
    assert "'slow-a'" in problems[1] and "'slow-b'" in problems[2]
    assert not any("'fast'" in p for p in problems)
    with pytest.raises(TimingError) as raised:
        check_timing(settings, routes)
    message = str(raised.value)
    for problem in problems:
        assert problem in message
